"""values.yaml against the templates: every value a user can set is documented where they read it (a
`# --` comment above it, as helm-docs reads them), every value is used by a template, and every value a
template reads is in values.yaml and in values.schema.json. Pure text: no helm needed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "kubetrain"


def _leaves(node: dict, prefix: str = "") -> list[str]:
    """Dotted paths of the settable values: scalars, lists and empty maps (a non-empty map is a section)."""
    out = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        out += _leaves(value, path + ".") if isinstance(value, dict) and value else [path]
    return out


def _documented() -> set[str]:
    """Paths of the keys that have a `# --` comment block right above them."""
    paths, stack, comment = set(), [], False
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment = True
        elif stripped.startswith("#"):
            pass  # a comment block goes on
        elif m := re.match(r"^( *)([A-Za-z][\w-]*):", line):
            depth = len(m.group(1)) // 2
            del stack[depth:]
            stack.append(m.group(2))
            if comment:
                paths.add(".".join(stack))
            comment = False
        else:
            comment = False
    return paths


def _template_reads() -> set[str]:
    """Dotted value paths the templates read: .Values.a.b, and $x.b where $x := .Values.a (or another alias)."""
    text = "\n".join(p.read_text() for p in (CHART / "templates").iterdir())
    text = re.sub(r"\((\.Values\.[\w.]+|\$\w+\.[\w.]+) \| default dict\)", r"\1", text)  # (.Values.x | default dict).y
    aliases = {}
    for name, target in re.findall(r"\$(\w+) := (\.Values\.[\w.]+|\$\w+\.[\w.]+)", text):
        head, _, rest = target.partition(".") if target.startswith("$") else ("", "", target[len(".Values."):])
        aliases[name] = f"{aliases[head[1:]]}.{rest}" if head else rest
    reads = set(re.findall(r"\.Values\.([\w.]*\w)", text))
    for name, path in aliases.items():
        reads |= {f"{path}.{rest}" for rest in re.findall(rf"\${name}\.([\w.]*\w)", text)} | {path}
    return reads


def test_every_value_is_documented():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    documented = _documented()
    # A documented map (resources, podSecurityContext) documents what it holds.
    undocumented = [p for p in _leaves(values)
                    if not any(".".join(p.split(".")[:n]) in documented for n in range(1, p.count(".") + 2))]
    assert undocumented == []


def test_every_value_is_read_by_a_template_and_every_read_value_exists():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    leaves, reads = set(_leaves(values)), _template_reads()
    unused = {leaf for leaf in leaves if not any(leaf == r or leaf.startswith(r + ".") for r in reads)}
    assert sorted(unused) == []
    known = leaves | {p.rsplit(".", n)[0] for p in leaves for n in range(1, p.count(".") + 1)}
    missing = {r for r in reads if r not in known and not any(r.startswith(leaf + ".") for leaf in leaves)}
    assert sorted(missing) == []


def test_every_value_is_in_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def declared(path: str) -> bool:
        node = schema
        for key in path.split("."):
            if "properties" not in node:
                return node.get("type") == "object"  # a free-form map: resources, podSecurityContext
            props = node["properties"]
            if key not in props:
                return False
            node = props[key]
        return True

    assert sorted(p for p in _leaves(values) if not declared(p)) == []
