"""Offline checks of crds/trainingjob.yaml: the properties the API server cannot
check for us (every field documented, printer columns, bounded CEL cost,
reserved names in step with docs/contract.md) and the regular expressions,
exercised on real inputs."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def walk(node: dict, path: str = "") -> Iterator[tuple[str, dict]]:
    """Every schema node below `node` with its dotted path ([] for items, {} for map values)."""
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}" if path else name)
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def test_identity(crd):
    assert crd["metadata"]["name"] == "trainingjobs.kubetrain.io"
    spec = crd["spec"]
    assert spec["group"] == "kubetrain.io"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "TrainingJob"
    assert spec["names"]["plural"] == "trainingjobs"
    assert spec["names"]["shortNames"] == ["tj"]


def test_single_served_storage_version_with_status_subresource(version):
    assert version["name"] == "v1alpha1"
    assert version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}


def test_every_field_has_a_description(schema):
    # The API server forbids anything on `metadata` itself but name/generateName rules.
    missing = [p or "(root)" for p, node in walk(schema)
               if p != "metadata" and not node.get("description", "").strip()]
    assert missing == []
    assert set(schema["properties"]["metadata"]) == {"type", "properties"}


def test_every_default_is_in_its_description(schema):
    """`kubectl explain` prints a field's type, enum and description, never its `default`: a user who
    asks `kubectl explain tj.spec.runPolicy.backoffLimit` learns the default only from the text."""
    def shown(value) -> str:
        return str(value).lower() if isinstance(value, bool) else str(value)

    missing = [f"{p}: default {shown(node['default'])}" for p, node in walk(schema)
               if "default" in node and not isinstance(node["default"], dict)
               and f"default {shown(node['default'])}".lower() not in " ".join(node["description"].split()).lower()]
    assert missing == []


def test_status_descriptions_name_what_the_operator_writes(schema):
    """`kubectl explain tj.status.conditions` and docs/operator.md list every condition type the
    operator sets, and status.progress.reason every reason it writes there (a dashboard or a
    `kubectl wait` written from them must not miss one)."""
    from kubetrain import draft, plan_kueue

    src = "\n".join(p.read_text() for p in (ROOT / "operator" / "kubetrain").glob("*.py"))
    types = (set(re.findall(r'\.cond\("(\w+)"', src)) | set(re.findall(r'with_condition\("(\w+)"', src))
             | set(draft.ATTEMPT_CONDITIONS) | {plan_kueue.QUEUED})
    status = schema["properties"]["status"]["properties"]
    section = (ROOT / "docs" / "operator.md").read_text().split("## Phases, conditions, events")[1].split("\n## ")[0]
    assert {t for t in types if t not in status["conditions"]["description"]} == set()
    assert {t for t in types if f"`{t}`" not in section} == set()
    sketch = next(line for line in (ROOT / "docs" / "api-sketch.md").read_text().splitlines() if "conditions:" in line)
    assert {t for t in types if t not in sketch} == set()
    src_poller = (ROOT / "operator" / "kubetrain" / "poller.py").read_text()
    reasons = set(re.findall(r'reason="(\w+)"', src_poller)) | set(re.findall(r'problem=\("(\w+)"', src_poller))
    reasons |= {"NoMetricsPort", draft.ENDED}
    assert {r for r in reasons if r not in status["progress"]["properties"]["reason"]["description"]} == set()


def test_schema_is_structural(schema):
    """Every node has a type, except int-or-string and free-form ones."""
    untyped = [
        p for p, node in walk(schema)
        if "type" not in node
        and not node.get("x-kubernetes-int-or-string")
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ]
    assert untyped == []


def test_printer_columns(version):
    cols = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert cols == {
        "Phase": ".status.phase",
        "Ready": ".status.nodesReady",
        "Nodes": ".status.nodesTotal",
        "Attempt": ".status.attempt",
        "Restarts": ".status.restarts",
        "Preemptions": ".status.preemptions",
        "Step": ".status.progress.steps",
        "Checkpoint": ".status.lastCheckpoint.step",
        "Kueue": '.status.conditions[?(@.type=="Queued")].reason',
        "Age": ".metadata.creationTimestamp",
        "Loss": ".status.progress.loss",
        "Samples/s": ".status.progress.samplesPerSecond",
        "Message": ".status.message",
    }
    wide = {c["name"] for c in version["additionalPrinterColumns"] if c.get("priority") == 1}
    assert wide == {"Loss", "Samples/s", "Message"}, "-o wide adds loss and throughput"


def test_agreed_field_names_exist(schema):
    """The names in docs/api-sketch.md, which the operator and trainer code against."""
    paths = {p for p, _ in walk(schema)}
    for p in [
        "spec.image", "spec.imagePullPolicy", "spec.nodes", "spec.procsPerNode", "spec.masterPort",
        "spec.resources.requests", "spec.resources.limits", "spec.trainer.builtin.task",
        "spec.trainer.builtin.args", "spec.trainer.command", "spec.trainer.workingDir", "spec.env",
        "spec.envFrom", "spec.strategy.type", "spec.strategy.fsdp.reshardAfterForward",
        "spec.strategy.fsdp.cpuOffload", "spec.strategy.fsdp.mixedPrecision",
        "spec.strategy.deepspeed.config", "spec.strategy.deepspeed.configMapRef.name",
        "spec.strategy.deepspeed.configMapRef.key", "spec.checkpoint.uri", "spec.checkpoint.endpoint",
        "spec.checkpoint.region", "spec.checkpoint.credentialsSecret.name",
        "spec.checkpoint.credentialsSecret.accessKeyIdKey",
        "spec.checkpoint.credentialsSecret.secretAccessKeyKey", "spec.runPolicy.backoffLimit",
        "spec.runPolicy.backoffSeconds", "spec.runPolicy.maxPreemptions",
        "spec.runPolicy.activeDeadlineSeconds", "spec.runPolicy.ttlSecondsAfterFinished",
        "spec.runPolicy.suspend", "spec.runPolicy.nodeLostGraceSeconds",
        *(f"spec.podTemplate.{f}" for f in [
            "labels", "annotations", "nodeSelector", "tolerations", "affinity", "priorityClassName",
            "schedulerName", "serviceAccountName", "automountServiceAccountToken", "imagePullSecrets",
            "volumes", "volumeMounts", "securityContext.runAsUser", "securityContext.runAsGroup",
            "securityContext.fsGroup", "securityContext.supplementalGroups",
            "securityContext.fsGroupChangePolicy"]),
        *(f"status.{f}" for f in [
            "phase", "message", "conditions", "attempt", "restarts", "preemptions", "failures",
            "nodesReady", "nodesTotal", "startTime", "completionTime", "nextAttemptTime",
            "lastCheckpoint.step", "lastCheckpoint.uri", "lastCheckpoint.time", "observedGeneration"]),
    ]:
        assert p in paths, p


def test_no_inline_credential_fields(schema):
    checkpoint = schema["properties"]["spec"]["properties"]["checkpoint"]
    assert not checkpoint.get("x-kubernetes-preserve-unknown-fields")
    assert set(checkpoint["properties"]) == {"uri", "endpoint", "region", "credentialsSecret", "webIdentity", "ambient"}
    # The identity modes name where credentials come from; none of them holds one.
    assert set(checkpoint["properties"]["webIdentity"]["properties"]) == {
        "roleArn", "audience", "tokenExpirationSeconds", "serviceAccountName"}
    assert not checkpoint["properties"]["ambient"].get("properties")


def test_every_rule_has_a_message_naming_a_field(schema):
    for path, node in walk(schema):
        for rule in node.get("x-kubernetes-validations", []):
            msg = rule.get("message") or rule.get("messageExpression")
            assert msg, (path, rule)
            assert "spec." in msg, (path, msg)


def test_lists_and_maps_iterated_by_rules_are_bounded(schema):
    """CEL cost is estimated from maxItems/maxProperties/maxLength: every spec
    list and map must bound them, or the API server refuses the CRD (or worse,
    a rule added later silently blows the budget)."""
    spec = schema["properties"]["spec"]
    unbounded = []
    for path, node in walk(spec, "spec"):
        if node.get("type") == "array" and "maxItems" not in node:
            unbounded.append(path)
        if node.get("type") == "object" and "additionalProperties" in node and "maxProperties" not in node:
            unbounded.append(path)
    assert unbounded == []


def _reserved_in_crd(schema) -> set[str]:
    spec = schema["properties"]["spec"]
    rules = [r["rule"] for r in spec["properties"]["env"]["items"]["properties"]["name"]["x-kubernetes-validations"]]
    rules += [r["rule"] for r in spec["x-kubernetes-validations"]]
    return set(re.findall(r"'([A-Z][A-Z0-9_]+)'", " ".join(rules)))


def test_reserved_env_names_follow_the_contract(schema):
    """Every variable in docs/contract.md's environment table is rejected in spec.env."""
    contract = (ROOT / "docs" / "contract.md").read_text()
    section = contract.split("## Environment of every training container", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[1]))
    assert len(names) >= 15, names
    assert names - _reserved_in_crd(schema) == set()


def _pattern(schema, *path: str) -> re.Pattern:
    node = schema
    for p in path:
        node = node["properties"][p]
    return re.compile(node["pattern"])


@pytest.mark.parametrize("uri, ok", [
    ("s3://kubetrain-demo/jobs", True),
    ("s3://bucket", True),
    ("s3://my.bucket-1/a/b/c", True),
    ("s3://AKIAXXXX:secret@bucket/prefix", False),
    ("s3://user@bucket/prefix", False),
    ("https://bucket/prefix", False),
    ("s3://Bucket/prefix", False),
    ("s3://b/prefix", False),
    ("s3:///prefix", False),
])
def test_checkpoint_uri_pattern(schema, uri, ok):
    pat = _pattern(schema, "spec", "checkpoint", "uri")
    assert bool(pat.match(uri)) is ok


def test_a_bad_bucket_name_is_refused_with_the_rule_in_words(schema):
    # The pattern's error shows only the regular expression ("should match '^s3://[a-z0-9]...'"): a user with an
    # uppercase letter or a '_' in the bucket name had to decode it. A rule (which the API server checks beside the
    # pattern, a pattern mismatch not being a blocking error) says it in words; it refuses what the pattern does.
    uri = schema["properties"]["spec"]["properties"]["checkpoint"]["properties"]["uri"]
    rule = next(r for r in uri["x-kubernetes-validations"] if "bucket name" in r["message"])
    assert ("an S3 bucket name: 3 to 63 lowercase letters, digits, '.' and '-', starting and ending with a letter "
            "or a digit (no uppercase letters, no '_')") in " ".join(rule["message"].split())
    cel = re.fullmatch(r"self\.matches\(r'(.*)'\)", rule["rule"])
    assert cel is not None
    for bucket in ("My-Bucket", "my_bucket", "ab", "-ab", "ab-", "b" * 64, "kubetrain-demo", "my.bucket-1", "b" * 63):
        assert bool(re.match(cel.group(1), f"s3://{bucket}/p")) is bool(re.match(uri["pattern"], f"s3://{bucket}/p"))


@pytest.mark.parametrize("endpoint, ok", [
    ("http://minio.minio:9000", True),
    ("https://s3.eu-west-1.amazonaws.com", True),
    ("http://127.0.0.1:9000/", True),
    ("http://key:secret@minio:9000", False),
    ("minio:9000", False),
    ("http://minio 9000", False),
])
def test_checkpoint_endpoint_pattern(schema, endpoint, ok):
    assert bool(_pattern(schema, "spec", "checkpoint", "endpoint").match(endpoint)) is ok


@pytest.mark.parametrize("name, ok", [
    ("gpt-small", True), ("a", True), ("x" * 50, True),
    ("x" * 51, False), ("1job", False), ("Job", False), ("job-", False), ("my.job", False),
])
def test_job_name_fits_hostnames_and_labels(schema, name, ok):
    meta = schema["properties"]["metadata"]["properties"]["name"]
    assert (bool(re.match(meta["pattern"], name)) and len(name) <= meta["maxLength"]) is ok
    # <name>-n<rank> is a pod hostname (a DNS label, <= 63) for ranks up to nodes.maximum-1.
    max_rank = schema["properties"]["spec"]["properties"]["nodes"]["maximum"] - 1
    assert meta["maxLength"] + len(f"-n{max_rank}") <= 63


def _env_ref(schema, ref: str, name: str) -> re.Pattern:
    value_from = schema["properties"]["spec"]["properties"]["env"]["items"]["properties"]["valueFrom"]
    return re.compile(value_from["properties"][ref]["properties"][name]["pattern"])


@pytest.mark.parametrize("key, ok", [
    ("accessKeyId", True), ("ds_config.json", True), (".hidden", True), ("a..b", True), ("-x_1", True),
    ("", False), (".", False), ("..", False), ("..data", False), ("../id", False), ("a/b", False), ("a b", False),
])
def test_config_and_secret_key_pattern_is_the_pod_apis(schema, key, ok):
    """IsConfigMapKey: [-._a-zA-Z0-9]+, not '.', not '..', not starting with '..'."""
    for ref in ("configMapKeyRef", "secretKeyRef"):
        assert bool(_env_ref(schema, ref, "key").match(key)) is ok


@pytest.mark.parametrize("path, ok", [
    ("metadata.name", True), ("metadata.uid", True), ("spec.nodeName", True), ("status.podIPs", True),
    ("metadata.labels['app']", True), ("metadata.annotations['example.com/x']", True),
    ("metadata.labels", False), ("spec.containers", False), ("status.podIP ", False), ("", False),
])
def test_env_field_ref_paths_are_the_pod_apis(schema, path, ok):
    assert bool(_env_ref(schema, "fieldRef", "fieldPath").match(path)) is ok


@pytest.mark.parametrize("resource, ok", [
    ("limits.cpu", True), ("requests.memory", True), ("limits.ephemeral-storage", True),
    ("requests.hugepages-2Mi", True), ("limits.nvidia.com/gpu", False), ("cpu", False), ("", False),
])
def test_env_resource_field_refs_are_the_pod_apis(schema, resource, ok):
    assert bool(_env_ref(schema, "resourceFieldRef", "resource").match(resource)) is ok


@pytest.mark.parametrize("value, ok", [
    ("", True), ("ml", True), ("a.b_c-d", True), ("x" * 63, True),
    ("-ml", False), ("ml-", False), ("a b", False), ("a/b", False),
])
def test_label_value_patterns_agree(schema, value, ok):
    pt = schema["properties"]["spec"]["properties"]["podTemplate"]["properties"]
    for node in (pt["labels"]["additionalProperties"], pt["nodeSelector"]["additionalProperties"],
                 pt["tolerations"]["items"]["properties"]["value"]):
        assert bool(re.match(node["pattern"], value)) is ok


def _quantity_rules(schema) -> list[tuple[str, dict]]:
    """The rules under spec.resources that read a quantity (not only the names of the keys)."""
    resources = schema["properties"]["spec"]["properties"]["resources"]
    return [(path, rule) for path, node in walk(resources, "spec.resources")
            for rule in node.get("x-kubernetes-validations", []) if "quantity(" in rule["rule"]]


def test_resource_quantity_rules_read_one_named_key_each_with_a_fixed_message(schema):
    """Kubernetes 1.30-1.33 estimate every resource quantity (an int-or-string) as long as a whole request, so
    each read of one costs ~0.3M of the CRD's 100M: a rule over every key is over budget, and a messageExpression
    that finds the offending one of several keys costs what its rule costs (they put the CRD at 97%). One key per
    rule, its message naming it, leaves room for the hugepages; tests/integration/api/test_crd_kubernetes_versions.py
    runs the API server's own check."""
    keys = []
    for path, rule in _quantity_rules(schema):
        named = re.findall(r"\['([^']+)'\]\.all\(k,", rule["rule"])
        assert len(named) == 1, (path, rule["rule"])
        assert "messageExpression" not in rule, (path, rule["rule"])
        assert f".{named[0]} " in rule["message"] or f" {named[0]} " in rule["message"], (path, rule["message"])
        keys.append(named[0])
    assert set(keys) == {"cpu", "memory", "ephemeral-storage", "hugepages-2Mi", "hugepages-1Gi",
                         "nvidia.com/gpu", "amd.com/gpu", "google.com/tpu"}


def test_hugepages_rules_count_pages_of_the_size_their_name_says(schema):
    from kubetrain.resources import quantity

    pages = {}
    for _, rule in _quantity_rules(schema):
        m = re.search(r"\['hugepages-([^']+)'\]\.all\(k,.* / ([0-9]+)\.0\)?$", rule["rule"], re.S)
        if m:
            pages[m[1]] = int(m[2])
            assert quantity(m[1], "") == int(m[2]), rule["rule"]
    assert set(pages) == {"2Mi", "1Gi"}
