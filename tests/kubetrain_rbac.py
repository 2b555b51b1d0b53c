"""What the operator's code does on the Kubernetes API, read from the code itself,
and what a rendered chart grants, so that tests can hold the two equal.

Nothing here is a hand-kept list of verbs. The uses are derived:
- client calls: every attribute in operator/kubetrain/*.py that names a method of
  a Kubernetes client API class the operator instantiates (`client.CoreV1Api(...)`).
  The client's own source gives the method's path and HTTP method
  (`'/api/v1/namespaces/{namespace}/pods', 'POST'`); from them come the group,
  the resource, the subresource and the verb (GET on a collection is `list`, and
  also `watch` when `watch=True` reaches the call, directly or through a function
  that forwards its `**kwargs`). CustomObjectsApi takes group and plural from
  the call's arguments, resolved in the calling module.
- kopf: `@kopf.on.event(...)` and `@kopf.index(...)` list and watch their
  resource. Other resource handlers (on.create, timers, ...) keep progress on the
  object (patch) and are refused until this derivation learns them.
- kopf's own calls, from the settings its startup handler writes: it posts events
  unless `settings.posting.enabled = False`, and lists namespaces and watches
  CRDs unless `settings.scanning.disabled = True`.
- builders: an owner reference with `blockOwnerDeletion: True` needs `update` on
  the owner's `finalizers` (where the OwnerReferencesPermissionEnforcement
  admission plugin is on).
Where: calls in leader.py act in the operator's own namespace (the Lease); the
other namespaced resources in the namespaces it manages; nodes cluster-wide.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

ROOT = Path(__file__).resolve().parents[1]
OPERATOR = ROOT / "operator" / "kubetrain"
CRD = ROOT / "crds" / "trainingjob.yaml"

WATCHED, OWN, CLUSTER = "managed namespaces", "operator namespace", "cluster"
OWN_NAMESPACE_MODULES = frozenset({"leader"})
"""Modules whose namespaced calls go to the operator's own namespace, not to the managed ones."""
OTHER_SCOPES = {("kueue.x-k8s.io", "workloads"): True, ("kueue.x-k8s.io", "resourceflavors"): False,
                ("kueue.x-k8s.io", "workloadpriorityclasses"): False, ("scheduling.k8s.io", "priorityclasses"): False}
"""Whether the resources of other APIs the operator uses (Kueue's, issue 14) are namespaced."""
NO_API_DECORATORS = frozenset({"startup", "cleanup", "probe", "login"})
WATCHING_DECORATORS = frozenset({"event", "index"})

Grants = dict[tuple[str, str], set[str]]


@dataclass(frozen=True, order=True)
class Use:
    scope: str       # WATCHED, OWN or CLUSTER
    group: str
    resource: str    # with its subresource: "trainingjobs/status"
    verb: str
    where: str = ""  # module:line, for messages

    @property
    def key(self) -> tuple[str, str, str, str]:
        return self.scope, self.group, self.resource, self.verb


def used() -> dict[str, Grants]:
    """{scope: {(group, resource): verbs}} of everything the operator's code does."""
    out: dict[str, Grants] = {}
    for use in uses():
        out.setdefault(use.scope, {}).setdefault((use.group, use.resource), set()).add(use.verb)
    return out


def uses() -> list[Use]:
    if str(ROOT / "operator") not in sys.path:
        sys.path.insert(0, str(ROOT / "operator"))
    found: list[Use] = []
    modules = sorted(p for p in OPERATOR.glob("*.py"))
    trees = {p.stem: ast.parse(p.read_text(), filename=str(p)) for p in modules}
    api_classes = _instantiated_api_classes(trees.values())
    for name, tree in trees.items():
        found += _client_uses(name, tree, api_classes)
        found += _kopf_uses(name, tree)
        found += _owner_reference_uses(name, tree)
    return found


# ------------------------------------------------------------------ client calls

_CALL_API = re.compile(r"call_api\(\s*'([^']+)',\s*'([A-Z]+)'")


def _instantiated_api_classes(trees: Iterable[ast.AST]) -> list[type]:
    from kubernetes import client

    names = {node.func.attr for tree in trees for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and isinstance(node.func.value, ast.Name) and node.func.value.id == "client"
             and node.func.attr.endswith("Api") and node.func.attr != "ApiClient"}
    return [getattr(client, n) for n in sorted(names)]


def _client_uses(module: str, tree: ast.AST, classes: list[type]) -> list[Use]:
    parents = _parents(tree)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        cls = next((c for c in classes if hasattr(c, node.attr + "_with_http_info")), None)
        if cls is None:
            continue
        source = inspect.getsource(getattr(cls, node.attr + "_with_http_info"))
        match = _CALL_API.search(source)
        if not match:
            raise AssertionError(f"{module}:{node.lineno}: no API path in the client's {cls.__name__}.{node.attr}")
        path, method = match.groups()
        args = _call_args(node, parents, getattr(cls, node.attr))
        group, resource, named, namespaced = _parse_path(path, args, module, node.lineno)
        verbs = {"POST": ["create"], "PUT": ["update"], "PATCH": ["patch"]}.get(method)
        if method == "GET":
            verbs = ["get"] if named else ["list"] + (["watch"] if _watches(node, parents, tree) else [])
        elif method == "DELETE":
            verbs = ["delete"] if named else ["deletecollection"]
        if verbs is None:
            raise AssertionError(f"{module}:{node.lineno}: HTTP {method} of {path} has no RBAC verb here")
        scope = CLUSTER if not namespaced else OWN if module in OWN_NAMESPACE_MODULES else WATCHED
        out += [Use(scope, group, resource, v, f"{module}:{node.lineno}") for v in verbs]
    return out


def _parse_path(path: str, args: dict[str, Any], module: str, line: int) -> tuple[str, str, bool, bool]:
    """(group, resource[/subresource], names one object, namespaced) of a client path."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    else:
        group, rest = parts[1], parts[3:]
    if group == "{group}":
        group = _resolved(args, "group", module, line)
    namespaced = rest[:2] == ["namespaces", "{namespace}"] and len(rest) > 2
    if namespaced:
        rest = rest[2:]
    resource = rest[0]
    if resource == "{plural}":
        resource = _resolved(args, "plural", module, line)
    if not namespaced:  # e.g. /api/v1/pods: a namespaced resource, listed across namespaces
        namespaced = _is_namespaced(group, resource)
    named = len(rest) > 1
    return group, resource + (f"/{rest[2]}" if len(rest) > 2 else ""), named, namespaced


def _is_namespaced(group: str, resource: str) -> bool:
    from kubernetes import client

    if group == "":
        return hasattr(client.CoreV1Api, f"list_namespaced_{_singular_core(resource)}")
    if (group, resource) in OTHER_SCOPES:
        return OTHER_SCOPES[(group, resource)]
    crd = yaml.safe_load(CRD.read_text())
    if (group, resource) == (crd["spec"]["group"], crd["spec"]["names"]["plural"]):
        return crd["spec"]["scope"] == "Namespaced"
    raise AssertionError(f"scope of {group}/{resource} unknown to this derivation")


def _singular_core(resource: str) -> str:
    from kubernetes import client

    for name in dir(client.CoreV1Api):
        m = re.fullmatch(r"list_(\w+)_for_all_namespaces|list_namespaced_(\w+)|list_(\w+)", name)
        if m and not name.endswith("_with_http_info"):
            singular = next(g for g in m.groups() if g)
            src = inspect.getsource(getattr(client.CoreV1Api, name + "_with_http_info"))
            if _CALL_API.search(src).group(1).rstrip("/").split("/")[-1] == resource:
                return singular
    raise AssertionError(f"core resource {resource} unknown to the client")


def _call_args(node: ast.Attribute, parents: dict[ast.AST, ast.AST], method: Any) -> dict[str, Any]:
    """The AST arguments that reach `method`, by parameter name: a direct call, or a wrapper
    such as `api.call("what", api.custom.get_..., GROUP, VERSION, ...)` that passes the rest on."""
    call = parents.get(node)
    if not isinstance(call, ast.Call):
        return {}
    if call.func is node:
        args = call.args
    elif node in call.args:
        args = call.args[call.args.index(node) + 1:]
    else:
        return {}
    params = [p for p in inspect.signature(method).parameters if p not in ("self", "kwargs")]
    return dict(zip(params, args))


def _resolved(args: dict[str, Any], param: str, module: str, line: int) -> str:
    node = args.get(param)
    mod = importlib.import_module(f"kubetrain.{module}")
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and isinstance(getattr(mod, node.id, None), str):
        return getattr(mod, node.id)
    raise AssertionError(f"{module}:{line}: cannot tell the {param} of this call from the code")


def _watches(node: ast.Attribute, parents: dict[ast.AST, ast.AST], tree: ast.AST) -> bool:
    call = parents.get(node)
    if isinstance(call, ast.Call) and _has_watch_true(call):
        return True
    forwards = isinstance(call, ast.Call) and any(k.arg is None for k in call.keywords)
    func = _enclosing_function(node, parents)
    if not forwards or func is None:
        return False
    return any(isinstance(c, ast.Call) and _called_name(c) == func.name and _has_watch_true(c)
               for c in ast.walk(tree))


def _has_watch_true(call: ast.Call) -> bool:
    return any(k.arg == "watch" and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords)


def _called_name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _enclosing_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> ast.FunctionDef | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node  # type: ignore[return-value]
    return None


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}


# ------------------------------------------------------------------ kopf

def _kopf_uses(module: str, tree: ast.AST) -> list[Use]:
    out: list[Use] = []
    uses_kopf = False
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            if not isinstance(dec, ast.Call):
                continue
            chain = _dotted(dec.func)
            if not chain or chain[0] != "kopf":
                continue
            uses_kopf = True
            kind = chain[-1]
            if kind in NO_API_DECORATORS:
                continue
            if kind not in WATCHING_DECORATORS:
                raise AssertionError(f"{module}:{dec.lineno}: kopf.{'.'.join(chain[1:])} also writes progress to "
                                     "the object (patch): teach tests/kubetrain_rbac.py what it needs")
            spec = [_resolved({"x": a}, "x", module, dec.lineno) for a in dec.args]
            if len(spec) == 1:
                group, resource = "", spec[0]
            elif len(spec) == 3:
                group, resource = spec[0], spec[2]
            else:
                raise AssertionError(f"{module}:{dec.lineno}: kopf resource spec {spec} unknown to this derivation")
            scope = WATCHED if _is_namespaced(group, resource) else CLUSTER
            out += [Use(scope, group, resource, v, f"{module}:{dec.lineno} (kopf)") for v in ("list", "watch")]
    if uses_kopf:
        where = f"{module} (kopf settings)"
        if not _assigns(tree, ("settings", "posting", "enabled"), False):
            out += [Use(WATCHED, "", "events", "create", where)]
        if not _assigns(tree, ("settings", "scanning", "disabled"), True):
            out += [Use(CLUSTER, "", "namespaces", v, where) for v in ("list", "watch")]
            out += [Use(CLUSTER, "apiextensions.k8s.io", "customresourcedefinitions", v, where)
                    for v in ("list", "watch")]
    return out


def _dotted(node: ast.AST) -> tuple[str, ...]:
    if isinstance(node, ast.Name):
        return (node.id,)
    if isinstance(node, ast.Attribute):
        return (*_dotted(node.value), node.attr)
    return ()


def _assigns(tree: ast.AST, target: tuple[str, ...], value: object) -> bool:
    return any(isinstance(n, ast.Assign) and any(_dotted(t) == target for t in n.targets)
               and isinstance(n.value, ast.Constant) and n.value.value is value for n in ast.walk(tree))


# ------------------------------------------------------------------ owner references

def _owner_reference_uses(module: str, tree: ast.AST) -> list[Use]:
    out = []
    crd = yaml.safe_load(CRD.read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.Dict):
            continue
        items = {k.value: v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)}
        block = items.get("blockOwnerDeletion")
        if not (isinstance(block, ast.Constant) and block.value is True):
            continue
        kind = _resolved({"kind": items.get("kind")}, "kind", module, node.lineno)
        if kind != crd["spec"]["names"]["kind"]:
            raise AssertionError(f"{module}:{node.lineno}: owner kind {kind} unknown to this derivation")
        out.append(Use(WATCHED, crd["spec"]["group"], crd["spec"]["names"]["plural"] + "/finalizers", "update",
                       f"{module}:{node.lineno} (blockOwnerDeletion)"))
    return out


# ------------------------------------------------------------------ what a chart grants

def granted(docs: list[dict[str, Any]]) -> dict[str | None, Grants]:
    """{namespace (None: cluster-wide): {(group, resource): verbs}} that the bindings in `docs` give."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs
             if d["kind"] in ("Role", "ClusterRole")}
    out: dict[str | None, Grants] = {}
    for binding in docs:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        ref = binding["roleRef"]
        where = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        role = roles[(ref["kind"], where if ref["kind"] == "Role" else None, ref["name"])]
        for rule in role.get("rules") or ():
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    out.setdefault(where, {}).setdefault((group, resource), set()).update(rule["verbs"])
    return out


def describe(grants: Grants) -> list[str]:
    return sorted(f"{g or 'core'}/{r}: {v}" for (g, r), verbs in grants.items() for v in sorted(verbs))


def helm_template(helm: str, release: str, namespace: str, *sets: str) -> list[dict[str, Any]]:
    """`helm template` of charts/kubetrain: the objects, parsed."""
    import subprocess

    args = [helm, "template", release, str(ROOT / "charts" / "kubetrain"), "--namespace", namespace]
    for s in sets:
        args += ["--set-json", s]
    out = subprocess.run(args, capture_output=True, text=True, timeout=180, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]
