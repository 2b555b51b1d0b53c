"""The operator's second look at a spec (kubetrain.spec.Spec.from_storage): a TrainingJob
stored before the CRD refused something the pod API refuses fails as InvalidSpec naming
the field, instead of as pod creates that are refused on every attempt. The CRD is the
first line (tests/integration/api/test_trainingjob_validation.py); these rules mirror
its important ones, and the tests at the end keep the two lists in step."""

from __future__ import annotations

import re

import pytest

from kubetrain.spec import CONTRACT_ENV_NAMES, CREDENTIAL_ENV_NAMES, RESERVED_MOUNT_PATHS, RESERVED_MOUNT_TREES, Spec, SpecError

BASE = {"image": "i", "trainer": {"builtin": {"task": "regression"}}}
VOLUME = {"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}]}


def mount(path: str, sub: str | None = None) -> dict:
    m = {"name": "data", "mountPath": path, **({"subPath": sub} if sub is not None else {})}
    return {"podTemplate": {**VOLUME, "volumeMounts": [m]}}


def tolerations(*items: dict) -> dict:
    return {"podTemplate": {"tolerations": list(items)}}


def ids(**context: object) -> dict:
    return {"podTemplate": {"securityContext": context}}


CKPT = {"credentialsSecret": {"name": "s3"}}


def builtin_args(**args: object) -> dict:
    return {"trainer": {"builtin": {"task": "regression", "args": args}}}

REFUSED = [
    ({"resources": {"limits": {"nvidia.com/gpu": "0.5"}}}, "resources.limits.nvidia.com/gpu", "whole number"),
    ({"resources": {"limits": {"example.com/fpga": "1500m"}}}, "resources.limits.example.com/fpga", "whole number"),
    ({"resources": {"limits": {"memory": -1}}}, "resources.limits.memory", "non-negative"),
    ({"resources": {"requests": {"cpu": "-500m"}}}, "resources.requests.cpu", "non-negative"),
    ({"resources": {"requests": {"cpu": "lots"}}}, "resources.requests.cpu", "quantity"),
    ({"resources": {"requests": {"cpu": True}}}, "resources.requests.cpu", "quantity"),
    ({"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}}, "resources.requests.cpu", "exceed"),
    ({"resources": {"requests": {"memory": "1.5Gi"}, "limits": {"memory": "1G"}}}, "resources.requests.memory",
     "exceed"),
    ({"resources": {"requests": {"nvidia.com/gpu": 1}}}, "resources.requests.nvidia.com/gpu", "set in limits"),
    ({"resources": {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 2}}},
     "resources.requests.nvidia.com/gpu", "equal to the limit"),
    ({"resources": {"requests": {"hugepages-2Mi": "64Mi"}, "limits": {"hugepages-2Mi": "128Mi"}}},
     "resources.requests.hugepages-2Mi", "equal to the limit"),
    ({"resources": {"limits": {"gpu": 1}}}, "resources.limits.gpu", "not a container resource"),
    # Hugepages as the pod API takes them: a page size in the name and a whole number of pages (the CRD checks
    # these for hugepages-2Mi and hugepages-1Gi only: its rules read the quantities of named keys).
    ({"resources": {"limits": {"hugepages-2Mi": "3Mi", "memory": "1Gi"}}}, "resources.limits.hugepages-2Mi",
     "whole number of 2Mi pages"),
    ({"resources": {"requests": {"hugepages-1Gi": "1.5Gi", "memory": "1Gi"}, "limits": {"hugepages-1Gi": "1.5Gi"}}},
     "resources.requests.hugepages-1Gi", "whole number of 1Gi pages"),
    ({"resources": {"limits": {"hugepages-2M": "3M", "memory": "1Gi"}}}, "resources.limits.hugepages-2M",
     "whole number of 2M pages"),
    ({"resources": {"limits": {"hugepages-huge": "2Mi", "memory": "1Gi"}}}, "resources.limits.hugepages-huge",
     "hugepages-<page size>"),
    ({"resources": {"limits": {"hugepages-0": "0", "memory": "1Gi"}}}, "resources.limits.hugepages-0",
     "hugepages-<page size>"),
    ({"resources": {"limits": {"hugepages-500m": "1", "memory": "1Gi"}}}, "resources.limits.hugepages-500m",
     "hugepages-<page size>"),
    ({"resources": {"limits": {"Example.com/gpu": 1}}}, "resources.limits.Example.com/gpu", "not a container resource"),
    (mount("/data/../etc"), "podTemplate.volumeMounts[0].mountPath", "clean absolute path"),
    (mount("/data/./x"), "podTemplate.volumeMounts[0].mountPath", "clean absolute path"),
    (mount("/tmp/"), "podTemplate.volumeMounts[0].mountPath", "clean absolute path"),
    (mount("/dev//shm"), "podTemplate.volumeMounts[0].mountPath", "clean absolute path"),
    (mount("data"), "podTemplate.volumeMounts[0].mountPath", "clean absolute path"),
    (mount("/"), "podTemplate.volumeMounts[0].mountPath", "clean absolute path"),
    (mount("/dev"), "podTemplate.volumeMounts[0].mountPath", "reserved"),
    (mount("/dev/termination-log"), "podTemplate.volumeMounts[0].mountPath", "reserved"),
    (mount("/proc/sys"), "podTemplate.volumeMounts[0].mountPath", "reserved"),
    (mount("/etc/kubetrain"), "podTemplate.volumeMounts[0].mountPath", "reserved"),
    (mount("/tmp/kubetrain/checkpoints"), "podTemplate.volumeMounts[0].mountPath", "reserved"),
    (mount("/data", "../x"), "podTemplate.volumeMounts[0].subPath", "relative path"),
    (mount("/data", "a/.."), "podTemplate.volumeMounts[0].subPath", "relative path"),
    (mount("/data", "./a"), "podTemplate.volumeMounts[0].subPath", "relative path"),
    (mount("/data", "/abs"), "podTemplate.volumeMounts[0].subPath", "relative path"),
    ({"podTemplate": {"labels": {"team name": "ml"}}}, "podTemplate.labels", "'team name'"),
    ({"podTemplate": {"labels": {"a/b/c": "x"}}}, "podTemplate.labels", "'a/b/c'"),
    ({"podTemplate": {"nodeSelector": {"example.com/": "x"}}}, "podTemplate.nodeSelector", "'example.com/'"),
    ({"podTemplate": {"annotations": {"-a": "x"}}}, "podTemplate.annotations", "'-a'"),
    (tolerations({"operator": "Equal", "value": "x"}), "podTemplate.tolerations[0].operator", "Exists"),
    (tolerations({"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 5}),
     "podTemplate.tolerations[0].effect", "NoExecute"),
    (tolerations({"operator": "Exists"}, {"key": "k", "tolerationSeconds": 5}),
     "podTemplate.tolerations[1].effect", "NoExecute"),
    (tolerations({"key": "k", "operator": "Exists", "value": "v"}), "podTemplate.tolerations[0].value", "empty"),
    ({"env": [{"name": "AWS_ACCESS_KEY_ID", "value": "AKIAEXAMPLE"}]}, "env[0].value", "AWS_ACCESS_KEY_ID"),
    ({"env": [{"name": "X", "value": "1"}, {"name": "AWS_SESSION_TOKEN", "value": "t"}]}, "env[1].value",
     "AWS_SESSION_TOKEN"),
    ({"env": [{"name": "AWS_PROFILE", "value": "prod"}]}, "env[0].value", "Secret"),
    ({"checkpoint": {**CKPT, "uri": "s3://bucket-name/a/../b"}}, "checkpoint.uri", "'..'"),
    ({"checkpoint": {**CKPT, "uri": "s3://bucket-name/./a"}}, "checkpoint.uri", "'.'"),
    ({"checkpoint": {**CKPT, "uri": "s3://bucket-name/a/.."}}, "checkpoint.uri", "'..'"),
    ({"checkpoint": {**CKPT, "uri": "s3://bucket-name/a//b"}}, "checkpoint.uri", "'//'"),
    ({"checkpoint": {**CKPT, "uri": "s3://bucket-name//"}}, "checkpoint.uri", "'//'"),
    (builtin_args(strategy="fsdp"), "trainer.builtin.args.strategy", "set spec.strategy.type instead"),
    (builtin_args(deepspeed={"zero_optimization": {"stage": 3}}), "trainer.builtin.args.deepspeed",
     "spec.strategy.deepspeed"),
    ({**builtin_args(deepspeed="/ds.json"), "strategy": {"type": "zero3", "deepspeed": {"config": {"a": 1}}}},
     "trainer.builtin.args.deepspeed", "spec.strategy.deepspeed"),
    (builtin_args(fsdp_config={"shard_modules": ["Block"]}), "trainer.builtin.args.fsdp_config",
     "only with spec.strategy.type fsdp"),
    ({**builtin_args(fsdp_config={"cpu_offload": True}), "strategy": {"type": "fsdp"}},
     "trainer.builtin.args.fsdp_config.cpu_offload", "spec.strategy.fsdp.cpuOffload"),
    (ids(runAsUser=0), "podTemplate.securityContext.runAsUser", "root"),
    (ids(supplementalGroups=[100, -1]), "podTemplate.securityContext.supplementalGroups[1]", "from 0 to"),
    (ids(runAsUser=-1), "podTemplate.securityContext.runAsUser", "from 1 to 2147483647"),
    (ids(fsGroup=2**31), "podTemplate.securityContext.fsGroup", "from 0 to 2147483647"),
    (ids(runAsUser="1000"), "podTemplate.securityContext.runAsUser", "integer"),
    (ids(runAsGroup=True), "podTemplate.securityContext.runAsGroup", "integer"),
    (ids(supplementalGroups=100), "podTemplate.securityContext.supplementalGroups", "list"),
    (ids(fsGroupChangePolicy="OnMismatch"), "podTemplate.securityContext.fsGroupChangePolicy", "OnRootMismatch"),
    ({"podTemplate": {"securityContext": "1000"}}, "podTemplate.securityContext", "object"),
    ({"tmpSize": "500m"}, "tmpSize", "must be a size in bytes such as 50Gi"),
    ({"tmpSize": "lots"}, "tmpSize", "must be a size in bytes such as 50Gi"),
    ({"tmpSize": "20 Gi"}, "tmpSize", "must be a size in bytes such as 50Gi"),
    ({"tmpSize": "20Gi\n"}, "tmpSize", "must be a size in bytes such as 50Gi"),
    ({"tmpSize": -1}, "tmpSize", "or 0 for no limit; got -1"),
    ({"tmpSize": True}, "tmpSize", "must be a size in bytes such as 50Gi"),
]


@pytest.mark.parametrize("patch, field, words", REFUSED, ids=[f"{r[1]}-{i}" for i, r in enumerate(REFUSED)])
def test_what_pods_would_refuse_is_an_invalid_spec_naming_the_field(patch: dict, field: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        Spec.from_storage({**BASE, **patch})
    assert err.value.field_path == field
    assert str(err.value).startswith(f"spec.{field}: ") and words in str(err.value)


ACCEPTED = [
    {"resources": {"requests": {"nvidia.com/gpu": 2, "cpu": "500m", "memory": "1.5Gi", "hugepages-2Mi": "64Mi"},
                   "limits": {"nvidia.com/gpu": "2", "cpu": 1, "memory": "2Gi", "hugepages-2Mi": "64Mi",
                              "example.com/fpga": "1000m", "ephemeral-storage": "1e3"}}},
    {"resources": {"requests": {"cpu": ".5", "memory": "+128Mi"}, "limits": {"cpu": "0.5", "memory": "134217728"}}},
    # Hugepages with no cpu or memory: the pod API refuses them ("HugePages require cpu or memory") only after
    # admission, where a namespace's LimitRange may have given the container a default cpu or memory.
    {"resources": {"limits": {"hugepages-2Mi": "64Mi"}}},
    {"resources": {"requests": {"hugepages-2Mi": "64Mi", "ephemeral-storage": "1Gi"},
                   "limits": {"hugepages-2Mi": "64Mi", "nvidia.com/gpu": 1}}},
    {"resources": {"requests": {"cpu": 1, "hugepages-1Gi": "2Gi"},
                   "limits": {"hugepages-1Gi": "2048Mi", "hugepages-2048Ki": 4194304, "hugepages-1.5Mi": "3Mi",
                              "hugepages-2M": "0"}}},
    {"podTemplate": {"volumes": VOLUME["volumes"] + [{"name": "scratch", "emptyDir": {}}],
                     "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"},
                                      {"name": "scratch", "mountPath": "/dev/shm", "subPath": "shm"},
                                      {"name": "data", "mountPath": "/tmp/data", "subPath": "models/gpt2"},
                                      {"name": "data", "mountPath": "/data/.cache", "subPath": "cache/..data/"},
                                      {"name": "data", "mountPath": "/tmp/kubetrainer"},
                                      {"name": "data", "mountPath": "/etc/kubetrain-extra"}]}},
    {"podTemplate": {"labels": {"example.com/team": "ml", "app": ""}, "annotations": {"Example.com/Note": "x y"},
                     "nodeSelector": {"kubernetes.io/arch": "amd64"}}},
    tolerations({"operator": "Exists"},
                {"key": "dedicated", "value": "ml", "effect": "NoExecute", "tolerationSeconds": 60},
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}),
    {"env": [{"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
             {"name": "AWS_PROFILE", "value": ""}, {"name": "AWS_REGION", "value": "eu-west-1"}]},
    {"checkpoint": {**CKPT, "uri": "s3://my.bucket/jobs/v1.2/..hidden/"}},
    {"checkpoint": {**CKPT, "uri": "s3://bucket-name"}},
    ids(runAsUser=1000, runAsGroup=1000, fsGroup=2000, supplementalGroups=[3000, 2**31 - 1],
        fsGroupChangePolicy="OnRootMismatch"),
    ids(fsGroup=1, fsGroupChangePolicy="Always"),
    ids(runAsUser=1000680000, runAsGroup=0, fsGroup=0, supplementalGroups=[0]),  # OpenShift-style: group 0 is no root
    ids(),
]


@pytest.mark.parametrize("patch", ACCEPTED, ids=range(len(ACCEPTED)))
def test_what_pods_allow_is_parsed(patch: dict) -> None:
    spec = Spec.from_storage({**BASE, **patch})
    assert spec.pod_template == patch.get("podTemplate", {})
    assert spec.resources == patch.get("resources", {})
    assert list(spec.env) == patch.get("env", [])


def test_builtin_args_may_repeat_the_strategy_and_add_fsdp_options_the_crd_has_no_field_for() -> None:
    spec = Spec.from_storage({**BASE, **builtin_args(strategy="fsdp", fsdp_config={"shard_modules": ["Block"]}),
                              "strategy": {"type": "fsdp", "fsdp": {"cpuOffload": True}}})
    assert spec.strategy.type == "fsdp" and spec.trainer.builtin_args["fsdp_config"] == {"shard_modules": ["Block"]}


@pytest.mark.parametrize("value, limit", [(None, "0"), ("50Gi", "50Gi"), ("200G", "200G"), ("1.5Ti", "1.5Ti"),
                                          (0, "0"),
                                          (10737418240, "10737418240")])
def test_tmp_size_is_a_size_in_bytes_with_the_crds_default(schema: dict, value, limit: str) -> None:
    node = schema["properties"]["spec"]["properties"]["tmpSize"]
    assert node["default"] == Spec.from_storage(BASE).tmp_size == "0"
    assert Spec.from_storage({**BASE, **({"tmpSize": value} if value is not None else {})}).tmp_size == limit
    # The operator's second look takes exactly the sizes the CRD's rule does.
    from kubetrain.spec import _SIZE
    assert f"string(self).matches(r'{_SIZE.pattern}')" in _crd_rule_text(schema, "spec", "tmpSize")


def _crd_rule_text(schema: dict, *path: str) -> str:
    node = schema
    for p in path:
        node = node["items"] if p == "[]" else node["properties"][p]
    return " ".join(r["rule"] for r in node["x-kubernetes-validations"])


def test_credential_names_are_the_crds(schema: dict) -> None:
    """The operator refuses literal values of exactly the variables the CRD does."""
    text = _crd_rule_text(schema, "spec", "env", "[]")
    in_crd = {n for n in re.findall(r"'([A-Z][A-Z0-9_]+)'", text)}
    assert in_crd == CREDENTIAL_ENV_NAMES
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"} <= in_crd


def test_contract_names_are_the_crds_and_the_pods_never_override_them(schema: dict) -> None:
    """A spec stored before the CRD's rule (or under an outdated CRD: a helm upgrade without the README's
    `kubectl apply -f crds/`) must not override MASTER_ADDR & co. (the user's env comes after the contract's,
    and the kubelet lets the last of two equal names win), nor fail the running job at the upgrade."""
    text = _crd_rule_text(schema, "spec", "env", "[]", "name")
    assert set(re.findall(r"'([A-Z][A-Z0-9_]+)'", text)) == CONTRACT_ENV_NAMES
    from kubetrain import builders
    from kubetrain.api import Job
    body = {"metadata": {"name": "tj", "namespace": "ns", "uid": "u", "generation": 1}, "spec": BASE}
    made = {e["name"] for e in builders.get_env(job=Job.from_storage(body, default_image="img:1"), attempt=1, rank=0)}
    assert CONTRACT_ENV_NAMES - {"KUBETRAIN_FSDP_CONFIG", "KUBETRAIN_DEEPSPEED_CONFIG", "KUBETRAIN_RESUME_FROM",
                                 "KUBETRAIN_BUILTIN_TASK", "KUBETRAIN_TRAINER_ARGS"} <= made
    # Stored before the rule: the job keeps running (an operator upgrade must not fail it), the contract wins.
    stale = {**BASE, "env": [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "MASTER_ADDR", "value": "10.0.0.1"}]}
    env = builders.get_env(job=Job.from_storage({**body, "spec": stale}, default_image="img:1"), attempt=1, rank=0)
    assert [e for e in env if e["name"] == "MASTER_ADDR"] == [e for e in env if e["name"] == "MASTER_ADDR"][:1]
    assert [e.get("value") for e in env if e["name"] == "MASTER_ADDR"] != ["10.0.0.1"]
    assert {"name": "OMP_NUM_THREADS", "value": "1"} in env


def test_reserved_mount_paths_are_the_crds(schema: dict) -> None:
    text = _crd_rule_text(schema, "spec", "podTemplate", "volumeMounts", "[]", "mountPath")
    for path in RESERVED_MOUNT_PATHS:
        assert f"'{path}'" in text, path
    for tree in RESERVED_MOUNT_TREES:
        assert f"startsWith('{tree}/')" in text, tree
    # The operator's own mounts are covered: builders.DEEPSPEED_DIR and the local checkpoints.
    from kubetrain import builders
    assert builders.DEEPSPEED_DIR.startswith("/etc/kubetrain/") and builders.HOME_DIR.startswith("/tmp/kubetrain/")


def test_pod_security_fields_are_the_crds(schema: dict) -> None:
    """The operator passes on exactly the securityContext fields the CRD declares, with the CRD's bounds; the
    CRD has none that could loosen the pods (runAsNonRoot, seccompProfile, ...) nor keeps unknown ones."""
    from kubetrain.resources import FS_GROUP_CHANGE_POLICIES, MAX_ID, POD_SECURITY_IDS

    node = schema["properties"]["spec"]["properties"]["podTemplate"]["properties"]["securityContext"]
    props = node["properties"]
    assert set(props) == {*POD_SECURITY_IDS, "supplementalGroups", "fsGroupChangePolicy"}
    assert not node.get("x-kubernetes-preserve-unknown-fields")
    for key, id_node in [(k, props[k]) for k in POD_SECURITY_IDS] + [("group", props["supplementalGroups"]["items"])]:
        lowest = 1 if key == "runAsUser" else 0  # user 0 is root; group 0 grants nothing (OpenShift-style images)
        assert (id_node["type"], id_node["minimum"], id_node["maximum"]) == ("integer", lowest, MAX_ID)
    assert props["fsGroupChangePolicy"]["enum"] == list(FS_GROUP_CHANGE_POLICIES)
    assert "runAsNonRoot" in node["description"] and "RuntimeDefault" in node["description"]


@pytest.mark.parametrize("gpus, procs, ok", [(4, 4, True), (4, 2, True), (2, 4, False), ("1", 8, False),
                                             (None, 8, True), (0, 8, True)])
def test_more_worker_processes_than_gpus_per_pod_is_an_invalid_spec(gpus, procs, ok) -> None:
    """Each process takes the GPU of its local rank: with 8 processes and 2 GPUs, ranks 2-7 died in torch's
    "invalid device ordinal" on every attempt until backoffLimit, naming nothing the user set."""
    resources = {"limits": {"nvidia.com/gpu": gpus}} if gpus is not None else {}
    spec = {**BASE, "procsPerNode": procs, "resources": resources}
    if ok:
        assert Spec.from_storage(spec).procs_per_node == procs
        return
    with pytest.raises(SpecError) as err:
        Spec.from_storage(spec)
    assert err.value.field_path == "procsPerNode" and "nvidia.com/gpu" in str(err.value)


def test_more_processes_than_gpus_is_left_to_a_users_command_to_use_cpu_and_to_a_started_job() -> None:
    """A user's command may map its devices itself, use_cpu takes none, and a job that already ran under an older
    operator is not failed by a check added since (an upgrade under it)."""
    many = {**BASE, "procsPerNode": 8, "resources": {"limits": {"nvidia.com/gpu": 2}}}
    own = {**many, "trainer": {"command": ["python", "train.py"]}}
    on_cpu = {**many, "trainer": {"builtin": {"task": "regression", "args": {"use_cpu": True}}}}
    assert Spec.from_storage(own).procs_per_node == Spec.from_storage(on_cpu).procs_per_node == 8
    assert Spec.from_storage(many, started=True).procs_per_node == 8
    clash = {**BASE, "trainer": {"builtin": {"task": "regression", "args": {"strategy": "fsdp"}}}}
    with pytest.raises(SpecError):
        Spec.from_storage(clash)
    assert Spec.from_storage(clash, started=True).strategy.type == "ddp"


def test_a_started_job_with_a_spec_the_parser_chokes_on_is_not_failed_for_good() -> None:
    """Once a job ran, a parsing error that is not a SpecError is a bug of the operator's, not the job's: the
    reconcile raises (logged, retried) instead of failing the running job as InvalidSpec."""
    from kubetrain.api import Job

    body = {"metadata": {"name": "tj", "namespace": "ns"}, "spec": {**BASE, "strategy": "fsdp"}}
    assert Job.from_storage(body).spec is None
    with pytest.raises((TypeError, ValueError, AttributeError, KeyError)):
        Job.from_storage({**body, "status": {"attempt": 1, "phase": "Running"}})


@pytest.mark.parametrize("patch", [{"strategy": "fsdp"}, {"podTemplate": {"tolerations": ["x"]}}, {"checkpoint": "x"},
                                   {"resources": "x"}])
def test_a_value_of_a_type_the_schema_refuses_is_an_invalid_spec_not_a_crash(patch: dict) -> None:
    """The CRD's types keep these out; one stored around them made every reconcile of the job crash (retried
    every 10 s forever, the job with no phase or condition)."""
    from kubetrain.api import Job

    job = Job.from_storage({"metadata": {"name": "tj", "namespace": "ns"}, "spec": {**BASE, **patch}})
    assert job.spec is None and job.spec_error.startswith("spec: a value does not have the type")


@pytest.mark.parametrize("patch, field", [({"env": ["A=1"]}, "env[0]"), ({"env": {"A": "1"}}, "env"),
                                          ({"envFrom": [1]}, "envFrom")])
def test_env_entries_that_are_not_objects_are_an_invalid_spec_naming_the_field(patch: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        Spec.from_storage({**BASE, **patch})
    assert err.value.field_path == field
