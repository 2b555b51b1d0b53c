"""How the test node agent turns a pod spec into local processes: their env, argv, paths and files.

Pure functions over plain dicts (the pod as the API serves it as JSON): no
API calls, no processes. Lookups of Secrets and ConfigMaps (and token
requests) are passed in as callables, so every rule here (env resolution, path
rewriting, volume contents) is readable in one place and testable without a
cluster. How the processes' fate reads as pod status is `agent_status.py`.

The path rule, in one sentence: each pod gets a private root folder, every
volume mount lands at ``<root>/<mountPath>``, and any environment value or
command/args item that is an absolute path equal to or under a ``mountPath``
(or the container's ``terminationMessagePath``) is rewritten to the local
file. So ``KUBETRAIN_DEEPSPEED_CONFIG=/etc/kubetrain/deepspeed/ds_config.json``
becomes ``<root>/etc/kubetrain/deepspeed/ds_config.json``.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

#: (namespace, name) -> data dict (Secret values already decoded), or None when absent.
Lookup = Callable[[str, str], "dict[str, str] | None"]
#: (audience, expirationSeconds) -> a token for the pod's ServiceAccount (a projected serviceAccountToken source).
TokenFor = Callable[[str, int], bytes]

AGENT_MARKER_ENV = "KUBETRAIN_AGENT_NODE"
"""Set in every process the agent starts; lets it find its orphans after a crash."""

TERMINATION_LOG_ENV = "KUBETRAIN_TERMINATION_LOG"
"""Writable stand-in for /dev/termination-log; its content becomes the termination message."""

SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where the ServiceAccount admission plugin mounts the pod's token; the trainer reads KUBETRAIN_SERVICEACCOUNT_DIR."""

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ContainerConfigError(Exception):
    """A referenced Secret/ConfigMap/key is missing: a kubelet's CreateContainerConfigError (retried)."""


@dataclass(frozen=True)
class ContainerPlan:
    """Everything needed to start one container as a local process."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: Path
    log_path: Path
    termination_log: Path
    message_policy: str
    """terminationMessagePolicy: File (default) or FallbackToLogsOnError."""


@dataclass(frozen=True)
class Materialized:
    """A file the agent writes before start: ``path`` gets ``content`` (mode 0o600 when secret)."""

    path: Path
    content: bytes
    secret: bool = False


@dataclass(frozen=True)
class PodPlan:
    containers: tuple[ContainerPlan, ...]
    files: tuple[Materialized, ...]
    dirs: tuple[Path, ...]


# --------------------------------------------------------------------------- env
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, $$ escapes, unknown refs stay verbatim."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _REF.sub(sub, text)


def _field_ref(pod: dict, path: str) -> str:
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.hostIP": "127.0.0.1",
        "status.podIP": "127.0.0.1",
        "status.podIPs": "127.0.0.1",
        "status.hostIPs": "127.0.0.1",
    }
    if path not in simple:
        raise ContainerConfigError(f"fieldRef {path!r} is not supported by the test node agent")
    return simple[path]


def _resource_ref(container: dict, ref: dict) -> str:
    resource = ref.get("resource", "")
    kind, _, name = resource.partition(".")
    value = ((container.get("resources") or {}).get(kind) or {}).get(name)
    if value is None:
        return "1" if name == "cpu" else "0"
    return str(value)


def _key_ref(ns: str, ref: dict, lookup: Lookup, what: str) -> str | None:
    data = lookup(ns, ref["name"])
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        missing = f"{what} {ns}/{ref['name']}" if data is None else f"key {ref['key']!r} in {what} {ns}/{ref['name']}"
        raise ContainerConfigError(f"{missing} not found")
    return data[ref["key"]]


def resolve_env(
    pod: dict, container: dict, *, base: dict[str, str], secrets: Lookup, configmaps: Lookup
) -> dict[str, str]:
    """base, then envFrom sources, then env entries (each expanded against what came before)."""
    ns = pod["metadata"]["namespace"]
    env = dict(base)
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        for kind, lookup, what in (("configMapRef", configmaps, "ConfigMap"), ("secretRef", secrets, "Secret")):
            ref = src.get(kind)
            if not ref:
                continue
            data = lookup(ns, ref["name"])
            if data is None:
                if ref.get("optional"):
                    continue
                raise ContainerConfigError(f"{what} {ns}/{ref['name']} not found")
            env.update({prefix + k: v for k, v in data.items()})
    for item in container.get("env") or []:
        name, vf = item["name"], item.get("valueFrom")
        if vf is None:
            env[name] = expand(item.get("value", ""), env)
            continue
        if "secretKeyRef" in vf:
            value = _key_ref(ns, vf["secretKeyRef"], secrets, "Secret")
        elif "configMapKeyRef" in vf:
            value = _key_ref(ns, vf["configMapKeyRef"], configmaps, "ConfigMap")
        elif "fieldRef" in vf:
            value = _field_ref(pod, vf["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in vf:
            value = _resource_ref(container, vf["resourceFieldRef"])
        else:
            raise ContainerConfigError(f"env {name}: unsupported valueFrom {sorted(vf)}")
        if value is not None:
            env[name] = value
    return env


# --------------------------------------------------------------------------- paths
def rewrite_path(value: str, mapping: dict[str, Path]) -> str:
    """The longest container path that ``value`` equals or lies under, swapped for its local twin."""
    for cpath in sorted(mapping, key=len, reverse=True):
        root = cpath.rstrip("/") or "/"
        if value == cpath or value == root:
            return str(mapping[cpath])
        if root != "/" and value.startswith(root + "/"):
            return str(mapping[cpath]) + value[len(root):]
    return value


def _local(root: Path, container_path: str) -> Path:
    return root / container_path.lstrip("/")


def _volume_files(
    pod: dict, volume: dict, target: Path, *, secrets: Lookup, configmaps: Lookup, sa_files: dict[str, bytes],
    token_for: TokenFor | None = None,
) -> list[Materialized]:
    """The files of one volume, placed under ``target`` (a mount's local folder)."""
    ns = pod["metadata"]["namespace"]
    out: list[Materialized] = []

    def from_source(lookup: Lookup, what: str, ref_name: str, items, optional: bool, secret: bool) -> None:
        data = lookup(ns, ref_name)
        if data is None:
            if optional:
                return
            raise ContainerConfigError(f"{what} {ns}/{ref_name} (volume {volume['name']}) not found")
        if items:
            for it in items:
                if it["key"] not in data:
                    if optional:
                        continue
                    raise ContainerConfigError(f"key {it['key']!r} not in {what} {ns}/{ref_name}")
                out.append(Materialized(target / it["path"], data[it["key"]].encode(), secret))
        else:
            out.extend(Materialized(target / k, v.encode(), secret) for k, v in data.items())

    def from_key_source(src: dict, secret_name_key: str) -> bool:
        """A configMap or secret source (a volume's or a projection's); False if `src` is neither."""
        if "configMap" in src:
            cm = src["configMap"]
            from_source(configmaps, "ConfigMap", cm["name"], cm.get("items"), cm.get("optional", False), False)
        elif "secret" in src:
            s = src["secret"]
            from_source(secrets, "Secret", s[secret_name_key], s.get("items"), s.get("optional", False), True)
        else:
            return False
        return True

    def from_downward(items: list | None) -> None:
        for it in items or []:
            if "fieldRef" in it:
                out.append(Materialized(target / it["path"], _field_ref(pod, it["fieldRef"]["fieldPath"]).encode()))

    # A secret volume names its Secret `secretName`; a projected secret source says `name`.
    if from_key_source(volume, "secretName"):
        return out
    if "downwardAPI" in volume:
        from_downward(volume["downwardAPI"].get("items"))
    for src in (volume.get("projected") or {}).get("sources") or []:
        if from_key_source(src, "name"):
            continue
        if "serviceAccountToken" in src:
            # A projected token has its own audience and lifetime, and is mounted whatever
            # automountServiceAccountToken says (that only concerns the API token).
            tok = src["serviceAccountToken"]
            data = (token_for(tok.get("audience") or "", int(tok.get("expirationSeconds") or 3600))
                    if token_for is not None else sa_files["token"])
            out.append(Materialized(target / tok.get("path", "token"), data, True))
        elif "downwardAPI" in src:
            from_downward(src["downwardAPI"].get("items"))
    # emptyDir, hostPath, PVCs...: an empty private folder.
    return out


def plan_pod(
    pod: dict,
    *,
    pod_dir: Path,
    node_name: str,
    python_bin: Path,
    secrets: Lookup,
    configmaps: Lookup,
    kubeconfig: bytes | None,
    sa_files: dict[str, bytes],
    extra_env: dict[str, str] | None = None,
    token_for: TokenFor | None = None,
) -> PodPlan:
    """The processes, files and folders for ``pod``; raises ContainerConfigError when a reference is missing."""
    spec = pod["spec"]
    if spec.get("initContainers"):
        raise ContainerConfigError("initContainers are not supported by the test node agent")
    root = pod_dir / "root"
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    files: list[Materialized] = []
    dirs: list[Path] = [root, pod_dir / "tmp", pod_dir / "home", pod_dir / "work"]
    kubeconfig_path = pod_dir / "kubeconfig"
    if kubeconfig is not None:
        files.append(Materialized(kubeconfig_path, kubeconfig, secret=True))
    base = {
        "PATH": f"{python_bin}:{SYSTEM_PATH}",
        "HOME": str(pod_dir / "home"),
        "TMPDIR": str(pod_dir / "tmp"),
        "HOSTNAME": spec.get("hostname") or pod["metadata"]["name"],
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        # Many processes share two cores here: one math thread each avoids thrashing.
        "OMP_NUM_THREADS": "1",
        # A container's local disk: the trainer keeps local checkpoints here, not in a shared /tmp.
        "KUBETRAIN_LOCAL_CHECKPOINT_DIR": str(pod_dir / "checkpoints"),
        **(extra_env or {}),
    }
    if kubeconfig is not None:
        base["KUBECONFIG"] = str(kubeconfig_path)
    plans = []
    materialized: set[str] = set()
    for c in spec["containers"]:
        name = c["name"]
        mapping: dict[str, Path] = {}
        for m in c.get("volumeMounts") or []:
            vol = volumes.get(m["name"])
            if vol is None:
                raise ContainerConfigError(f"container {name}: volumeMount {m['name']!r} has no volume")
            vdir = pod_dir / "volumes" / m["name"]
            dirs.append(vdir)
            if m["name"] not in materialized:
                materialized.add(m["name"])
                files.extend(_volume_files(pod, vol, vdir, secrets=secrets, configmaps=configmaps, sa_files=sa_files,
                                           token_for=token_for))
            local = vdir / m["subPath"] if m.get("subPath") else vdir
            mapping[m["mountPath"]] = local
        term_log = pod_dir / f"{name}.termination-log"
        mapping[c.get("terminationMessagePath") or "/dev/termination-log"] = term_log
        cbase = dict(base)
        if SA_MOUNT in mapping:
            cbase["KUBETRAIN_SERVICEACCOUNT_DIR"] = str(mapping[SA_MOUNT])
        env = resolve_env(pod, c, base=cbase, secrets=secrets, configmaps=configmaps)
        # Only what the pod says is a container path; the agent's own values are host paths already.
        env = {k: v if cbase.get(k) == v else rewrite_path(v, mapping) for k, v in env.items()}
        if "MASTER_ADDR" in env:
            # Every pod of a gang runs on this machine: the rendezvous host is loopback.
            env["MASTER_ADDR"] = "127.0.0.1"
        env[TERMINATION_LOG_ENV] = str(term_log)
        env[AGENT_MARKER_ENV] = node_name
        command = [expand(x, env) for x in c.get("command") or []]
        args = [expand(x, env) for x in c.get("args") or []]
        argv = [rewrite_path(x, mapping) for x in command + args]
        if not argv:
            raise ContainerConfigError(
                f"container {name} has no command: the agent ignores images, so it cannot use an ENTRYPOINT"
            )
        cwd = pod_dir / "work"
        if c.get("workingDir"):
            cwd = Path(rewrite_path(c["workingDir"], mapping))
            if cwd == Path(c["workingDir"]):
                cwd = _local(root, c["workingDir"])
            dirs.append(cwd)
        plans.append(
            ContainerPlan(
                name=name,
                argv=tuple(argv),
                env=env,
                cwd=cwd,
                log_path=pod_dir / f"{name}.log",
                termination_log=term_log,
                message_policy=c.get("terminationMessagePolicy") or "File",
            )
        )
    return PodPlan(containers=tuple(plans), files=tuple(files), dirs=tuple(dirs))


def decode_secret(data: dict[str, str] | None) -> dict[str, str]:
    return {k: base64.b64decode(v).decode("utf-8", "replace") for k, v in (data or {}).items()}


def projected_token_seconds(pod: dict) -> list[int]:
    """expirationSeconds of every projected serviceAccountToken source: the agent renews each at 80%."""
    return [int(src["serviceAccountToken"].get("expirationSeconds") or 3600)
            for v in pod["spec"].get("volumes") or []
            for src in (v.get("projected") or {}).get("sources") or [] if "serviceAccountToken" in src]
