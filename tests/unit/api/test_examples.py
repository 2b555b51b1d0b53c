"""The examples users copy must match the CRD: no misspelt or undeclared field
(which the API server would reject or silently drop), required fields present,
enums, ranges and patterns respected. Checked offline here; tests/integration/api
applies them to a real API server. The TrainingJobs in the docs' YAML blocks are
held to the same check (docs/api-sketch.md once showed null integers and empty
names the API server rejects), and every such block must parse."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("*/README.md")])


def problems(value, node: dict, path: str) -> list[str]:
    """A small structural check: declared fields, required, enum, scalar types, ranges, string patterns."""
    out = []
    if node.get("x-kubernetes-int-or-string"):
        return [] if isinstance(value, (int, str)) else [f"{path}: not int or string"]
    kind = node.get("type")
    py = {"string": str, "integer": int, "boolean": bool, "object": dict, "array": list}.get(kind)
    if py and (not isinstance(value, py) or (py is int and isinstance(value, bool))):
        return [f"{path}: expected {kind}, got {type(value).__name__}"]
    if "enum" in node and value not in node["enum"]:
        out.append(f"{path}: {value!r} not in {node['enum']}")
    if kind == "integer" and not node.get("minimum", value) <= value <= node.get("maximum", value):
        out.append(f"{path}: {value} outside {node.get('minimum')}..{node.get('maximum')}")
    if kind == "string" and "pattern" in node and not re.search(node["pattern"], value):
        out.append(f"{path}: {value!r} does not match {node['pattern']}")
    if kind == "array":
        for i, item in enumerate(value):
            out += problems(item, node["items"], f"{path}[{i}]")
    if kind == "object":
        for req in node.get("required", []):
            if req not in value:
                out.append(f"{path}.{req}: required")
        props = node.get("properties", {})
        for key, sub in value.items():
            if key in props:
                out += problems(sub, props[key], f"{path}.{key}")
            elif isinstance(node.get("additionalProperties"), dict):
                out += problems(sub, node["additionalProperties"], f"{path}.{key}")
            elif not node.get("x-kubernetes-preserve-unknown-fields"):
                out.append(f"{path}.{key}: unknown field")
    return out


def test_there_are_the_four_examples():
    assert {p.name for p in EXAMPLES} >= {
        "trainingjob.yaml", "trainingjob-fsdp.yaml", "trainingjob-zero3.yaml", "trainingjob-command.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_matches_schema(path, schema):
    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "kubetrain.io/v1alpha1" and doc["kind"] == "TrainingJob"
    assert problems(doc["spec"], schema["properties"]["spec"], "spec") == []
    assert path.read_text().startswith("#"), "every file says why it exists"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_in_the_docs_parses_and_its_trainingjobs_match_the_schema(path, schema):
    text, found = path.read_text(), []
    for block in re.finditer(r"```ya?ml\n(.*?)```", text, re.S):
        line = text[:block.start()].count("\n") + 2
        try:
            docs = list(yaml.safe_load_all(block.group(1)))
        except yaml.YAMLError as e:
            found.append(f"line {line}: does not parse: {str(e).splitlines()[0]}")
            continue
        for doc in docs:
            if isinstance(doc, dict) and doc.get("kind") == "TrainingJob":
                found += [f"line {line}: {p}" for p in problems(doc["spec"], schema["properties"]["spec"], "spec")]
    assert found == []


def test_the_checker_catches_mistakes(schema):
    """Guards the guard: a misspelt field, a wrong type, a bad enum, a range and a pattern are all reported."""
    bad = {"image": "x", "nodes": "two", "trainer": {"builtin": {"task": "vision"}},
           "checkpoint": {"uri": "s3://b/p", "credentialsSecret": {"name": "s"}, "secretAccessKey": "k"},
           "runPolicy": {"maxPreemptions": None, "backoffLimit": -1}, "podTemplate": {"priorityClassName": ""}}
    found = problems(bad, schema["properties"]["spec"], "spec")
    assert any(f.startswith("spec.nodes:") for f in found)
    assert any(f.startswith("spec.trainer.builtin.task:") for f in found)
    assert "spec.checkpoint.secretAccessKey: unknown field" in found
    assert any(f.startswith("spec.runPolicy.maxPreemptions: expected integer") for f in found)
    assert any(f.startswith("spec.runPolicy.backoffLimit: -1 outside") for f in found)
    assert any(f.startswith("spec.podTemplate.priorityClassName: '' does not match") for f in found)


@pytest.mark.parametrize("context, found", [
    ({"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000, "supplementalGroups": [2000],
      "fsGroupChangePolicy": "OnRootMismatch"}, []),
    ({"runAsUser": 0}, ["spec.podTemplate.securityContext.runAsUser: 0 outside 1..2147483647"]),
    ({"fsGroup": 0, "runAsGroup": 0, "supplementalGroups": [0]}, []),
    ({"supplementalGroups": [-1]}, ["spec.podTemplate.securityContext.supplementalGroups[0]: -1 outside 0..2147483647"]),
    ({"runAsGroup": 2**31}, ["spec.podTemplate.securityContext.runAsGroup: 2147483648 outside 0..2147483647"]),
    ({"fsGroupChangePolicy": "Never"},
     ["spec.podTemplate.securityContext.fsGroupChangePolicy: 'Never' not in ['OnRootMismatch', 'Always']"]),
    ({"runAsNonRoot": False}, ["spec.podTemplate.securityContext.runAsNonRoot: unknown field"]),
    ({"seccompProfile": {"type": "Unconfined"}}, ["spec.podTemplate.securityContext.seccompProfile: unknown field"]),
    ({"privileged": True}, ["spec.podTemplate.securityContext.privileged: unknown field"]),
])
def test_the_pod_security_context_takes_ids_of_1_or_more_and_nothing_that_loosens_the_pods(schema, context, found):
    spec = {"image": "x", "trainer": {"command": ["python"]}, "podTemplate": {"securityContext": context}}
    assert problems(spec, schema["properties"]["spec"], "spec") == found


def test_demo_job_is_what_the_brief_promises():
    doc = yaml.safe_load((ROOT / "examples" / "trainingjob.yaml").read_text())["spec"]
    assert doc["trainer"]["builtin"]["task"] == "causal-lm"
    assert doc["nodes"] == 2 and doc["procsPerNode"] == 1
    assert doc["strategy"]["type"] == "ddp"
    assert doc["checkpoint"]["uri"] == "s3://kubetrain-demo/jobs"
    assert doc["checkpoint"]["credentialsSecret"]["name"] == "kubetrain-s3"
    assert "endpoint" in doc["checkpoint"]
