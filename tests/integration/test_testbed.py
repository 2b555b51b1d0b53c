"""The testbed behaves like a real cluster and a real S3 (issue 2).

Each test drives a real component: the API server's schema validation, the
scheduler's binding and preemption, the controller-manager's garbage
collector and disruption controller, RBAC with TokenRequest tokens, kwok's
pod lifecycle (including kubetrain's exit stage), MinIO's multipart upload,
and the kubectl/helm binaries. Later tests of the operator rely on exactly
these mechanisms.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
from pathlib import Path

import pytest

from kubetrain_testbed import (
    EXIT_CODE_ANNOTATION,
    EXIT_DELAY_ANNOTATION,
    EXIT_MESSAGE_ANNOTATION,
    NODE_LOST_ANNOTATION,
    fake_node,
    wait_until,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
HOLD_FINALIZER = "testbed.kubetrain.io/hold"
"""Keeps a deleted pod visible so a test can read what happened to it."""


def _versions() -> dict[str, str]:
    out = {}
    for line in (ROOT / "testbed" / "versions.env").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _pod(
    name: str,
    *,
    cpu: str = "100m",
    node_selector: dict[str, str] | None = None,
    priority_class: str | None = None,
    annotations: dict[str, str] | None = None,
    owner: dict | None = None,
    finalizers: list[str] | None = None,
    labels: dict[str, str] | None = None,
) -> dict:
    meta: dict = {"name": name, "annotations": annotations or {}, "labels": labels or {}}
    if owner:
        meta["ownerReferences"] = [owner]
    if finalizers:
        meta["finalizers"] = finalizers
    spec: dict = {
        "containers": [{"name": "main", "image": "busybox:stable", "resources": {"requests": {"cpu": cpu, "memory": "64Mi"}}}],
        "restartPolicy": "Never",
        "nodeSelector": {"type": "kwok", **(node_selector or {})},
    }
    if priority_class:
        spec["priorityClassName"] = priority_class
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


@pytest.fixture
def core(kube_api, namespace):
    """CoreV1Api; afterwards releases every pod of the test's namespace held by HOLD_FINALIZER."""
    from kubernetes import client

    api = client.CoreV1Api(kube_api)
    yield api
    for pod in api.list_namespaced_pod(namespace).items:
        if HOLD_FINALIZER in (pod.metadata.finalizers or []):
            _release(api, namespace, pod.metadata.name)


def _read_pod_or_none(core, ns: str, name: str):
    from kubernetes import client

    try:
        return core.read_namespaced_pod(name, ns)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _wait_running(core, ns: str, name: str, timeout: float = 120):
    return wait_until(
        lambda: core.read_namespaced_pod(name, ns),
        lambda p: p.status.phase == "Running" and bool(p.status.pod_ip),
        timeout=timeout,
        what=f"pod {ns}/{name} Running",
    )


def _wait_gone(core, ns: str, name: str, timeout: float = 120) -> None:
    wait_until(lambda: _read_pod_or_none(core, ns, name), lambda p: p is None, timeout=timeout, what=f"pod {ns}/{name} deleted")


def _release(core, ns: str, name: str) -> None:
    core.patch_namespaced_pod(name, ns, {"metadata": {"finalizers": None}})


# -- API server ------------------------------------------------------------------------------------


def test_crd_is_served_and_invalid_objects_are_rejected_with_the_validation_message(kubectl, namespace):
    group = f"t{secrets.token_hex(3)}.testbed.kubetrain.io"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["replicas"],
                                    "x-kubernetes-validations": [
                                        {"rule": "self.replicas <= self.maxReplicas", "message": "replicas must not exceed maxReplicas"}
                                    ],
                                    "properties": {
                                        "replicas": {"type": "integer", "minimum": 1},
                                        "maxReplicas": {"type": "integer", "default": 8},
                                    },
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    kubectl("apply", "-f", "-", input=json.dumps(crd))
    try:
        kubectl("wait", "--for=condition=Established", "--timeout=120s", f"crd/widgets.{group}", timeout=180)

        def widget(name: str, replicas: int) -> str:
            return json.dumps({"apiVersion": f"{group}/v1", "kind": "Widget", "metadata": {"name": name, "namespace": namespace}, "spec": {"replicas": replicas}})

        wait_until(lambda: kubectl("apply", "-f", "-", input=widget("good", 2)), timeout=120, what="Widget kind served")
        got = json.loads(kubectl("get", f"widgets.{group}", "good", "-n", namespace, "-o", "json"))
        assert got["spec"] == {"replicas": 2, "maxReplicas": 8}, "the schema default must be applied by the API server"

        with pytest.raises(Exception) as below_min:
            kubectl("apply", "-f", "-", input=widget("too-small", 0))
        assert "spec.replicas" in str(below_min.value) and "greater than or equal to 1" in str(below_min.value)

        with pytest.raises(Exception) as cel:
            kubectl("apply", "-f", "-", input=widget("too-big", 9))
        assert "replicas must not exceed maxReplicas" in str(cel.value)
        assert "too-small" not in kubectl("get", f"widgets.{group}", "-n", namespace, "-o", "name")
    finally:
        kubectl("delete", "crd", f"widgets.{group}", "--wait=false")


# -- scheduler, kwok, garbage collector -----------------------------------------------------------------


def test_pod_is_scheduled_onto_a_kwok_node_runs_and_is_garbage_collected_with_its_owner(core, namespace):
    from kubernetes import client

    owner = core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner")))
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid, "controller": True}
    core.create_namespaced_pod(namespace, _pod("owned", owner=ref))
    pod = _wait_running(core, namespace, "owned")
    node = core.read_node(pod.spec.node_name)
    assert node.metadata.labels.get("type") == "kwok"
    assert any(c.type == "PodScheduled" and c.status == "True" for c in pod.status.conditions)
    # The scheduler posts its event in the background: kwok may report the pod Running first.
    def reasons() -> list[str]:
        return [e.reason for e in core.list_namespaced_event(namespace, field_selector="involvedObject.name=owned").items]

    wait_until(reasons, lambda r: "Scheduled" in r, timeout=120, what="the scheduler's Scheduled event of owned")

    core.delete_namespaced_config_map("owner", namespace, propagation_policy="Background")
    _wait_gone(core, namespace, "owned", timeout=180)  # the GC queues behind other tests' churn


# -- preemption and eviction ------------------------------------------------------------------------------


@pytest.fixture
def small_node(core, kubectl):
    """A dedicated fake node with 2 CPUs that only this test's pods select."""
    pool = f"small-{secrets.token_hex(3)}"
    kubectl("apply", "-f", "-", input=json.dumps(fake_node(name=pool, cpu="2", memory="8Gi", gpus="0", labels={"kubetrain.io/testbed-pool": pool})))
    kubectl("wait", "--for=condition=Ready", "--timeout=120s", f"node/{pool}", timeout=180)
    yield pool
    kubectl("delete", "node", pool, "--wait=false")


@pytest.fixture
def priority_classes(kube_api):
    from kubernetes import client

    sched = client.SchedulingV1Api(kube_api)
    suffix = secrets.token_hex(3)
    names = {"low": f"low-{suffix}", "high": f"high-{suffix}"}
    for level, value in (("low", 100), ("high", 1000)):
        sched.create_priority_class(client.V1PriorityClass(metadata=client.V1ObjectMeta(name=names[level]), value=value))
    yield names
    for name in names.values():
        sched.delete_priority_class(name)


def test_higher_priority_pod_preempts_a_victim_that_gets_disruption_target(core, namespace, small_node, priority_classes):
    sel = {"kubetrain.io/testbed-pool": small_node}
    for i in range(2):
        core.create_namespaced_pod(
            namespace, _pod(f"low-{i}", cpu="1", node_selector=sel, priority_class=priority_classes["low"], finalizers=[HOLD_FINALIZER])
        )
    for i in range(2):
        assert _wait_running(core, namespace, f"low-{i}").spec.node_name == small_node
    core.create_namespaced_pod(namespace, _pod("high", cpu="1", node_selector=sel, priority_class=priority_classes["high"]))

    def victims():
        pods = [core.read_namespaced_pod(f"low-{i}", namespace) for i in range(2)]
        return [p for p in pods if p.metadata.deletion_timestamp is not None]

    victim = wait_until(victims, lambda v: len(v) == 1, timeout=120, what="one low-priority pod preempted")[0]
    cond = {c.type: c for c in victim.status.conditions}
    assert cond["DisruptionTarget"].status == "True"
    assert cond["DisruptionTarget"].reason == "PreemptionByScheduler"
    survivor = "low-1" if victim.metadata.name == "low-0" else "low-0"
    _release(core, namespace, victim.metadata.name)
    _wait_gone(core, namespace, victim.metadata.name)
    assert _wait_running(core, namespace, "high").spec.node_name == small_node
    assert core.read_namespaced_pod(survivor, namespace).metadata.deletion_timestamp is None
    _release(core, namespace, survivor)


def test_eviction_api_evicts_a_pod_and_honours_a_disruption_budget(core, kube_api, namespace):
    from kubernetes import client

    core.create_namespaced_pod(namespace, _pod("guarded", labels={"app": "guarded"}, finalizers=[HOLD_FINALIZER]))
    _wait_running(core, namespace, "guarded")
    policy = client.PolicyV1Api(kube_api)
    policy.create_namespaced_pod_disruption_budget(
        namespace,
        client.V1PodDisruptionBudget(
            metadata=client.V1ObjectMeta(name="keep-one"),
            spec=client.V1PodDisruptionBudgetSpec(min_available=1, selector=client.V1LabelSelector(match_labels={"app": "guarded"})),
        ),
    )
    # The disruption controller must have computed the budget before it can refuse.
    wait_until(
        lambda: policy.read_namespaced_pod_disruption_budget("keep-one", namespace).status,
        lambda s: s is not None and s.observed_generation == 1 and s.current_healthy == 1,
        timeout=120,
        what="PDB status observed",
    )
    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name="guarded", namespace=namespace))
    with pytest.raises(client.ApiException) as refused:
        core.create_namespaced_pod_eviction("guarded", namespace, eviction)
    assert refused.value.status == 429, refused.value.body

    policy.delete_namespaced_pod_disruption_budget("keep-one", namespace)
    wait_until(lambda: core.create_namespaced_pod_eviction("guarded", namespace, eviction), timeout=120, what="eviction accepted")
    pod = core.read_namespaced_pod("guarded", namespace)
    assert pod.metadata.deletion_timestamp is not None
    cond = {c.type: c for c in pod.status.conditions}
    assert cond["DisruptionTarget"].reason == "EvictionByEvictionAPI"
    _release(core, namespace, "guarded")
    _wait_gone(core, namespace, "guarded")


def test_a_lost_node_is_tainted_and_its_pods_are_evicted_then_it_recovers(core, kubectl, namespace, small_node):
    short = [
        {"key": f"node.kubernetes.io/{t}", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 1}
        for t in ("unreachable", "not-ready")
    ]
    pod = _pod("stranded", node_selector={"kubetrain.io/testbed-pool": small_node}, finalizers=[HOLD_FINALIZER])
    pod["spec"]["tolerations"] = short
    core.create_namespaced_pod(namespace, pod)
    _wait_running(core, namespace, "stranded")

    kubectl("annotate", "node", small_node, f"{NODE_LOST_ANNOTATION}=true")
    node = wait_until(
        lambda: core.read_node(small_node),
        lambda n: any(t.key == "node.kubernetes.io/unreachable" and t.effect == "NoExecute" for t in n.spec.taints or []),
        timeout=120,  # node-monitor-grace-period (20 s) and the taint controller, on a loaded machine
        what="unreachable:NoExecute taint",
    )
    assert {c.type: c.status for c in node.status.conditions}["Ready"] == "Unknown"
    evicted = wait_until(
        lambda: core.read_namespaced_pod("stranded", namespace),
        lambda p: p.metadata.deletion_timestamp is not None,
        timeout=120,
        what="pod on the lost node deleted",
    )
    assert {c.type: c.reason for c in evicted.status.conditions}["DisruptionTarget"] == "DeletionByTaintManager"

    kubectl("annotate", "node", small_node, f"{NODE_LOST_ANNOTATION}-")
    wait_until(
        lambda: core.read_node(small_node),
        lambda n: {c.type: c.status for c in n.status.conditions}["Ready"] == "True" and not n.spec.taints,
        timeout=120,
        what="node Ready and untainted again",
    )


# -- kwok exit stage -----------------------------------------------------------------------------------


def _terminated(pod):
    return pod.status.container_statuses[0].state.terminated


def test_annotating_a_running_pod_makes_it_succeed_or_fail_with_that_exit_code(core, namespace, kubectl):
    for name in ("finisher", "crasher"):
        core.create_namespaced_pod(namespace, _pod(name))
    for name in ("finisher", "crasher"):
        _wait_running(core, namespace, name)
    kubectl("annotate", "pod", "finisher", "-n", namespace, f"{EXIT_CODE_ANNOTATION}=0")
    report = '{"step": 1200, "uri": "s3://b/c/checkpoint-1200"}'
    kubectl("annotate", "pod", "crasher", "-n", namespace, f"{EXIT_CODE_ANNOTATION}=83", f"{EXIT_MESSAGE_ANNOTATION}={report}")

    done = wait_until(lambda: core.read_namespaced_pod("finisher", namespace), lambda p: p.status.phase == "Succeeded", timeout=120, what="finisher Succeeded")
    assert _terminated(done).exit_code == 0 and _terminated(done).reason == "Completed"
    failed = wait_until(lambda: core.read_namespaced_pod("crasher", namespace), lambda p: p.status.phase == "Failed", timeout=120, what="crasher Failed")
    assert _terminated(failed).exit_code == 83
    assert _terminated(failed).reason == "Error"
    assert json.loads(_terminated(failed).message) == json.loads(report)


def test_exit_annotations_at_creation_run_first_then_fail_after_the_delay(core, namespace):
    from kubernetes import watch

    created = core.create_namespaced_pod(namespace, _pod("doomed", annotations={EXIT_CODE_ANNOTATION: "3", EXIT_DELAY_ANNOTATION: "3s"}))
    # Running lasts only 3 s: polling could miss it on a loaded machine; a watch from the creation's
    # resourceVersion sees every state the pod went through.
    states = []
    w = watch.Watch()
    for ev in w.stream(core.list_namespaced_pod, namespace, field_selector="metadata.name=doomed",
                       resource_version=created.metadata.resource_version, timeout_seconds=120):
        states.append(ev["object"])
        if ev["object"].status and ev["object"].status.phase in ("Succeeded", "Failed"):
            w.stop()
            break
    assert states and states[-1].status and states[-1].status.phase == "Failed", [s.status and s.status.phase for s in states]
    failed = states[-1]
    running = next((s for s in states if s.status and s.status.phase == "Running" and s.status.pod_ip), None)
    assert running is not None, [s.status and s.status.phase for s in states]
    assert running.status.container_statuses[0].state.running is not None
    assert _terminated(failed).exit_code == 3
    started = running.status.start_time
    assert (_terminated(failed).finished_at - started).total_seconds() >= 2.5


# -- RBAC with ServiceAccount tokens ----------------------------------------------------------------


def test_service_account_token_is_forbidden_until_a_role_binding_allows_it(core, kube_api, namespace, testbed):
    from kubernetes import client

    rbac = client.RbacAuthorizationV1Api(kube_api)
    core.create_namespaced_service_account(namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="robot")))
    token = core.create_namespaced_service_account_token(
        "robot", namespace, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600))
    ).status.token
    conf = client.Configuration()
    conf.host = testbed.api_server
    conf.ssl_ca_cert = testbed.ca_file
    conf.api_key = {"authorization": f"Bearer {token}"}
    robot = client.CoreV1Api(client.ApiClient(conf))

    with pytest.raises(client.ApiException) as denied:
        robot.list_namespaced_pod(namespace)
    assert denied.value.status == 403
    assert f"system:serviceaccount:{namespace}:robot" in denied.value.body

    rbac.create_namespaced_role(
        namespace,
        client.V1Role(metadata=client.V1ObjectMeta(name="pod-reader"), rules=[client.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["list"])]),
    )
    rbac.create_namespaced_role_binding(
        namespace,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="robot-reads-pods"),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="pod-reader"),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name="robot", namespace=namespace)],
        ),
    )
    wait_until(lambda: robot.list_namespaced_pod(namespace), timeout=60, what="robot may list pods")
    with pytest.raises(client.ApiException) as still_denied:
        robot.list_namespaced_pod("default")
    assert still_denied.value.status == 403, "a Role grants nothing outside its namespace"


# -- S3 ----------------------------------------------------------------------------------------------


def test_multipart_object_round_trips_through_minio_byte_exact(s3, s3_prefix, testbed, tmp_path):
    from boto3.s3.transfer import TransferConfig

    payload = os.urandom(21 * 1024 * 1024 + 12345)
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    src.write_bytes(payload)
    key = s3_prefix + "big.bin"
    cfg = TransferConfig(multipart_threshold=8 * 1024 * 1024, multipart_chunksize=8 * 1024 * 1024)
    s3.upload_file(str(src), testbed.bucket, key, Config=cfg)
    head = s3.head_object(Bucket=testbed.bucket, Key=key)
    assert head["ContentLength"] == len(payload)
    assert head["ETag"].strip('"').endswith("-3"), f"expected a 3-part upload, ETag {head['ETag']}"
    s3.download_file(testbed.bucket, key, str(dst), Config=cfg)
    assert hashlib.sha256(dst.read_bytes()).hexdigest() == hashlib.sha256(payload).hexdigest()


# -- CLIs ----------------------------------------------------------------------------------------------


def test_kubectl_and_helm_work_against_the_testbed(testbed_env):
    versions = _versions()
    out = subprocess.run(["kubectl", "version", "-o", "json"], env=testbed_env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    reported = json.loads(out.stdout)
    assert reported["serverVersion"]["gitVersion"] == versions["K8S_VERSION"]
    assert reported["clientVersion"]["gitVersion"] == versions["K8S_VERSION"]

    helm = subprocess.run(["helm", "version", "--short"], env=testbed_env, capture_output=True, text=True, timeout=180)
    assert helm.returncode == 0, helm.stderr
    assert helm.stdout.startswith(versions["HELM_VERSION"]), helm.stdout
    listed = subprocess.run(["helm", "list", "--all-namespaces"], env=testbed_env, capture_output=True, text=True, timeout=180)
    assert listed.returncode == 0 and listed.stdout.startswith("NAME"), listed.stderr


# -- lifecycle of the testbed itself ---------------------------------------------------------------------


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                pass
    return [p for p in pids if p != os.getpid()]


def _private_config(tmp_path: Path, bin_dir: Path, *, nodes: int = 0):
    from kubetrain_testbed import NodePool, TestbedConfig
    from kubetrain_testbed.config import Timeouts

    script = tmp_path / "build.sh"
    script.write_text(f"#!/bin/sh\necho {bin_dir}\n")
    return TestbedConfig(
        state_dir=tmp_path / "state",
        build_script=script,
        node_pools=(NodePool(name="private", count=nodes),),
        # Generous: a second control plane starts next to the shared one, on a loaded machine.
        timeouts=Timeouts(etcd=120.0, apiserver=240.0, controllers=120.0, minio=120.0, nodes_ready=120.0),
    )


def test_a_component_that_cannot_start_fails_fast_with_its_log_and_leaves_no_process(testbed, tmp_path):
    from kubetrain_testbed import ComponentFailed, up

    real = Path(testbed.bin_dir)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for exe in real.iterdir():
        (bin_dir / exe.name).symlink_to(exe)
    (bin_dir / "kube-apiserver").unlink()
    (bin_dir / "kube-apiserver").write_text("#!/bin/sh\necho 'E0101 boom: --etcd-servers unreachable' >&2\nexit 3\n")
    (bin_dir / "kube-apiserver").chmod(0o755)

    with pytest.raises(ComponentFailed) as failed:
        up(_private_config(tmp_path, bin_dir))
    assert failed.value.component == "kube-apiserver"
    assert "boom: --etcd-servers unreachable" in str(failed.value)
    assert _processes_mentioning(str(tmp_path)) == [], "etcd and MinIO of the failed start must be stopped"


@pytest.mark.slow
def test_up_is_idempotent_and_down_leaves_no_process(testbed, tmp_path):
    from kubetrain_testbed import down, is_healthy, status, up

    cfg = _private_config(tmp_path, Path(testbed.bin_dir), nodes=1)
    try:
        first = up(cfg)
        pids = {s.name: s.pid for s in status(cfg)}
        assert set(pids) == {"etcd", "minio", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"}
        assert is_healthy(cfg)
        again = up(cfg)
        assert again == first and {s.name: s.pid for s in status(cfg)} == pids, "a healthy testbed is reused"
        env_file = (cfg.env_file).read_text()
        assert f"export KUBECONFIG={cfg.kubeconfig}" in env_file and "AWS_SECRET_ACCESS_KEY=" in env_file
    finally:
        assert down(cfg) == []
    assert _processes_mentioning(str(tmp_path)) == []
    assert status(cfg) == [] and not is_healthy(cfg)
