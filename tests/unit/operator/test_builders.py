"""The pod and Service the operator builds follow docs/contract.md exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kubetrain import builders
from kubetrain.api import Job
from kubetrain.spec import Spec, SpecError
from kubetrain.config import ConfigError, Settings
from kubetrain.observe import PodView

BODY = {
    "metadata": {"name": "gpt-small", "namespace": "ml", "uid": "u-1", "generation": 1,
                 "creationTimestamp": "2026-12-03T13:00:00Z"},
    "spec": {
        "image": "reg/trainer:0.1.0", "nodes": 4, "procsPerNode": 2,
        "resources": {"limits": {"nvidia.com/gpu": 2}},
        "trainer": {"builtin": {"task": "causal-lm", "args": {"max_steps": 100}}},
        "env": [{"name": "USER_VAR", "value": "1"}],
        "checkpoint": {"uri": "s3://bucket/prefix", "endpoint": "http://minio:9000",
                       "credentialsSecret": {"name": "s3-creds"}},
        "podTemplate": {"labels": {"team": "a"}, "annotations": {"x": "y"}, "priorityClassName": "low",
                        "nodeSelector": {"pool": "gpu"}},
    },
}


def env_of(pod: dict) -> dict[str, dict]:
    return {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}


def test_pod_names_labels_owner_and_dns() -> None:
    job = Job.from_storage(BODY)
    pod = builders.get_pod(job=job, attempt=3, rank=2)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "gpt-small-a3-n2"
    assert meta["labels"] == {"team": "a", "kubetrain.io/job-name": "gpt-small", "kubetrain.io/attempt": "3",
                              "kubetrain.io/node-rank": "2", "app.kubernetes.io/managed-by": "kubetrain"}
    assert meta["annotations"] == {"x": "y", "kubetrain.io/spec-generation": "1",  # the spec the pod was made from
                                   "kubetrain.io/spec-fingerprint": job.spec_fingerprint}
    assert meta["ownerReferences"] == [{"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                        "name": "gpt-small", "uid": "u-1", "controller": True,
                                        "blockOwnerDeletion": True}]
    assert spec["hostname"] == "gpt-small-n2" and spec["subdomain"] == "gpt-small"
    assert spec["restartPolicy"] == "Never" and spec["terminationGracePeriodSeconds"] == 120
    assert spec["priorityClassName"] == "low" and spec["nodeSelector"] == {"pool": "gpu"}
    container = spec["containers"][0]
    assert container["command"] == ["python", "-m", "kubetrain_trainer.launch"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 2}}
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_env_contract() -> None:
    env = env_of(builders.get_pod(job=Job.from_storage(BODY), attempt=3, rank=2))
    values = {k: v.get("value") for k, v in env.items()}
    assert values["NNODES"] == "4" and values["NODE_RANK"] == "2" and values["NPROC_PER_NODE"] == "2"
    assert values["MASTER_ADDR"] == "gpt-small-n0.gpt-small.ml.svc" and values["MASTER_PORT"] == "29500"
    assert values["KUBETRAIN_JOB_NAME"] == "gpt-small" and values["KUBETRAIN_NAMESPACE"] == "ml"
    assert values["KUBETRAIN_ATTEMPT"] == "3"
    assert values["KUBETRAIN_JOB_INCARNATION"] == "1796302800"  # 2026-12-03T13:00:00Z
    assert env["KUBETRAIN_POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert values["KUBETRAIN_CHECKPOINT_URI"] == "s3://bucket/prefix/ml/gpt-small"
    assert values["AWS_ENDPOINT_URL"] == "http://minio:9000" and values["AWS_REGION"] == "us-east-1"
    assert env["AWS_ACCESS_KEY_ID"] == {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {
        "name": "s3-creds", "key": "accessKeyId"}}}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "s3-creds", "key": "secretAccessKey"}
    assert "value" not in env["AWS_ACCESS_KEY_ID"] and "value" not in env["AWS_SECRET_ACCESS_KEY"]
    assert values["KUBETRAIN_STRATEGY"] == "ddp"
    assert json.loads(values["KUBETRAIN_TRAINER_ARGS"]) == {"max_steps": 100}
    assert values["KUBETRAIN_BUILTIN_TASK"] == "causal-lm"
    assert values["KUBETRAIN_TERMINATION_GRACE_SECONDS"] == "120" and values["KUBETRAIN_METRICS_PORT"] == "9410"
    assert "KUBETRAIN_FSDP_CONFIG" not in env and "KUBETRAIN_DEEPSPEED_CONFIG" not in env
    names = [e["name"] for e in builders.get_pod(job=Job.from_storage(BODY), attempt=1, rank=0)
             ["spec"]["containers"][0]["env"]]
    assert names[-1] == "USER_VAR", "user env comes after the contract's"


def test_no_checkpoint_means_empty_uri_and_no_credentials() -> None:
    body = json.loads(json.dumps(BODY))
    del body["spec"]["checkpoint"]
    env = env_of(builders.get_pod(job=Job.from_storage(body), attempt=1, rank=0))
    assert env["KUBETRAIN_CHECKPOINT_URI"]["value"] == ""
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"} & env.keys()


def test_command_trainer_runs_through_the_launcher() -> None:
    body = json.loads(json.dumps(BODY))
    body["spec"]["trainer"] = {"command": ["accelerate", "launch", "train.py"], "workingDir": "/w"}
    container = builders.get_pod(job=Job.from_storage(body), attempt=1, rank=0)["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "kubetrain_trainer.launch", "--", "accelerate", "launch", "train.py"]
    assert container["workingDir"] == "/w"
    assert "KUBETRAIN_TRAINER_ARGS" not in env_of({"spec": {"containers": [container]}})


@pytest.mark.parametrize("deepspeed, configmap, key", [
    ({"config": {"zero_optimization": {"stage": 3}}}, "gpt-small-deepspeed", "ds_config.json"),
    ({"configMapRef": {"name": "mine", "key": "ds.json"}}, "mine", "ds.json"),
])
def test_zero3_mounts_the_deepspeed_config(deepspeed: dict, configmap: str, key: str) -> None:
    body = json.loads(json.dumps(BODY))
    body["spec"]["strategy"] = {"type": "zero3", "deepspeed": deepspeed}
    job = Job.from_storage(body)
    pod = builders.get_pod(job=job, attempt=1, rank=0)
    assert {"name": "kubetrain-deepspeed", "configMap": {"name": configmap}} in pod["spec"]["volumes"]
    assert env_of(pod)["KUBETRAIN_DEEPSPEED_CONFIG"]["value"] == f"/etc/kubetrain/deepspeed/{key}"
    assert env_of(pod)["KUBETRAIN_STRATEGY"]["value"] == "zero3"
    if "config" in deepspeed:
        cm = builders.get_deepspeed_configmap(job=job)
        assert json.loads(cm["data"]["ds_config.json"]) == deepspeed["config"]
        assert cm["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_fsdp_options_exported_as_json() -> None:
    body = json.loads(json.dumps(BODY))
    body["spec"]["strategy"] = {"type": "fsdp", "fsdp": {"reshardAfterForward": False, "mixedPrecision": "bf16"}}
    env = env_of(builders.get_pod(job=Job.from_storage(body), attempt=1, rank=0))
    assert json.loads(env["KUBETRAIN_FSDP_CONFIG"]["value"]) == {"reshardAfterForward": False, "mixedPrecision": "bf16"}


def test_headless_service() -> None:
    svc = builders.get_service(job=Job.from_storage(BODY))
    assert svc["metadata"]["name"] == "gpt-small"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"kubetrain.io/job-name": "gpt-small"}
    assert svc["spec"]["ports"][0]["port"] == 29500
    assert svc["metadata"]["ownerReferences"][0]["controller"] is True


def test_event_on_the_job() -> None:
    """What `kubectl describe tj` shows: an Event on the TrainingJob from the operator replica,
    its message cut to what the API server accepts."""
    job = Job.from_storage(BODY)
    event = builders.get_event(job=job, type="Warning", reason="Preempted", message="x" * 5000,
                               instance="kubetrain-7d9f", time="2026-12-03T13:05:00Z")
    assert event["metadata"] == {"generateName": "gpt-small.", "namespace": "ml"}
    assert event["involvedObject"] == {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                       "name": "gpt-small", "namespace": "ml", "uid": "u-1"}
    assert (event["type"], event["reason"], event["message"]) == ("Warning", "Preempted", "x" * 1024)
    assert event["source"] == {"component": "kubetrain-operator"}
    assert (event["reportingComponent"], event["reportingInstance"]) == ("kubetrain.io/operator", "kubetrain-7d9f")
    assert (event["firstTimestamp"], event["lastTimestamp"], event["count"]) == (
        "2026-12-03T13:05:00Z", "2026-12-03T13:05:00Z", 1)


def test_built_pod_parses_back_into_a_view() -> None:
    pod = builders.get_pod(job=Job.from_storage(BODY), attempt=2, rank=1)
    view = PodView.from_storage(pod)
    assert view is not None and (view.name, view.attempt, view.rank, view.phase) == ("gpt-small-a2-n1", 2, 1, "Pending")


@pytest.mark.parametrize("spec, field", [
    ({"nodes": 0}, "spec.nodes"),
    ({"nodes": "2"}, "spec.nodes"),
    ({"image": ""}, "spec.image"),
    ({"strategy": {"type": "horovod"}}, "spec.strategy.type"),
    ({"checkpoint": {"uri": "gs://b", "credentialsSecret": {"name": "s"}}}, "spec.checkpoint.uri"),
    ({"checkpoint": {"uri": "s3://bucket"}}, "spec.checkpoint"),
    ({"checkpoint": {"uri": "s3://bucket", "credentialsSecret": {}}}, "spec.checkpoint.credentialsSecret.name"),
    ({"runPolicy": {"backoffLimit": -1}}, "spec.runPolicy.backoffLimit"),
    ({"trainer": {"builtin": {"task": "x"}, "command": ["a"]}}, "spec.trainer"),
    ({"resources": {"limits": {"memory": "100m"}}}, "spec.resources.limits.memory"),
    ({"resources": {"requests": {"ephemeral-storage": "0.5"}}}, "spec.resources.requests.ephemeral-storage"),
    ({"resources": {"limits": {"hugepages-2Mi": "1500m"}}}, "spec.resources.limits.hugepages-2Mi"),
])
def test_unusable_spec_names_the_field(spec: dict, field: str) -> None:
    base = {"image": "i", "trainer": {"builtin": {"task": "regression"}}, **spec}
    with pytest.raises(SpecError) as err:
        Spec.from_storage(base)
    assert str(err.value).startswith(field + ":")


def test_backoff_is_exponential_and_capped() -> None:
    policy = Spec.from_storage({"image": "i", "runPolicy": {"backoffSeconds": 10}}).run_policy
    assert [policy.backoff_delay(n) for n in (1, 2, 3, 4, 6)] == [10, 20, 40, 80, 300]


@pytest.mark.parametrize("env, setting", [
    ({"KUBETRAIN_LOG_LEVEL": "loud"}, "KUBETRAIN_LOG_LEVEL"),
    ({"KUBETRAIN_NAMESPACES": "ok,Not_OK"}, "KUBETRAIN_NAMESPACES"),
    ({"KUBETRAIN_DEFAULT_IMAGE": "a b"}, "KUBETRAIN_DEFAULT_IMAGE"),
    ({"KUBETRAIN_MAX_CONCURRENT_RECONCILES": "0"}, "KUBETRAIN_MAX_CONCURRENT_RECONCILES"),
    ({"KUBETRAIN_RESYNC_SECONDS": "soon"}, "KUBETRAIN_RESYNC_SECONDS"),
    ({"KUBETRAIN_LEADER_ELECTION": "maybe"}, "KUBETRAIN_LEADER_ELECTION"),
    ({"KUBETRAIN_LEADER_ELECTION_NAMESPACE": "Kube_System"}, "KUBETRAIN_LEADER_ELECTION_NAMESPACE"),
    ({"KUBETRAIN_LEADER_ELECTION_ID": "My Lease"}, "KUBETRAIN_LEADER_ELECTION_ID"),
    ({"KUBETRAIN_LEADER_ELECTION_IDENTITY": "pod a"}, "KUBETRAIN_LEADER_ELECTION_IDENTITY"),
    ({"KUBETRAIN_LEASE_DURATION_SECONDS": "1"}, "KUBETRAIN_LEASE_DURATION_SECONDS"),
    ({"KUBETRAIN_RENEW_DEADLINE_SECONDS": "15"}, "KUBETRAIN_RENEW_DEADLINE_SECONDS"),
    ({"KUBETRAIN_LEASE_DURATION_SECONDS": "8", "KUBETRAIN_RETRY_PERIOD_SECONDS": "7",
      "KUBETRAIN_RENEW_DEADLINE_SECONDS": "6"}, "KUBETRAIN_RETRY_PERIOD_SECONDS"),
])
def test_bad_setting_is_named(env: dict, setting: str) -> None:
    with pytest.raises(ConfigError) as err:
        Settings.from_env(env)
    assert err.value.setting == setting and setting in str(err.value)


def test_settings_defaults_and_namespaces() -> None:
    assert Settings.from_env({}).clusterwide
    s = Settings.from_env({"KUBETRAIN_NAMESPACES": "a, b", "KUBETRAIN_LOG_LEVEL": "debug",
                           "KUBETRAIN_DEFAULT_IMAGE": "img:1"})
    assert s.namespaces == ("a", "b") and s.log_level == "DEBUG" and s.default_image == "img:1"
    assert Spec.from_storage({}, default_image=s.default_image).image == "img:1"


def test_leader_election_settings() -> None:
    s = Settings.from_env({})
    assert not s.leader_election and s.leader_election_id == "kubetrain-operator"
    assert (s.lease_duration_seconds, s.renew_deadline_seconds, s.retry_period_seconds) == (15, 10, 2)
    s = Settings.from_env({"KUBETRAIN_LEADER_ELECTION": "Yes", "KUBETRAIN_LEADER_ELECTION_NAMESPACE": "ops",
                           "KUBETRAIN_LEADER_ELECTION_ID": "kt.operator", "KUBETRAIN_LEASE_DURATION_SECONDS": "30"})
    assert s.leader_election and s.leader_election_namespace == "ops" and s.leader_election_id == "kt.operator"
    assert s.lease_duration_seconds == 30


def test_lease_timing_must_be_ordered() -> None:
    from kubetrain.leader import LeaseTiming

    with pytest.raises(ValueError, match="retry_period < renew_deadline < lease_duration"):
        LeaseTiming(lease_duration=5, renew_deadline=5, retry_period=1)


def test_cli_refuses_a_bad_setting(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from kubetrain.cli import main

    monkeypatch.setenv("KUBETRAIN_LOG_LEVEL", "verbose")
    assert main(["operator", "run"]) == 2
    assert "KUBETRAIN_LOG_LEVEL" in capsys.readouterr().err


def test_pods_pass_pod_security_restricted_with_writable_volumes_only() -> None:
    pod = builders.get_pod(job=Job.from_storage(BODY), attempt=1, rank=0)
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                            "readOnlyRootFilesystem": True}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/tmp"]]["emptyDir"] == {}  # no limit unless spec.tmpSize sets one
    limited = builders.get_pod(job=Job.from_storage({**BODY, "spec": {**BODY["spec"], "tmpSize": "50Gi"}}),
                               attempt=1, rank=0)
    assert {"name": "kubetrain-tmp", "emptyDir": {"sizeLimit": "50Gi"}} in limited["spec"]["volumes"]
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert env_of(pod)["HOME"]["value"].startswith("/tmp/")


def test_the_job_s_user_and_group_ids_are_merged_into_the_pod_security_context() -> None:
    """A PVC owned by root needs fsGroup, an image whose USER is a name needs runAsUser: the job sets its IDs,
    while runAsNonRoot and the seccomp profile stay kubetrain's (PodSecurity "restricted" admits the pods)."""
    body = json.loads(json.dumps(BODY))
    ids = {"runAsUser": 2000, "runAsGroup": 3000, "fsGroup": 4000, "supplementalGroups": [5000, 5001],
           "fsGroupChangePolicy": "OnRootMismatch"}
    body["spec"]["podTemplate"] = {"securityContext": ids}
    pod = builders.get_pod(job=Job.from_storage(body), attempt=1, rank=0)
    assert pod["spec"]["securityContext"] == {**ids, "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
    body["spec"]["podTemplate"] = {"securityContext": {"fsGroup": 1000}}
    pod = builders.get_pod(job=Job.from_storage(body), attempt=1, rank=0)
    assert pod["spec"]["securityContext"] == {"fsGroup": 1000, "runAsNonRoot": True,
                                              "seccompProfile": {"type": "RuntimeDefault"}}


@pytest.mark.parametrize("context", [{"runAsNonRoot": False, "fsGroup": 1000},
                                     {"seccompProfile": {"type": "Unconfined"}, "privileged": True}])
def test_a_job_cannot_loosen_the_pod_security_context(context: dict) -> None:
    """The CRD declares only the IDs (the API server prunes the rest); a spec that has more anyway (an older or
    hand-edited CRD) still gets non-root pods under RuntimeDefault."""
    body = json.loads(json.dumps(BODY))
    body["spec"]["podTemplate"] = {"securityContext": context}
    pod = builders.get_pod(job=Job.from_storage(body), attempt=1, rank=0)
    assert pod["spec"]["securityContext"] == {**({"fsGroup": 1000} if "fsGroup" in context else {}),
                                              "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def test_shm_size_is_configurable_and_a_user_volume_at_dev_shm_wins() -> None:
    body = json.loads(json.dumps(BODY))
    body["spec"]["shmSize"] = "8Gi"
    pod = builders.get_pod(job=Job.from_storage(body), attempt=1, rank=0)
    assert {"medium": "Memory", "sizeLimit": "8Gi"} in [v.get("emptyDir") for v in pod["spec"]["volumes"]]
    body["spec"]["podTemplate"] = {"volumes": [{"name": "mine", "emptyDir": {"medium": "Memory"}}],
                                   "volumeMounts": [{"name": "mine", "mountPath": "/dev/shm"}]}
    pod = builders.get_pod(job=Job.from_storage(body), attempt=1, rank=0)
    shm = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert shm == [{"name": "mine", "mountPath": "/dev/shm"}]


def test_a_users_label_never_takes_over_the_labels_the_operator_finds_its_pods_by() -> None:
    """The operator watches pods by app.kubernetes.io/managed-by=kubetrain and indexes them by kubetrain.io/*:
    a podTemplate label with one of these keys is replaced (the CRD's description says so), never obeyed."""
    body = json.loads(json.dumps(BODY))
    body["spec"]["podTemplate"] = {"labels": {"app.kubernetes.io/managed-by": "argocd", "team": "a"}}
    labels = builders.get_pod(job=Job.from_storage(body), attempt=1, rank=0)["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "kubetrain" and labels["team"] == "a"
    crd = yaml.safe_load((Path(__file__).resolve().parents[3] / "crds" / "trainingjob.yaml").read_text())
    node = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["podTemplate"]
    assert "app.kubernetes.io/managed-by is always kubetrain" in " ".join(node["properties"]["labels"]["description"].split())


@pytest.mark.parametrize("size, empty_dir", [("200Gi", {"sizeLimit": "200Gi"}), (107374182400, {"sizeLimit": "107374182400"}),
                                             ("0", {}), (0, {})])
def test_tmp_is_limited_per_job_and_zero_is_no_limit(size, empty_dir) -> None:
    """/tmp (local checkpoints, HOME) is on the node's disk: without a sizeLimit one runaway write filled it and
    got the node's other pods evicted; a job sets its own, 0 for none, and a user volume at /tmp still wins."""
    body = json.loads(json.dumps(BODY))
    body["spec"]["tmpSize"] = size
    pod = builders.get_pod(job=Job.from_storage(body), attempt=1, rank=0)
    (tmp,) = [v for v in pod["spec"]["volumes"] if v["name"] == builders.TMP_VOLUME]
    assert tmp["emptyDir"] == empty_dir
    body["spec"]["podTemplate"] = {"volumes": [{"name": "scratch", "persistentVolumeClaim": {"claimName": "s"}}],
                                   "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}]}
    pod = builders.get_pod(job=Job.from_storage(body), attempt=1, rank=0)
    assert builders.TMP_VOLUME not in [v["name"] for v in pod["spec"]["volumes"]]


@pytest.mark.parametrize("template, mounted, account", [
    ({}, False, None),
    ({"serviceAccountName": "trainer"}, False, "trainer"),
    ({"automountServiceAccountToken": False}, False, None),
    ({"serviceAccountName": "trainer", "automountServiceAccountToken": True}, True, "trainer"),
], ids=["default", "a named account still gets no token", "explicitly off", "asked for"])
def test_training_pods_get_an_api_token_only_when_the_job_asks(template: dict, mounted: bool,
                                                               account: str | None) -> None:
    """Training code gets no Kubernetes credentials by default: the pod spec says false
    explicitly, so a ServiceAccount (or namespace default) that automounts does not win."""
    body = json.loads(json.dumps(BODY))
    body["spec"]["podTemplate"] = template
    spec = builders.get_pod(job=Job.from_storage(body), attempt=1, rank=0)["spec"]
    assert spec["automountServiceAccountToken"] is mounted
    assert spec.get("serviceAccountName") == account


@pytest.mark.parametrize("policy", [None, "Always", "IfNotPresent", "Never"])
def test_image_pull_policy_is_the_job_s_or_left_to_kubernetes(policy: str | None) -> None:
    """Unset, the pod leaves it out and Kubernetes decides (Always for :latest), as the CRD documents."""
    body = json.loads(json.dumps(BODY))
    if policy:
        body["spec"]["imagePullPolicy"] = policy
    container = builders.get_pod(job=Job.from_storage(body), attempt=1, rank=0)["spec"]["containers"][0]
    assert container.get("imagePullPolicy") == policy


def test_sizes_with_a_fraction_of_a_unit_are_fine_and_runpolicy_values_past_the_crd_bounds_are_capped() -> None:
    """1.2Gi is a size the kubelet rounds up; a stored runPolicy value from before a CRD bound existed is read as the
    bound, so an operator upgrade never fails a job that was running."""
    spec = Spec.from_storage({"image": "i", "trainer": {"builtin": {"task": "regression"}},
                              "resources": {"limits": {"memory": "1.2Gi"}},
                              "runPolicy": {"activeDeadlineSeconds": 10**12, "backoffSeconds": 3601}})
    assert spec.resources == {"limits": {"memory": "1.2Gi"}}
    assert (spec.run_policy.active_deadline_seconds, spec.run_policy.backoff_seconds) == (2**31 - 1, 3600)
