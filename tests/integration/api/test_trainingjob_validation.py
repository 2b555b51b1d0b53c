"""The real kube-apiserver enforces crds/trainingjob.yaml: the examples are
accepted with their defaults filled in, and malformed TrainingJobs are refused
at submission with a message that names the offending field, so a user learns
what to fix from `kubectl apply` instead of from a crashed pod."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

BASE = {
    "apiVersion": "kubetrain.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "job"},
    "spec": {
        "image": "kubetrain/trainer:0.1.0",
        "trainer": {"builtin": {"task": "causal-lm", "args": {"max_steps": 10}}},
        "checkpoint": {"uri": "s3://kubetrain-test/jobs", "credentialsSecret": {"name": "s3"}},
    },
}

DELETE = object()


def merged(base: dict, patch: dict) -> dict:
    """A JSON merge patch applied to a copy; DELETE removes a key."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is DELETE:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def spec(**patch) -> dict:
    return merged(BASE, {"spec": patch})


ZERO3 = {"type": "zero3", "deepspeed": {"config": {"zero_optimization": {"stage": 3}}}}

# (id, object, text the error must contain: the field path, plus the rule's words where we wrote them)
MALFORMED = [
    ("image-missing", spec(image=DELETE), ["spec.image", "Required value"]),
    ("image-empty", spec(image=""), ["spec.image"]),
    ("image-with-space", spec(image="my image"), ["spec.image"]),
    ("nodes-wrong-type", spec(nodes="two"), ["spec.nodes"]),
    ("nodes-zero", spec(nodes=0), ["spec.nodes", "greater than or equal to 1"]),
    ("nodes-negative", spec(nodes=-2), ["spec.nodes"]),
    ("nodes-too-many", spec(nodes=5000), ["spec.nodes", "less than or equal to 1024"]),
    ("procs-zero", spec(procsPerNode=0), ["spec.procsPerNode"]),
    ("port-privileged", spec(masterPort=80), ["spec.masterPort"]),
    ("port-out-of-range", spec(masterPort=70000), ["spec.masterPort"]),
    ("bad-pull-policy", spec(imagePullPolicy="Sometimes"), ["spec.imagePullPolicy", "Unsupported value"]),
    ("unknown-strategy", spec(strategy={"type": "horovod"}), ["spec.strategy.type", "Unsupported value"]),
    ("builtin-and-command", spec(trainer={"command": ["python", "train.py"]}),
     ["spec.trainer", "exactly one of spec.trainer.builtin or spec.trainer.command"]),
    ("no-trainer-choice", spec(trainer={"builtin": DELETE, "workingDir": "/w"}),
     ["spec.trainer", "exactly one of spec.trainer.builtin or spec.trainer.command"]),
    ("trainer-missing", spec(trainer=DELETE), ["spec.trainer", "Required value"]),
    ("unknown-task", spec(trainer={"builtin": {"task": "vision"}}), ["spec.trainer.builtin.task"]),
    ("empty-command", spec(trainer={"builtin": DELETE, "command": []}), ["spec.trainer.command"]),
    ("command-as-string", spec(trainer={"builtin": DELETE, "command": "python train.py"}),
     ["spec.trainer.command"]),
    ("relative-working-dir", spec(trainer={"workingDir": "work"}), ["spec.trainer.workingDir"]),
    ("fsdp-options-with-zero3", spec(strategy={**ZERO3, "fsdp": {"cpuOffload": True}}),
     ["spec.strategy.fsdp", "only allowed when spec.strategy.type is fsdp"]),
    ("fsdp-options-with-ddp", spec(strategy={"fsdp": {"cpuOffload": True}}),
     ["spec.strategy.fsdp", "only allowed when spec.strategy.type is fsdp"]),
    ("zero3-without-deepspeed", spec(strategy={"type": "zero3"}),
     ["spec.strategy.deepspeed", "required when spec.strategy.type is zero3"]),
    ("deepspeed-with-ddp", spec(strategy={"type": "ddp", "deepspeed": {"config": {}}}),
     ["spec.strategy.deepspeed", "only allowed when spec.strategy.type is zero3"]),
    ("deepspeed-config-and-ref", spec(strategy={**ZERO3, "deepspeed": {"config": {}, "configMapRef": {"name": "ds"}}}),
     ["spec.strategy.deepspeed", "exactly one of config or configMapRef"]),
    ("deepspeed-neither", spec(strategy={"type": "zero3", "deepspeed": {}}),
     ["spec.strategy.deepspeed", "exactly one of config or configMapRef"]),
    ("fsdp-bad-precision", spec(strategy={"type": "fsdp", "fsdp": {"mixedPrecision": "fp8"}}),
     ["spec.strategy.fsdp.mixedPrecision"]),
    ("inline-access-key", spec(checkpoint={"accessKeyId": "AKIAEXAMPLE"}),
     ["spec.checkpoint.accessKeyId", "unknown field"]),
    ("inline-secret-key", spec(checkpoint={"secretAccessKey": "hunter2"}),
     ["spec.checkpoint.secretAccessKey", "unknown field"]),
    ("credentials-in-uri", spec(checkpoint={"uri": "s3://AKIAEXAMPLE:hunter2@bucket/p"}),
     ["spec.checkpoint.uri"]),
    ("user-in-uri", spec(checkpoint={"uri": "s3://bucket-name/p@x"}),
     ["spec.checkpoint.uri", "must not contain credentials"]),
    ("uri-not-s3", spec(checkpoint={"uri": "gs://bucket/p"}), ["spec.checkpoint.uri"]),
    ("checkpoint-without-secret", spec(checkpoint={"credentialsSecret": DELETE}),
     ["spec.checkpoint.credentialsSecret", "Required value"]),
    ("credentials-in-endpoint", spec(checkpoint={"endpoint": "http://key:secret@minio:9000"}),
     ["spec.checkpoint.endpoint", "must not contain credentials"]),
    ("reserved-env-rank", spec(env=[{"name": "NODE_RANK", "value": "3"}]),
     ["spec.env[0].name", "NODE_RANK is set by kubetrain"]),
    ("reserved-env-attempt", spec(env=[{"name": "A", "value": "1"}, {"name": "KUBETRAIN_ATTEMPT", "value": "9"}]),
     ["spec.env[1].name", "KUBETRAIN_ATTEMPT is set by kubetrain"]),
    ("aws-env-with-checkpoint", spec(env=[{"name": "AWS_SECRET_ACCESS_KEY", "value": "hunter2"}]),
     ["spec.env", "spec.checkpoint"]),
    ("env-value-and-valuefrom",
     spec(env=[{"name": "X", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]),
     ["spec.env[0]", "mutually exclusive"]),
    ("env-duplicate", spec(env=[{"name": "X", "value": "1"}, {"name": "X", "value": "2"}]),
     ["spec.env[1]", "Duplicate value"]),
    ("envfrom-both", spec(envFrom=[{"configMapRef": {"name": "a"}, "secretRef": {"name": "b"}}]),
     ["spec.envFrom[0]", "exactly one of configMapRef or secretRef"]),
    ("negative-backoff-limit", spec(runPolicy={"backoffLimit": -1}), ["spec.runPolicy.backoffLimit"]),
    ("zero-deadline", spec(runPolicy={"activeDeadlineSeconds": 0}), ["spec.runPolicy.activeDeadlineSeconds"]),
    ("negative-max-preemptions", spec(runPolicy={"maxPreemptions": -1}), ["spec.runPolicy.maxPreemptions"]),
    ("suspend-wrong-type", spec(runPolicy={"suspend": "yes"}), ["spec.runPolicy.suspend"]),
    ("bad-quantity", spec(resources={"requests": {"cpu": "lots"}}), ["spec.resources.requests.cpu"]),
    ("negative-quantity", spec(resources={"limits": {"memory": "-1Gi"}}), ["spec.resources.limits.memory"]),
    ("gpu-requests-without-limits", spec(resources={"requests": {"nvidia.com/gpu": 1}}),
     ["spec.resources", "nvidia.com/gpu must be set in limits"]),
    ("gpu-requests-not-limits",
     spec(resources={"requests": {"nvidia.com/gpu": 2}, "limits": {"nvidia.com/gpu": "1"}}),
     ["spec.resources", "nvidia.com/gpu must be set in limits"]),
    ("reserved-label", spec(podTemplate={"labels": {"kubetrain.io/job-name": "other"}}),
     ["spec.podTemplate.labels", "reserved kubetrain.io/ prefix: kubetrain.io/job-name"]),
    ("reserved-annotation", spec(podTemplate={"annotations": {"a": "b", "kubetrain.io/last-checkpoint": "{}"}}),
     ["spec.podTemplate.annotations", "kubetrain.io/last-checkpoint"]),
    ("mount-of-undeclared-volume", spec(podTemplate={"volumeMounts": [{"name": "data", "mountPath": "/data"}]}),
     ["spec.podTemplate.volumeMounts", "must name one of spec.podTemplate.volumes"]),
    ("reserved-volume-name", spec(podTemplate={"volumes": [{"name": "kubetrain-x", "emptyDir": {}}]}),
     ["spec.podTemplate.volumes[0].name", "reserved prefix"]),
    ("toleration-exists-with-value",
     spec(podTemplate={"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}),
     ["spec.podTemplate.tolerations[0]", "must be empty when operator is Exists"]),
    ("unknown-spec-field", spec(replicas=2), ["spec.replicas", "unknown field"]),
    ("name-too-long", merged(BASE, {"metadata": {"name": "x" * 51}}), ["metadata.name"]),
    ("name-with-dot", merged(BASE, {"metadata": {"name": "my.job"}}), ["metadata.name"]),
]


def test_the_base_object_of_the_malformed_cases_is_valid(submit):
    """Otherwise a rejection below could come from the base, not from the case's mistake."""
    assert submit(BASE)["metadata"]["name"] == "job"


def test_there_are_at_least_twenty_malformed_cases():
    assert len(MALFORMED) >= 20 and len({m[0] for m in MALFORMED}) == len(MALFORMED)


@pytest.mark.parametrize("obj, expected", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_trainingjob_is_rejected_naming_the_field(submit, obj, expected):
    with pytest.raises(submit.Rejected) as info:
        submit(obj)
    assert info.value.status in (400, 422), info.value.text
    for text in expected:
        assert text in info.value.text, f"{text!r} not in:\n{info.value.text}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_accepted(submit, path):
    obj = yaml.safe_load(path.read_text())
    stored = submit(obj)
    assert stored["spec"]["image"] == obj["spec"]["image"]


def test_defaults_are_applied(submit):
    minimal = merged(BASE, {"spec": {"checkpoint": DELETE}})
    s = submit(minimal)["spec"]
    assert s["nodes"] == 1 and s["procsPerNode"] == 1 and s["masterPort"] == 29500
    assert s["strategy"] == {"type": "ddp"}
    assert s["runPolicy"] == {"backoffLimit": 3, "backoffSeconds": 10, "suspend": False, "nodeLostGraceSeconds": 60}
    assert "checkpoint" not in s


def test_nested_defaults_are_applied(submit):
    s = submit(spec(strategy={"type": "fsdp", "fsdp": {}}))["spec"]
    assert s["strategy"]["fsdp"] == {"reshardAfterForward": True, "cpuOffload": False, "mixedPrecision": "none"}
    assert s["checkpoint"]["region"] == "us-east-1"
    assert s["checkpoint"]["credentialsSecret"] == {
        "name": "s3", "accessKeyIdKey": "accessKeyId", "secretAccessKeyKey": "secretAccessKey"}
    s = submit(spec(strategy={"type": "zero3", "deepspeed": {"configMapRef": {"name": "ds"}}}))["spec"]
    assert s["strategy"]["deepspeed"]["configMapRef"] == {"name": "ds", "key": "ds_config.json"}


def test_aws_variables_are_free_without_checkpoint_storage(submit):
    """Reading a data set from S3 with one's own keys stays possible when kubetrain owns no S3 wiring."""
    obj = merged(BASE, {"spec": {"checkpoint": DELETE,
                                 "env": [{"name": "AWS_ACCESS_KEY_ID", "valueFrom": {
                                     "secretKeyRef": {"name": "data", "key": "id"}}}]}})
    assert submit(obj)["spec"]["env"][0]["name"] == "AWS_ACCESS_KEY_ID"


def test_gpu_requests_equal_to_limits_are_accepted(submit):
    s = submit(spec(resources={"requests": {"nvidia.com/gpu": 2, "cpu": "500m"},
                               "limits": {"nvidia.com/gpu": "2"}}))["spec"]
    assert s["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_free_form_fields_keep_their_content(submit):
    obj = spec(trainer={"builtin": {"args": {"max_steps": 7, "lr_scheduler_type": "cosine", "nested": {"a": [1]}}}},
               strategy=ZERO3, podTemplate={"affinity": {"nodeAffinity": {"x": 1}},
                                            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}],
                                            "volumeMounts": [{"name": "data", "mountPath": "/data"}]})
    s = submit(obj)["spec"]
    assert s["trainer"]["builtin"]["args"]["nested"] == {"a": [1]}
    assert s["strategy"]["deepspeed"]["config"] == {"zero_optimization": {"stage": 3}}
    assert s["podTemplate"]["volumes"][0]["persistentVolumeClaim"] == {"claimName": "d"}
