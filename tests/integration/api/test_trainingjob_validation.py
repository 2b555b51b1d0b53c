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


WEB_IDENTITY = {"roleArn": "arn:aws:iam::111122223333:role/ml-checkpoints", "serviceAccountName": "trainer"}
ZERO3 = {"type": "zero3", "deepspeed": {"config": {"zero_optimization": {"stage": 3}}}}
VOLUME = {"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}]}

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
    ("checkpoint-without-identity", spec(checkpoint={"credentialsSecret": DELETE}),
     ["spec.checkpoint", "must set exactly one identity: credentialsSecret"]),
    ("checkpoint-secret-and-web-identity", spec(checkpoint={"webIdentity": WEB_IDENTITY}),
     ["spec.checkpoint", "must set exactly one identity"]),
    ("checkpoint-web-identity-and-ambient",
     spec(checkpoint={"credentialsSecret": DELETE, "webIdentity": WEB_IDENTITY, "ambient": {}}),
     ["spec.checkpoint", "must set exactly one identity"]),
    ("web-identity-without-role",
     spec(checkpoint={"credentialsSecret": DELETE, "webIdentity": {"serviceAccountName": "trainer"}}),
     ["spec.checkpoint.webIdentity.roleArn", "Required value"]),
    ("web-identity-role-not-an-arn",
     spec(checkpoint={"credentialsSecret": DELETE, "webIdentity": {**WEB_IDENTITY, "roleArn": "ml-checkpoints"}}),
     ["spec.checkpoint.webIdentity.roleArn"]),
    ("web-identity-without-service-account",
     spec(checkpoint={"credentialsSecret": DELETE, "webIdentity": {"roleArn": WEB_IDENTITY["roleArn"]}}),
     ["spec.checkpoint.webIdentity.serviceAccountName", "Required value"]),
    ("web-identity-token-too-short",
     spec(checkpoint={"credentialsSecret": DELETE, "webIdentity": {**WEB_IDENTITY, "tokenExpirationSeconds": 300}}),
     ["spec.checkpoint.webIdentity.tokenExpirationSeconds", "greater than or equal to 600"]),
    ("web-identity-inline-token",
     spec(checkpoint={"credentialsSecret": DELETE, "webIdentity": {**WEB_IDENTITY, "token": "eyJhbGciOi"}}),
     ["spec.checkpoint.webIdentity.token", "unknown field"]),
    ("ambient-with-keys", spec(checkpoint={"credentialsSecret": DELETE, "ambient": {"accessKeyId": "AKIAEXAMPLE"}}),
     ["spec.checkpoint.ambient.accessKeyId", "unknown field"]),
    ("web-identity-and-another-pod-service-account",
     spec(checkpoint={"credentialsSecret": DELETE, "webIdentity": WEB_IDENTITY},
          podTemplate={"serviceAccountName": "other"}),
     ["spec.podTemplate.serviceAccountName", "must be unset or equal spec.checkpoint.webIdentity.serviceAccountName"]),
    ("role-arn-env-with-checkpoint", spec(env=[{"name": "AWS_ROLE_ARN", "value": "arn:aws:iam::1:role/x"}]),
     ["spec.env", "AWS_ROLE_ARN"]),
    ("s3-endpoint-env-with-checkpoint", spec(env=[{"name": "AWS_ENDPOINT_URL_S3", "value": "http://other:9000"}]),
     ["spec.env", "AWS_ENDPOINT_URL_S3"]),
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
    # What the pod API (or the kubelet) would refuse later is refused here, naming the field.
    ("fractional-gpu-limit", spec(resources={"limits": {"nvidia.com/gpu": "0.5"}}),
     ["spec.resources.limits", "nvidia.com/gpu must be a whole number"]),
    ("fractional-extended-request",
     spec(resources={"requests": {"google.com/tpu": "500m"}, "limits": {"google.com/tpu": "500m"}}),
     ["spec.resources.requests", "google.com/tpu must be a whole number"]),
    ("milli-byte-memory", spec(resources={"limits": {"memory": "64m"}}),
     ["spec.resources.limits.memory must be a size in bytes", "m is a thousandth, not mega"]),
    ("zero-milli-bytes", spec(resources={"limits": {"memory": "0m"}}),
     ["spec.resources.limits.memory must be a size in bytes"]),
    ("sub-byte-ephemeral-storage", spec(resources={"requests": {"ephemeral-storage": "0.5"}}),
     ["spec.resources.requests.ephemeral-storage must be a size in bytes"]),
    ("negative-integer-quantity", spec(resources={"limits": {"memory": -1}}),
     ["spec.resources.limits.memory", "greater than or equal to 0"]),
    ("requests-above-limits", spec(resources={"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}),
     ["spec.resources.requests", "cpu must not exceed spec.resources.limits"]),
    ("extended-request-not-limit",
     spec(resources={"requests": {"amd.com/gpu": 1}, "limits": {"amd.com/gpu": 2}}),
     ["spec.resources", "amd.com/gpu must be set in limits"]),
    ("extended-request-without-limit", spec(resources={"requests": {"example.com/fpga": 1}}),
     ["spec.resources", "example.com/fpga must be set in limits"]),
    ("hugepages-request-not-its-limit",
     spec(resources={"requests": {"hugepages-1Gi": "1Gi", "memory": "1Gi"}, "limits": {"hugepages-1Gi": "2Gi"}}),
     ["spec.resources", "hugepages-1Gi must be set in limits, and equal to requests"]),
    ("hugepages-part-of-a-page", spec(resources={"limits": {"hugepages-2Mi": "3Mi", "memory": "1Gi"}}),
     ["spec.resources.limits.hugepages-2Mi must be a whole number of 2Mi pages"]),
    ("hugepages-in-milli-bytes", spec(resources={"limits": {"hugepages-1Gi": "1024m", "memory": "1Gi"}}),
     ["spec.resources.limits.hugepages-1Gi must be a size in bytes", "m is a thousandth, not mega"]),
    ("unknown-resource-name", spec(resources={"limits": {"gpu": 1}}),
     ["spec.resources.limits", "gpu is not a container resource"]),
    ("negative-shm-size", spec(shmSize=-1), ["spec.shmSize", "non-negative"]),
    ("tmp-size-in-millis", spec(tmpSize="500m"), ["spec.tmpSize must be a size in bytes"]),
    ("negative-tmp-size", spec(tmpSize=-1), ["spec.tmpSize must be a size in bytes"]),
    ("mount-path-dotdot", spec(podTemplate=VOLUME | {"volumeMounts": [{"name": "data", "mountPath": "/data/../etc"}]}),
     ["spec.podTemplate.volumeMounts[0].mountPath", "must be a clean absolute path"]),
    ("mount-path-dot", spec(podTemplate=VOLUME | {"volumeMounts": [{"name": "data", "mountPath": "/data/./x"}]}),
     ["spec.podTemplate.volumeMounts[0].mountPath", "must be a clean absolute path"]),
    ("mount-path-trailing-slash", spec(podTemplate=VOLUME | {"volumeMounts": [{"name": "data", "mountPath": "/tmp/"}]}),
     ["spec.podTemplate.volumeMounts[0].mountPath", "must be a clean absolute path"]),
    ("mount-path-empty-segment", spec(podTemplate=VOLUME | {"volumeMounts": [{"name": "data", "mountPath": "/dev//shm"}]}),
     ["spec.podTemplate.volumeMounts[0].mountPath", "must be a clean absolute path"]),
    ("mount-path-relative", spec(podTemplate=VOLUME | {"volumeMounts": [{"name": "data", "mountPath": "data"}]}),
     ["spec.podTemplate.volumeMounts[0].mountPath"]),
    ("mount-path-termination-log",
     spec(podTemplate=VOLUME | {"volumeMounts": [{"name": "data", "mountPath": "/dev/termination-log"}]}),
     ["spec.podTemplate.volumeMounts[0].mountPath", "/dev/termination-log is reserved"]),
    ("mount-path-local-checkpoints",
     spec(podTemplate=VOLUME | {"volumeMounts": [{"name": "data", "mountPath": "/tmp/kubetrain/checkpoints"}]}),
     ["spec.podTemplate.volumeMounts[0].mountPath", "is reserved"]),
    ("mount-path-deepspeed-config",
     spec(podTemplate=VOLUME | {"volumeMounts": [{"name": "data", "mountPath": "/etc/kubetrain/deepspeed"}]}),
     ["spec.podTemplate.volumeMounts[0].mountPath", "is reserved"]),
    ("mount-path-dev", spec(podTemplate=VOLUME | {"volumeMounts": [{"name": "data", "mountPath": "/dev"}]}),
     ["spec.podTemplate.volumeMounts[0].mountPath", "is reserved"]),
    ("subpath-dotdot",
     spec(podTemplate=VOLUME | {"volumeMounts": [{"name": "data", "mountPath": "/data", "subPath": "a/../../b"}]}),
     ["spec.podTemplate.volumeMounts[0].subPath", "must be a relative path inside the volume"]),
    ("subpath-absolute",
     spec(podTemplate=VOLUME | {"volumeMounts": [{"name": "data", "mountPath": "/data", "subPath": "/etc"}]}),
     ["spec.podTemplate.volumeMounts[0].subPath", "must be a relative path inside the volume"]),
    ("subpath-dot",
     spec(podTemplate=VOLUME | {"volumeMounts": [{"name": "data", "mountPath": "/data", "subPath": "./models"}]}),
     ["spec.podTemplate.volumeMounts[0].subPath", "must be a relative path inside the volume"]),
    ("label-key-invalid", spec(podTemplate={"labels": {"team name": "ml"}}),
     ["spec.podTemplate.labels", "team name is not a valid label key"]),
    ("label-key-uppercase-prefix", spec(podTemplate={"labels": {"Example.com/team": "ml"}}),
     ["spec.podTemplate.labels", "Example.com/team is not a valid label key"]),
    ("label-value-invalid", spec(podTemplate={"labels": {"team": "-ml"}}), ["spec.podTemplate.labels.team"]),
    ("annotation-key-invalid", spec(podTemplate={"annotations": {"a/b/c": "x"}}),
     ["spec.podTemplate.annotations", "a/b/c is not a valid annotation key"]),
    ("annotations-too-large", spec(podTemplate={"annotations": {"note": "x" * 200_000, "more": "y" * 62_200}}),
     ["spec.podTemplate.annotations", "at most 256 KiB"]),
    ("node-selector-key-empty-name", spec(podTemplate={"nodeSelector": {"example.com/": "x"}}),
     ["spec.podTemplate.nodeSelector", "example.com/ is not a valid label key"]),
    ("node-selector-value-invalid", spec(podTemplate={"nodeSelector": {"disk": "fast ssd"}}),
     ["spec.podTemplate.nodeSelector.disk"]),
    ("toleration-empty-key-equal", spec(podTemplate={"tolerations": [{"operator": "Equal", "value": "x"}]}),
     ["spec.podTemplate.tolerations[0].operator", "must be Exists when key is empty"]),
    ("toleration-seconds-without-noexecute",
     spec(podTemplate={"tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule",
                                        "tolerationSeconds": 30}]}),
     ["spec.podTemplate.tolerations[0].effect", "must be NoExecute when tolerationSeconds is set"]),
    ("toleration-seconds-without-effect",
     spec(podTemplate={"tolerations": [{"key": "k", "operator": "Exists", "tolerationSeconds": 30}]}),
     ["spec.podTemplate.tolerations[0].effect", "must be NoExecute when tolerationSeconds is set"]),
    ("toleration-unknown-effect", spec(podTemplate={"tolerations": [{"key": "k", "effect": "NoRun"}]}),
     ["spec.podTemplate.tolerations[0].effect", "Unsupported value"]),
    ("toleration-key-invalid", spec(podTemplate={"tolerations": [{"key": "dedicated to", "operator": "Exists"}]}),
     ["spec.podTemplate.tolerations[0].key", "is not a valid label key"]),
    ("toleration-value-invalid", spec(podTemplate={"tolerations": [{"key": "k", "value": "a b"}]}),
     ["spec.podTemplate.tolerations[0].value"]),
    ("aws-key-literal-without-checkpoint",
     merged(BASE, {"spec": {"checkpoint": DELETE, "env": [{"name": "AWS_ACCESS_KEY_ID", "value": "AKIAEXAMPLE"}]}}),
     ["spec.env[0].value", "AWS_ACCESS_KEY_ID is a credential"]),
    ("aws-session-token-literal", spec(env=[{"name": "AWS_SESSION_TOKEN", "value": "FwoGZX"}]),
     ["spec.env[0].value", "AWS_SESSION_TOKEN is a credential"]),
    ("aws-security-token-literal",
     merged(BASE, {"spec": {"checkpoint": DELETE, "env": [{"name": "A", "value": "1"},
                                                          {"name": "AWS_SECURITY_TOKEN", "value": "x"}]}}),
     ["spec.env[1].value", "AWS_SECURITY_TOKEN is a credential"]),
    ("aws-profile-literal", spec(env=[{"name": "AWS_PROFILE", "value": "prod"}]),
     ["spec.env[0].value", "AWS_PROFILE is a credential"]),
    ("secret-key-ref-key-escapes",
     spec(env=[{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "../token"}}}]),
     ["spec.env[0].valueFrom.secretKeyRef.key"]),
    ("config-map-key-ref-empty-name",
     spec(env=[{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "", "key": "k"}}}]),
     ["spec.env[0].valueFrom.configMapKeyRef.name"]),
    ("field-ref-unsupported-path",
     spec(env=[{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.containers"}}}]),
     ["spec.env[0].valueFrom.fieldRef.fieldPath"]),
    ("resource-field-ref-unsupported",
     spec(env=[{"name": "X", "valueFrom": {"resourceFieldRef": {"resource": "limits.nvidia.com/gpu"}}}]),
     ["spec.env[0].valueFrom.resourceFieldRef.resource"]),
    ("envfrom-empty-name", spec(envFrom=[{"configMapRef": {"name": ""}}]), ["spec.envFrom[0].configMapRef.name"]),
    ("envfrom-prefix-with-equals", spec(envFrom=[{"prefix": "A=", "secretRef": {"name": "s"}}]),
     ["spec.envFrom[0].prefix"]),
    ("deepspeed-configmap-name-invalid",
     spec(strategy={"type": "zero3", "deepspeed": {"configMapRef": {"name": "DS_Config"}}}),
     ["spec.strategy.deepspeed.configMapRef.name"]),
    ("credentials-key-invalid", spec(checkpoint={"credentialsSecret": {"name": "s3", "accessKeyIdKey": "../id"}}),
     ["spec.checkpoint.credentialsSecret.accessKeyIdKey"]),
    ("volume-with-two-sources",
     spec(podTemplate={"volumes": [{"name": "data", "emptyDir": {}, "persistentVolumeClaim": {"claimName": "d"}}]}),
     ["spec.podTemplate.volumes[0]", "takes one source"]),
    ("volume-negative-size-limit", spec(podTemplate={"volumes": [{"name": "data", "emptyDir": {"sizeLimit": -1}}]}),
     ["spec.podTemplate.volumes[0].emptyDir.sizeLimit", "greater than or equal to 0"]),
    ("volume-item-path-escapes",
     spec(podTemplate={"volumes": [{"name": "c", "configMap": {"name": "c", "items": [{"key": "k", "path": "../x"}]}}]}),
     ["spec.podTemplate.volumes[0].configMap.items[0].path", "must be a relative path inside the volume"]),
    ("volume-item-path-absolute",
     spec(podTemplate={"volumes": [{"name": "s", "secret": {"secretName": "s",
                                                             "items": [{"key": "k", "path": "/etc/x"}]}}]}),
     ["spec.podTemplate.volumes[0].secret.items[0].path", "must be a relative path inside the volume"]),
    ("volume-mode-too-large", spec(podTemplate={"volumes": [{"name": "s", "secret": {"secretName": "s",
                                                                                     "defaultMode": 1000}}]}),
     ["spec.podTemplate.volumes[0].secret.defaultMode"]),
    ("volume-empty-claim-name", spec(podTemplate={"volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": ""}}]}),
     ["spec.podTemplate.volumes[0].persistentVolumeClaim.claimName"]),
    ("checkpoint-uri-bucket-uppercase", spec(checkpoint={"uri": "s3://Kubetrain_Test/jobs"}),
     ["spec.checkpoint.uri", "an S3 bucket name: 3 to 63 lowercase letters"]),
    ("checkpoint-uri-dotdot", spec(checkpoint={"uri": "s3://kubetrain-test/jobs/../other"}),
     ["spec.checkpoint.uri", "no '.', '..' or empty ('//') segments"]),
    ("checkpoint-uri-dot", spec(checkpoint={"uri": "s3://kubetrain-test/./jobs"}),
     ["spec.checkpoint.uri", "no '.', '..' or empty ('//') segments"]),
    ("checkpoint-uri-trailing-dotdot", spec(checkpoint={"uri": "s3://kubetrain-test/jobs/.."}),
     ["spec.checkpoint.uri", "no '.', '..' or empty ('//') segments"]),
    ("checkpoint-uri-empty-segment", spec(checkpoint={"uri": "s3://kubetrain-test/jobs//a"}),
     ["spec.checkpoint.uri", "no '.', '..' or empty ('//') segments"]),
    ("security-context-root-user", spec(podTemplate={"securityContext": {"runAsUser": 0}}),
     ["spec.podTemplate.securityContext.runAsUser", "greater than or equal to 1"]),
    ("security-context-negative-supplemental-group",
     spec(podTemplate={"securityContext": {"supplementalGroups": [-1]}}),
     ["spec.podTemplate.securityContext.supplementalGroups[0]", "greater than or equal to 0"]),
    ("security-context-run-as-root-allowed", spec(podTemplate={"securityContext": {"runAsNonRoot": False}}),
     ["spec.podTemplate.securityContext.runAsNonRoot", "unknown field"]),
    ("security-context-unknown-change-policy",
     spec(podTemplate={"securityContext": {"fsGroup": 1000, "fsGroupChangePolicy": "Never"}}),
     ["spec.podTemplate.securityContext.fsGroupChangePolicy", "Unsupported value"]),
]

# Counterparts of the rules above that a careless rule would refuse too.
ACCEPTED = [
    ("aws-key-from-secret-with-checkpoint",
     spec(env=[{"name": "AWS_SESSION_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s3", "key": "token"}}},
               {"name": "AWS_PROFILE", "valueFrom": {"configMapKeyRef": {"name": "aws", "key": "profile"}}}])),
    ("aws-variables-that-are-not-credentials",
     merged(BASE, {"spec": {"checkpoint": DELETE, "env": [
         {"name": "AWS_REGION", "value": "eu-west-1"}, {"name": "AWS_PROFILE", "value": ""},
         {"name": "AWS_ACCESS_KEY_ID_FILE_HINT", "value": "/var/run/keys"}]}})),
    ("whole-extended-resources",
     spec(resources={"requests": {"nvidia.com/gpu": 2, "cpu": "500m", "memory": "1.5Gi", "hugepages-2Mi": "64Mi"},
                     "limits": {"nvidia.com/gpu": "2", "cpu": 1, "memory": "2Gi", "hugepages-2Mi": "64Mi",
                                "example.com/fpga": "1000m"}})),
    ("byte-sizes-as-plain-integers-and-zero",
     spec(resources={"requests": {"memory": 1073741824, "ephemeral-storage": "0"},
                     "limits": {"memory": "2e9", "ephemeral-storage": "20G"}})),
    ("replacing-tmp-and-shm-and-mounting-below-them",
     spec(podTemplate={"volumes": [{"name": "scratch", "emptyDir": {}}, {"name": "shm", "emptyDir": {"medium": "Memory"}},
                                   {"name": "data", "persistentVolumeClaim": {"claimName": "d"}}],
                       "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"},
                                        {"name": "shm", "mountPath": "/dev/shm"},
                                        {"name": "data", "mountPath": "/tmp/data", "subPath": "models/gpt2"},
                                        {"name": "data", "mountPath": "/data/.cache", "subPath": "cache/..data"},
                                        {"name": "data", "mountPath": "/tmp/kubetrainer"}]})),
    ("qualified-label-and-annotation-keys",
     spec(podTemplate={"labels": {"example.com/team": "ml", "app": ""},
                       "annotations": {"Example.com/Note": "free text: anything goes"},
                       "nodeSelector": {"kubernetes.io/arch": "amd64", "node.kubernetes.io/instance-type": ""},
                       "schedulerName": "volcano"})),
    ("tolerations-of-the-pod-api",
     spec(podTemplate={"tolerations": [
         {"operator": "Exists"},
         {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute", "tolerationSeconds": 60},
         {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
          "tolerationSeconds": 300},
         {"key": "nvidia.com/gpu", "effect": "NoSchedule"}]})),
    ("env-references-of-the-pod-api",
     spec(env=[{"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
               {"name": "IP", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}},
               {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
               {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf.token", "key": ".hf_token"}}}],
          envFrom=[{"prefix": "DATA_", "configMapRef": {"name": "data-config"}}])),
    ("volume-sources-of-the-pod-api",
     spec(podTemplate={"volumes": [
         {"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
         {"name": "conf", "configMap": {"name": "app.conf", "items": [{"key": "a", "path": "conf/..app.yaml", "mode": 420}],
                                        "optional": True}},
         {"name": "keys", "secret": {"secretName": "keys", "defaultMode": 256}},
         {"name": "info", "downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}}]})),
    ("checkpoint-uri-with-dotted-names-and-trailing-slash",
     spec(checkpoint={"uri": "s3://my.bucket/jobs/v1.2/..hidden/"})),
    ("checkpoint-web-identity", spec(checkpoint={"credentialsSecret": DELETE, "webIdentity": {
        **WEB_IDENTITY, "audience": "sts.amazonaws.com", "tokenExpirationSeconds": 600}})),
    ("checkpoint-web-identity-minio-role-and-same-pod-account",
     spec(checkpoint={"credentialsSecret": DELETE, "webIdentity": {**WEB_IDENTITY, "roleArn": "arn:minio:iam:::role/Ab-c_1"}},
          podTemplate={"serviceAccountName": "trainer", "automountServiceAccountToken": False})),
    ("checkpoint-ambient", spec(checkpoint={"credentialsSecret": DELETE, "ambient": {}},
                                podTemplate={"serviceAccountName": "pod-identity"})),
    ("security-context-ids", spec(podTemplate={"securityContext": {
        "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000, "supplementalGroups": [3000, 2147483647],
        "fsGroupChangePolicy": "OnRootMismatch"}})),
    ("security-context-group-zero", spec(podTemplate={"securityContext": {
        "runAsUser": 1000680000, "runAsGroup": 0, "fsGroup": 0, "supplementalGroups": [0]}})),
]


def test_the_base_object_of_the_malformed_cases_is_valid(submit):
    """Otherwise a rejection below could come from the base, not from the case's mistake."""
    assert submit(BASE)["metadata"]["name"] == "job"


def test_there_are_at_least_twenty_malformed_cases():
    assert len(MALFORMED) >= 20 and len({m[0] for m in MALFORMED}) == len(MALFORMED)
    assert len({m[0] for m in ACCEPTED}) == len(ACCEPTED)


@pytest.mark.parametrize("obj, expected", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_trainingjob_is_rejected_naming_the_field(submit, obj, expected):
    with pytest.raises(submit.Rejected) as info:
        submit(obj)
    assert info.value.status in (400, 422), info.value.text
    for text in expected:
        assert text in info.value.text, f"{text!r} not in:\n{info.value.text}"


@pytest.mark.parametrize("obj", [a[1] for a in ACCEPTED], ids=[a[0] for a in ACCEPTED])
def test_what_the_pod_api_allows_is_accepted(submit, obj):
    """The rules that refuse MALFORMED cases refuse nothing a pod may have."""
    stored = submit(obj)
    assert stored["spec"]["image"] == obj["spec"]["image"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_accepted(submit, path):
    obj = yaml.safe_load(path.read_text())
    stored = submit(obj)
    assert stored["spec"]["image"] == obj["spec"]["image"]


def test_defaults_are_applied(submit):
    minimal = merged(BASE, {"spec": {"checkpoint": DELETE}})
    s = submit(minimal)["spec"]
    assert s["nodes"] == 1 and s["procsPerNode"] == 1 and s["masterPort"] == 29500
    assert s["shmSize"] == "1Gi" and s["tmpSize"] == "0"
    assert s["strategy"] == {"type": "ddp"}
    assert s["runPolicy"] == {"backoffLimit": 3, "backoffSeconds": 10, "suspend": False, "nodeLostGraceSeconds": 60,
                              "maxPreemptions": 30, "startupGraceSeconds": 300, "terminationGracePeriodSeconds": 120}
    assert "checkpoint" not in s


def test_nested_defaults_are_applied(submit):
    s = submit(spec(strategy={"type": "fsdp", "fsdp": {}}))["spec"]
    assert s["strategy"]["fsdp"] == {"reshardAfterForward": True, "cpuOffload": False, "mixedPrecision": "none"}
    assert s["checkpoint"]["region"] == "us-east-1"
    assert s["checkpoint"]["credentialsSecret"] == {
        "name": "s3", "accessKeyIdKey": "accessKeyId", "secretAccessKeyKey": "secretAccessKey"}
    s = submit(spec(strategy={"type": "zero3", "deepspeed": {"configMapRef": {"name": "ds"}}}))["spec"]
    assert s["strategy"]["deepspeed"]["configMapRef"] == {"name": "ds", "key": "ds_config.json"}


def test_web_identity_defaults_and_an_explicit_empty_ambient_are_kept(submit):
    s = submit(spec(checkpoint={"credentialsSecret": DELETE, "webIdentity": WEB_IDENTITY}))["spec"]["checkpoint"]
    assert s["webIdentity"] == {**WEB_IDENTITY, "audience": "sts.amazonaws.com", "tokenExpirationSeconds": 3600}
    assert "credentialsSecret" not in s
    s = submit(spec(checkpoint={"credentialsSecret": DELETE, "ambient": {}}))["spec"]["checkpoint"]
    assert s["ambient"] == {} and "credentialsSecret" not in s


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


def test_the_checkpoint_location_and_the_strategy_cannot_change_once_set(kube_api, submit, api_namespace):
    """A new checkpoint.uri would resume nothing: the next attempt would start from step 0 without a word; another
    strategy could not read the checkpoints' layout."""
    from kubernetes import client

    custom = client.CustomObjectsApi(kube_api)
    name = "job-keeps-its-storage"
    submit(merged(BASE, {"metadata": {"name": name}}), dry_run=False)
    try:
        with pytest.raises(client.ApiException) as err:
            custom.patch_namespaced_custom_object("kubetrain.io", "v1alpha1", api_namespace, "trainingjobs", name,
                                                  {"spec": {"checkpoint": {"uri": "s3://kubetrain-test/elsewhere"}}})
        assert err.value.status == 422 and "spec.checkpoint.uri cannot change or be removed" in err.value.body
        with pytest.raises(client.ApiException) as err:  # removing it (to add another one later) is the same
            custom.patch_namespaced_custom_object("kubetrain.io", "v1alpha1", api_namespace, "trainingjobs", name,
                                                  {"spec": {"checkpoint": None}})
        assert err.value.status == 422 and "spec.checkpoint.uri cannot change or be removed" in err.value.body
        with pytest.raises(client.ApiException) as err:  # the checkpoints are in the strategy's layout
            custom.patch_namespaced_custom_object("kubetrain.io", "v1alpha1", api_namespace, "trainingjobs", name,
                                                  {"spec": {"strategy": {"type": "fsdp"}}})
        assert err.value.status == 422 and "spec.strategy.type cannot change once set" in err.value.body
        # Other fields stay editable (they take effect at the next attempt).
        custom.patch_namespaced_custom_object("kubetrain.io", "v1alpha1", api_namespace, "trainingjobs", name,
                                              {"spec": {"runPolicy": {"backoffLimit": 5}}})
        # A trailing / added, then removed, is the same place (the operator strips it): not a change.
        uri = custom.get_namespaced_custom_object("kubetrain.io", "v1alpha1", api_namespace, "trainingjobs",
                                                  name)["spec"]["checkpoint"]["uri"].rstrip("/")
        for edited in (uri + "/", uri):
            custom.patch_namespaced_custom_object("kubetrain.io", "v1alpha1", api_namespace, "trainingjobs", name,
                                                  {"spec": {"checkpoint": {"uri": edited}}})
    finally:
        custom.delete_namespaced_custom_object("kubetrain.io", "v1alpha1", api_namespace, "trainingjobs", name)
