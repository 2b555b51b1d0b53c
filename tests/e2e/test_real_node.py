"""On the real node: pods are containers from our images, run by a real kubelet and containerd.

The testbed's real node (`scripts/testbed.sh up --nodes real`, testbed/README.md)
is added to the shared testbed by the `real_node` fixture. These tests prove
what the process agent cannot: images built from the repository's
Dockerfiles and pulled from a registry, PodSecurity `restricted`
admission, the pod network with cluster DNS (headless Service names resolved
by CoreDNS, no address rewriting), `kubectl logs` through the kubelet, and the
operator running with its in-cluster ServiceAccount mount.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import textwrap
import urllib.request
from pathlib import Path

import pytest

from .helpers import wait_events, wait_for
from .operator_release import CHART, helm

# The first test also starts the node and pulls the 5.6 GB trainer image into containerd.
pytestmark = [pytest.mark.e2e, pytest.mark.realnode, pytest.mark.timeout(1800)]

REAL_NODE_LABEL = "kubetrain.io/real-node"
#: Pod spec fields that put a pod on (only) the real node.
REAL_PLACEMENT = {
    "nodeSelector": {REAL_NODE_LABEL: "true"},
    "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"}],
}
#: The operator's CPU request on the real node, above the chart's default (250m): two training pods (500m
#: each) start `import torch` on 2 shared cores next to the whole control plane. (The liveness-probe
#: restarts once blamed on starvation here were the node's firewall dropping the probes' replies.)
REAL_OPERATOR_RESOURCES = {"resources": {"requests": {"cpu": "500m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}}
#: What PodSecurity "restricted" demands of every container.
RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


@pytest.fixture
def restricted_ns(core):
    from kubernetes import client

    name = f"kt-real-{secrets.token_hex(3)}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={
        "kubetrain.io/test": "true", "pod-security.kubernetes.io/enforce": "restricted"})))
    wait_for(lambda: core.read_namespaced_service_account("default", name), timeout=120, what="default SA",
             ignore=(client.ApiException,))
    yield name
    core.delete_namespace(name, propagation_policy="Background")


def _kubectl(env: dict, *args: str, input: str | None = None, timeout: float = 180) -> str:
    out = subprocess.run(["kubectl", *args], env=env, input=input, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"kubectl {' '.join(args)}: {out.stderr}"
    return out.stdout


def _pod(name: str, image: str, script: str, **spec) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "dns-probe"}},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"runAsUser": 10001, "runAsGroup": 10001},
            "containers": [{"name": "main", "image": image, "imagePullPolicy": "IfNotPresent",
                            "command": ["python", "-c", textwrap.dedent(script)], "securityContext": RESTRICTED,
                            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}}],
            **REAL_PLACEMENT, **spec,
        },
    }


SERVER = """
    import http.server, socket
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(socket.gethostname().encode())
    http.server.HTTPServer(("", 8000), H).serve_forever()
"""

CLIENT = """
    import os, socket, time, urllib.request
    host = os.environ["PEER"]
    for _ in range(240):
        try:
            addr = socket.gethostbyname(host)
            body = urllib.request.urlopen(f"http://{host}:8000/", timeout=5).read().decode()
            print(f"resolved {host} -> {addr}; it says {body}", flush=True)
            break
        except OSError as exc:
            time.sleep(0.5)
    else:
        raise SystemExit(f"never reached {host}")
    print("resolv.conf:", open("/etc/resolv.conf").read().replace("\\n", " | "))
    print("uid", os.getuid(), "shm", os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize)
"""


def test_restricted_pods_find_each_other_through_cluster_dns_and_kubectl_logs_reads_them(
        real_node, images, restricted_ns, testbed_env, core):
    ns, image = restricted_ns, images["operator"]  # any image of ours with Python will do
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "peers"},
           "spec": {"clusterIP": "None", "selector": {"app": "dns-probe"}, "publishNotReadyAddresses": True,
                    "ports": [{"name": "http", "port": 8000}]}}
    server = _pod("server", image, SERVER, hostname="server", subdomain="peers")
    client_pod = _pod("client", image, CLIENT)
    client_pod["spec"]["containers"][0]["env"] = [{"name": "PEER", "value": f"server.peers.{ns}.svc"}]
    for obj in (svc, server, client_pod):
        _kubectl(testbed_env, "apply", "-n", ns, "-f", "-", input=json.dumps(obj))

    def finished():
        p = core.read_namespaced_pod("client", ns)
        return p if p.status.phase in ("Succeeded", "Failed") else None

    done = wait_for(finished, timeout=300, what="the client pod to finish",
                    on_timeout=lambda: _kubectl(testbed_env, "describe", "pods", "-n", ns))
    logs = _kubectl(testbed_env, "logs", "-n", ns, "client")
    assert done.status.phase == "Succeeded", logs
    server_ip = core.read_namespaced_pod("server", ns).status.pod_ip
    assert f"resolved server.peers.{ns}.svc -> {server_ip}; it says server" in logs, logs
    assert "uid 10001" in logs, logs
    assert done.spec.node_name == "real-node-0"
    assert done.status.container_statuses[0].image_id, "the image was pulled by containerd"


@pytest.fixture(scope="module")
def real_operator(real_node, images, testbed_env, core, tmp_path_factory):
    """The chart installed from the registry's operator image, on the real node, watching a restricted namespace."""
    from kubernetes import client

    suffix = secrets.token_hex(3)
    rel, ns, jobs_ns = f"kt-real-{suffix}", f"kt-real-op-{suffix}", f"kt-real-jobs-{suffix}"
    for name in (ns, jobs_ns):
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={
            "kubetrain.io/test": "true", "pod-security.kubernetes.io/enforce": "restricted"})))
    wait_for(lambda: core.read_namespaced_service_account("default", jobs_ns), timeout=120, what="default SA",
             ignore=(client.ApiException,))
    values = {"image": {"repository": images["operator"].rsplit(":", 1)[0], "tag": images["operator"].rsplit(":", 1)[1]},
              "namespaces": [jobs_ns], **REAL_PLACEMENT, **REAL_OPERATOR_RESOURCES}
    path = tmp_path_factory.mktemp("helm") / "values.json"
    path.write_text(json.dumps(values))
    helm(testbed_env, "upgrade", "--install", rel, str(CHART), "--namespace", ns, "--values", str(path),
         "--wait", "--timeout", "5m")
    yield {"release": rel, "namespace": ns, "jobs": jobs_ns}
    subprocess.run(["helm", "uninstall", rel, "--namespace", ns, "--wait", "--timeout", "2m"], env=testbed_env,
                   capture_output=True, timeout=180)
    for name in (jobs_ns, ns):
        core.delete_namespace(name, propagation_policy="Background")


def test_operator_chart_runs_from_its_image_with_the_in_cluster_service_account(real_operator, testbed_env, core):
    from kubernetes.client import CoordinationV1Api

    ns = real_operator["namespace"]
    pod = core.list_namespaced_pod(ns, label_selector="app.kubernetes.io/component=operator").items[0]
    assert pod.spec.node_name == "real-node-0" and pod.status.phase == "Running"
    assert all(c.ready for c in pod.status.container_statuses), pod.status
    # In-cluster config: the ServiceAccount token mount and the `kubernetes` Service, nothing from the testbed.
    assert any(v.projected for v in pod.spec.volumes), "the standard ServiceAccount token volume"
    holder = wait_for(lambda: [le for le in CoordinationV1Api(core.api_client).list_namespaced_lease(ns).items
                               if le.spec.holder_identity == pod.metadata.name],
                      timeout=120, what="the operator pod to hold its leader Lease")
    assert holder
    logs = _kubectl(testbed_env, "logs", "-n", ns, pod.metadata.name)
    assert "Traceback" not in logs, logs
    # The kubelet's liveness probe reaches /healthz on the pod IP from the node: so does this test (the
    # node's firewall once dropped the replies, and the kubelet restarted a healthy operator every minute).
    # Right after it takes the Lease the port changes hands (the standby's endpoint closes, kopf's opens):
    # a reset then is that handover, as a probe would see it, not the fault this looks for.
    port = next(p.container_port for p in pod.spec.containers[0].ports if p.name == "health")

    def kopf_healthz() -> bool:  # kopf's endpoint: its probe handler's result (the standby's says "leader")
        with urllib.request.urlopen(f"http://{pod.status.pod_ip}:{port}/healthz", timeout=5) as resp:
            return resp.status == 200 and "api_writes" in json.loads(resp.read())

    wait_for(kopf_healthz, timeout=60, what="kopf's /healthz from the node", ignore=(OSError,))
    pod = core.read_namespaced_pod(pod.metadata.name, ns)
    assert pod.status.container_statuses[0].restart_count == 0, _kubectl(testbed_env, "describe", "pod", "-n", ns,
                                                                          pod.metadata.name)


def _s3_secret(core, ns: str, testbed) -> None:
    from kubernetes import client

    try:
        core.create_namespaced_secret(ns, client.V1Secret(metadata=client.V1ObjectMeta(name="kubetrain-s3"),
                                                          string_data={"accessKeyId": testbed.access_key,
                                                                       "secretAccessKey": testbed.secret_key}))
    except client.ApiException as exc:
        if exc.status != 409:
            raise


def _example_job(example: str, name: str, *, images, real_node, testbed, prefix: str) -> dict:
    """An examples/ job on the real node: our image from the registry, MinIO as pods reach it."""
    import yaml

    from .operator_release import EXAMPLE

    job = yaml.safe_load((EXAMPLE.parent / example).read_text())
    job["metadata"] = {"name": name}
    spec = job["spec"]
    spec["image"] = images["trainer"]
    # Two training pods and the operator share this machine's 2 cores.
    spec["resources"] = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "3Gi"}}
    spec["checkpoint"] = {**spec["checkpoint"], "uri": f"s3://{testbed.bucket}/{prefix.strip('/')}",
                          "endpoint": real_node.pod_s3_endpoint}
    spec["podTemplate"] = {**spec.get("podTemplate", {}), **REAL_PLACEMENT}
    return job


def _demo_job(name: str, *, images, real_node, testbed, prefix: str, args: dict | None = None,
              env: list | None = None, example: str = "trainingjob.yaml") -> dict:
    """A built-in trainer example on the real node, with extra trainer arguments and env."""
    job = _example_job(example, name, images=images, real_node=real_node, testbed=testbed, prefix=prefix)
    spec = job["spec"]
    spec["trainer"]["builtin"]["args"].update(args or {})
    if env:
        spec["env"] = env
    return job


def _job_status(core, ns: str, name: str) -> dict:
    from kubernetes import client

    return client.CustomObjectsApi(core.api_client).get_namespaced_custom_object(
        "kubetrain.io", "v1alpha1", ns, "trainingjobs", name).get("status") or {}


def _wait_finished(core, testbed_env, ns: str, name: str, timeout: float = 540) -> dict:
    def finished():
        st = _job_status(core, ns, name)
        return st if st.get("phase") in ("Succeeded", "Failed") else None

    return wait_for(finished, timeout=timeout, interval=2, what=f"TrainingJob {name} to finish",
                    on_timeout=lambda: _kubectl(testbed_env, "describe", "pods", "-n", ns))


def _committed_steps(s3, bucket: str, prefix: str) -> dict[int, dict]:
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            rel = o["Key"][len(prefix):]
            if rel.startswith("checkpoint-") and rel.endswith("/manifest.json") and rel.count("/") == 1:
                m = json.loads(s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read())
                out[int(m["step"])] = m
    return out


def test_demo_job_trains_to_success_on_containers_that_rendezvous_through_cluster_dns(
        real_node, real_operator, images, testbed_env, core, s3, s3_prefix, testbed):
    ns, name = real_operator["jobs"], f"demo-{secrets.token_hex(2)}"
    _s3_secret(core, ns, testbed)
    _kubectl(testbed_env, "apply", "-n", ns, "-f", "-",
             input=json.dumps(_demo_job(name, images=images, real_node=real_node, testbed=testbed, prefix=s3_prefix)))

    st = _wait_finished(core, testbed_env, ns, name)
    rank1 = _kubectl(testbed_env, "logs", "-n", ns, f"{name}-a1-n1")
    assert st["phase"] == "Succeeded", (st, rank1[-3000:])
    assert (st["attempt"], st.get("preemptions", 0), st.get("failures", 0)) == (1, 0, 0), st
    pod1 = core.read_namespaced_pod(f"{name}-a1-n1", ns)
    env = {e.name: e.value for e in pod1.spec.containers[0].env}
    assert env["MASTER_ADDR"] == f"{name}-n0.{name}.{ns}.svc", "no rewriting: the name is resolved by CoreDNS"
    assert pod1.spec.node_name == "real-node-0" and pod1.status.container_statuses[0].image_id
    prefix = f"{s3_prefix}{ns}/{name}/"
    keys = {o["Key"][len(prefix):] for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=testbed.bucket, Prefix=prefix) for o in page.get("Contents", [])}
    steps = sorted(int(k.split("/")[0].split("-")[1]) for k in keys
                   if k.startswith("checkpoint-") and k.endswith("/manifest.json"))
    assert steps and steps[-1] == 40, sorted(keys)
    manifest = json.loads(s3.get_object(Bucket=testbed.bucket, Key=f"{prefix}checkpoint-40/manifest.json")["Body"].read())
    assert manifest["world_size"] == 2 and {f["path"] for f in manifest["files"]} <= {
        k.split("/", 1)[1] for k in keys if k.startswith("checkpoint-40/")}, manifest


def test_eviction_sigterms_pid_1_which_commits_an_emergency_checkpoint_and_attempt_2_resumes_from_it(
        real_node, real_operator, images, testbed_env, core, s3, s3_prefix, testbed):
    """Real preemption: the Eviction API, the kubelet's SIGTERM to the launcher (PID 1), the grace period."""
    import time

    from kubernetes import client

    ns, name, hold = real_operator["jobs"], f"evict-{secrets.token_hex(2)}", 20
    _s3_secret(core, ns, testbed)
    job = _demo_job(name, images=images, real_node=real_node, testbed=testbed, prefix=s3_prefix,
                    args={"max_steps": 60, "save_total_limit": None},
                    env=[{"name": "KUBETRAIN_TEST_HOLD_AT_STEP", "value": str(hold)}])
    _kubectl(testbed_env, "apply", "-n", ns, "-f", "-", input=json.dumps(job))
    prefix = f"{s3_prefix}{ns}/{name}/"
    wait_for(lambda: hold in _committed_steps(s3, testbed.bucket, prefix), timeout=420, interval=1,
             what=f"checkpoint-{hold} committed", on_timeout=lambda: _kubectl(testbed_env, "describe", "pods", "-n", ns))
    victim = f"{name}-a1-n1"
    core.create_namespaced_pod_eviction(victim, ns, client.V1Eviction(
        metadata=client.V1ObjectMeta(name=victim, namespace=ns)))
    evicted = time.monotonic()
    running2 = wait_for(lambda: [p for p in core.list_namespaced_pod(ns, label_selector="kubetrain.io/attempt=2").items
                                 if p.status.phase == "Running"], timeout=300, what="attempt 2 running")
    restart_s = time.monotonic() - evicted
    st = _wait_finished(core, testbed_env, ns, name)
    assert st["phase"] == "Succeeded", st
    assert (st["attempt"], st["preemptions"], st.get("failures", 0)) == (2, 1, 0), st
    committed = _committed_steps(s3, testbed.bucket, prefix)
    first = sorted(s for s, m in committed.items() if m["attempt"] == 1)
    # The kubelet's SIGTERM reached the launcher as PID 1 of its container: the gang stopped after one more
    # step and committed it within the grace period.
    assert first and first[-1] == hold + 1, committed
    rank0 = _kubectl(testbed_env, "logs", "-n", ns, f"{name}-a2-n0")
    assert f"checkpoint-{hold + 1}" in rank0 and "resuming from" in rank0, rank0[-3000:]
    assert max(committed) == 60 and committed[60]["attempt"] == 2
    print(f"\n[real node] eviction -> attempt 2 Running in {restart_s:.1f}s ({len(running2)} pods)")


def test_kueue_preempts_a_low_priority_gang_which_commits_an_emergency_checkpoint_and_resumes_when_readmitted(
        real_node, real_operator, images, testbed_env, core, s3, s3_prefix, testbed, make_kueue_queue):
    """Issue 14, acceptance 3, with real training in containers: a running low-priority 3-node job is
    preempted by Kueue for a high-priority 2-node job (the ClusterQueue holds 3 pods); the low job's
    pods get SIGTERM and commit an emergency checkpoint, it counts a preemption (backoffLimit 0 is
    untouched), the high job runs to success, and the low job is re-admitted and resumes from the
    emergency checkpoint."""
    ns, suffix, hold = real_operator["jobs"], secrets.token_hex(2), 20
    low, high = f"low-{suffix}", f"high-{suffix}"
    queue = make_kueue_queue(cpu="3", pods=3, namespace=ns)
    _s3_secret(core, ns, testbed)

    def queued_job(name: str, *, nodes: int, priority: str, args: dict, env: list | None = None) -> dict:
        job = _demo_job(name, images=images, real_node=real_node, testbed=testbed, prefix=s3_prefix, args=args,
                        env=env)
        job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": queue.local_queue}
        spec = job["spec"]
        spec["nodes"] = nodes
        # Five training pods at most share this machine's 2 cores with the operator (one gang at a time).
        spec["resources"] = {"requests": {"cpu": "300m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "3Gi"}}
        spec["podTemplate"] = {**spec["podTemplate"], "priorityClassName": priority}
        spec["runPolicy"] = {**spec.get("runPolicy", {}), "backoffLimit": 0}
        return job

    _kubectl(testbed_env, "apply", "-n", ns, "-f", "-", input=json.dumps(queued_job(
        low, nodes=3, priority="low", args={"max_steps": 40, "save_total_limit": None},
        env=[{"name": "KUBETRAIN_TEST_HOLD_AT_STEP", "value": str(hold)}])))
    low_prefix = f"{s3_prefix}{ns}/{low}/"
    wait_for(lambda: hold in _committed_steps(s3, testbed.bucket, low_prefix), timeout=420, interval=1,
             what=f"{low}: checkpoint-{hold} committed",
             on_timeout=lambda: _kubectl(testbed_env, "describe", "pods", "-n", ns))
    assert _job_status(core, ns, low)["phase"] == "Running"

    _kubectl(testbed_env, "apply", "-n", ns, "-f", "-", input=json.dumps(queued_job(
        high, nodes=2, priority="high", args={"max_steps": 10, "save_steps": 10})))
    st = wait_for(lambda: (lambda s: s if s.get("phase") == "Queued" and s.get("preemptions") == 1 else None)(
        _job_status(core, ns, low)), timeout=300, interval=1, what=f"{low} preempted and queued again")
    assert st.get("failures", 0) == 0, st
    queued = next(c for c in st["conditions"] if c["type"] == "Queued")
    assert queued["status"] == "True", queued
    # The kubelet's SIGTERM reached each launcher; the gang stopped after one more step and committed it
    # within the grace period (the job is Queued from the eviction on, while its pods still terminate).
    committed = wait_for(lambda: (lambda c: c if hold + 1 in c else None)(
        _committed_steps(s3, testbed.bucket, low_prefix)), timeout=120, interval=1,
        what=f"{low}: the emergency checkpoint-{hold + 1}",
        on_timeout=lambda: _kubectl(testbed_env, "logs", "-n", ns, f"{low}-a1-n0", "--tail=40"))
    assert max(committed) == hold + 1 and committed[hold + 1]["attempt"] == 1, sorted(committed)

    st_high = _wait_finished(core, testbed_env, ns, high)
    assert st_high["phase"] == "Succeeded", st_high
    assert (st_high["attempt"], st_high.get("preemptions", 0), st_high.get("failures", 0)) == (1, 0, 0), st_high

    st = _wait_finished(core, testbed_env, ns, low, timeout=600)
    assert st["phase"] == "Succeeded", st
    assert (st["attempt"], st["preemptions"], st.get("failures", 0)) == (2, 1, 0), st
    rank0 = _kubectl(testbed_env, "logs", "-n", ns, f"{low}-a2-n0")
    assert f"checkpoint-{hold + 1}" in rank0 and "resuming from" in rank0, rank0[-3000:]
    committed = _committed_steps(s3, testbed.bucket, low_prefix)
    assert max(committed) == 40 and committed[40]["attempt"] == 2, sorted(committed)
    assert min(s for s, m in committed.items() if m["attempt"] == 2) > hold + 1, sorted(committed)
    events = wait_events(core, ns, low, lambda evs: "Succeeded" in {e.reason for e in evs},
                         what=f"the Succeeded event of {low}")
    assert "Preempted" in {e.reason for e in events}, [(e.reason, e.message) for e in events]


def test_a_120s_grace_commits_the_emergency_checkpoint_while_a_slow_upload_is_in_flight(
        real_node, real_operator, images, testbed_env, core, s3, s3_prefix, testbed):
    """Issue 11's drain acceptance: with spec.runPolicy.terminationGracePeriodSeconds 120 and uploads that
    take over 10 s (KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND caps rank 0's bandwidth: loopback MinIO is
    otherwise instant), node rank 0 is evicted while checkpoint-10 is still uploading. Inside the grace
    period its launcher finishes that upload, the workers write the emergency checkpoint-11, and it is
    uploaded and committed too; attempt 2 resumes from it. (With the old fixed 30 s grace the launcher had
    about 8 s for all of that.)"""
    import time

    from kubernetes import client

    ns, name, hold, rate = real_operator["jobs"], f"grace-{secrets.token_hex(2)}", 10, 100_000
    _s3_secret(core, ns, testbed)
    job = _demo_job(name, images=images, real_node=real_node, testbed=testbed, prefix=s3_prefix,
                    args={"max_steps": 20, "save_total_limit": None},
                    env=[{"name": "KUBETRAIN_TEST_HOLD_AT_STEP", "value": str(hold)},
                         {"name": "KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND", "value": str(rate)}])
    job["spec"]["runPolicy"] = {**job["spec"].get("runPolicy", {}), "terminationGracePeriodSeconds": 120}
    _kubectl(testbed_env, "apply", "-n", ns, "-f", "-", input=json.dumps(job))
    prefix = f"{s3_prefix}{ns}/{name}/"
    describe = lambda: _kubectl(testbed_env, "describe", "pods", "-n", ns)  # noqa: E731

    def folder(step: int) -> dict[str, dict]:
        out = {}
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=testbed.bucket,
                                                                  Prefix=f"{prefix}checkpoint-{step}/"):
            out.update({o["Key"].rsplit("/", 1)[1]: o for o in page.get("Contents", [])})
        return out

    # checkpoint-10 is uploading: some of its objects are in MinIO, its manifest is not.
    wait_for(lambda: (lambda f: f and "manifest.json" not in f)(folder(hold)), timeout=600, interval=0.5,
             what=f"checkpoint-{hold} uploading", on_timeout=describe)
    victim = f"{name}-a1-n0"
    pod = core.read_namespaced_pod(victim, ns)
    assert pod.spec.termination_grace_period_seconds == 120, pod.spec.termination_grace_period_seconds
    core.create_namespaced_pod_eviction(victim, ns, client.V1Eviction(
        metadata=client.V1ObjectMeta(name=victim, namespace=ns)))
    evicted = time.monotonic()
    # Watch status while attempt 2 starts: the emergency checkpoint's record says what its upload cost.
    records: list[dict] = []

    def emergency_committed():
        st = client.CustomObjectsApi(core.api_client).get_namespaced_custom_object(
            "kubetrain.io", "v1alpha1", ns, "trainingjobs", name).get("status") or {}
        if (st.get("lastCheckpoint") or {}).get("step") == hold + 1:
            records.append(st["lastCheckpoint"])
        return hold + 1 in _committed_steps(s3, testbed.bucket, prefix)

    wait_for(emergency_committed, timeout=150, interval=1, what=f"emergency checkpoint-{hold + 1} committed",
             on_timeout=describe)
    committed_after = time.monotonic() - evicted
    st = _wait_finished(core, testbed_env, ns, name)
    assert st["phase"] == "Succeeded", st
    assert (st["attempt"], st["preemptions"], st.get("failures", 0)) == (2, 1, 0), st
    committed = _committed_steps(s3, testbed.bucket, prefix)
    assert {s: m["attempt"] for s, m in committed.items() if s <= hold + 1} == {hold: 1, hold + 1: 1}, committed
    assert max(committed) == 20 and committed[20]["attempt"] == 2, sorted(committed)
    # The premise: one checkpoint's upload took over 10 s (first object to manifest, by MinIO's clock).
    objects = folder(hold + 1)
    span = (objects["manifest.json"]["LastModified"] - min(o["LastModified"] for o in objects.values())).total_seconds()
    assert span > 10, f"checkpoint-{hold + 1} uploaded in {span:.0f}s: the test hook did not slow it down"
    if records:
        assert records[-1]["uploadSeconds"] > 10 and records[-1]["sizeBytes"] > 0, records[-1]
    rank0 = _kubectl(testbed_env, "logs", "-n", ns, f"{name}-a2-n0")
    assert f"checkpoint-{hold + 1}" in rank0 and "resuming from" in rank0, rank0[-3000:]
    print(f"\n[real node] grace 120: checkpoint-{hold} finished and emergency checkpoint-{hold + 1} "
          f"({objects['manifest.json']['Size']} B manifest, uploaded in {span:.0f}s) committed "
          f"{committed_after:.0f}s after the eviction")


def test_dataloader_workers_run_in_the_container_with_the_memory_backed_dev_shm(
        real_node, real_operator, images, testbed_env, core, s3_prefix, testbed):
    ns, name = real_operator["jobs"], f"workers-{secrets.token_hex(2)}"
    _s3_secret(core, ns, testbed)
    job = _demo_job(name, images=images, real_node=real_node, testbed=testbed, prefix=s3_prefix,
                    args={"max_steps": 10, "save_steps": 10, "dataloader_num_workers": 2})
    _kubectl(testbed_env, "apply", "-n", ns, "-f", "-", input=json.dumps(job))
    st = _wait_finished(core, testbed_env, ns, name)
    assert st["phase"] == "Succeeded", (st, _kubectl(testbed_env, "logs", "-n", ns, f"{name}-a1-n0")[-3000:])
    pod = core.read_namespaced_pod(f"{name}-a1-n0", ns)
    shm = [v for v in pod.spec.volumes if v.empty_dir and v.empty_dir.medium == "Memory"]
    assert shm and shm[0].empty_dir.size_limit == "1Gi"


def test_a_wrong_image_fails_the_job_with_the_image_named(real_node, real_operator, images, testbed_env, core,
                                                          s3_prefix, testbed):
    ns, name = real_operator["jobs"], f"typo-{secrets.token_hex(2)}"
    _s3_secret(core, ns, testbed)
    job = _demo_job(name, images=images, real_node=real_node, testbed=testbed, prefix=s3_prefix)
    wrong = f"{real_node.registry}/kubetrain/trainr:0.1.0"
    job["spec"]["image"] = wrong
    job["spec"]["runPolicy"] = {**job["spec"].get("runPolicy", {}), "startupGraceSeconds": 20}
    _kubectl(testbed_env, "apply", "-n", ns, "-f", "-", input=json.dumps(job))
    st = _wait_finished(core, testbed_env, ns, name, timeout=300)
    assert st["phase"] == "Failed" and wrong in st.get("message", ""), st
    assert "startupGraceSeconds=20s" in st["message"], st
    def warnings(events):
        return [(e.reason, e.message or "") for e in events if e.type == "Warning"]

    # First a warning that the pull fails and will be retried, then the failure. The Failed
    # Event is posted after the status write the test has just seen, so it is waited for.
    events = wait_events(core, ns, name, lambda evs: any(r == "Failed" for r, _ in warnings(evs)),
                         what=f"the Failed event of {name}")
    assert any(r == "StartupDelayed" and wrong in m for r, m in warnings(events)), warnings(events)
    assert any(r == "Failed" and wrong in m for r, m in warnings(events)), warnings(events)


@pytest.mark.parametrize("example, strategy", [("trainingjob-fsdp.yaml", "fsdp"), ("trainingjob-zero3.yaml", "zero3")])
def test_sharded_examples_train_to_success_with_both_pods_parts_committed(
        example, strategy, real_node, real_operator, images, testbed_env, core, s3, s3_prefix, testbed):
    ns, name = real_operator["jobs"], f"{strategy}-{secrets.token_hex(2)}"
    _s3_secret(core, ns, testbed)
    job = _demo_job(name, images=images, real_node=real_node, testbed=testbed, prefix=s3_prefix, example=example,
                    args={"max_steps": 20, "save_steps": 10})
    # The examples are written for GPU nodes: one process per pod here, and none of their PriorityClasses.
    job["spec"]["procsPerNode"] = 1
    job["spec"]["podTemplate"] = dict(REAL_PLACEMENT)
    _kubectl(testbed_env, "apply", "-n", ns, "-f", "-", input=json.dumps(job))
    st = _wait_finished(core, testbed_env, ns, name)
    assert st["phase"] == "Succeeded", (st, _kubectl(testbed_env, "logs", "-n", ns, f"{name}-a1-n0")[-3000:])
    committed = _committed_steps(s3, testbed.bucket, f"{s3_prefix}{ns}/{name}/")
    final = committed[20]
    assert (final["strategy"], final["world_size"]) == (strategy, 2), final
    # Each pod saved its own rank's state on its own disk; node rank 0 committed both parts.
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {f["path"] for f in final["files"]}, final["files"]


def _registry_copy(registry: str, src_ref: str, dst_repo: str, dst_tag: str) -> None:
    """Give an image in the registry a second name, through the registry API (blob mounts and a
    manifest put): what a late `docker push`, or a mirror that catches up, does."""

    src_repo, src_tag = src_ref.split("/", 1)[1].rsplit(":", 1)
    accept = ", ".join(("application/vnd.oci.image.index.v1+json", "application/vnd.oci.image.manifest.v1+json",
                        "application/vnd.docker.distribution.manifest.v2+json",
                        "application/vnd.docker.distribution.manifest.list.v2+json"))

    def call(method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        req = urllib.request.Request(f"http://{registry}/v2/{path}", data=body, method=method, headers=headers or {})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.headers, resp.read()

    def copy(reference: str, tag: str) -> None:
        _, headers, raw = call("GET", f"{src_repo}/manifests/{reference}", headers={"Accept": accept})
        manifest = json.loads(raw)
        for child in manifest.get("manifests", []):  # an index: copy what it lists first
            copy(child["digest"], child["digest"])
        for blob in [manifest.get("config")] + manifest.get("layers", []):
            if blob:
                status, _, _ = call("POST", f"{dst_repo}/blobs/uploads/?mount={blob['digest']}&from={src_repo}", b"")
                assert status == 201, f"blob {blob['digest']} not mounted ({status})"
        call("PUT", f"{dst_repo}/manifests/{tag}", raw, {"Content-Type": headers["Content-Type"]})

    copy(src_tag, dst_tag)


def test_an_image_that_appears_late_is_pulled_within_the_startup_window(
        real_node, real_operator, images, testbed_env, core, s3_prefix, testbed):
    """A pull that fails at first (a registry rate limit, a mirror still syncing) is transient: the job
    shows StartupDelayed with the image named, the kubelet retries, and once the image is there the
    gang runs to Succeeded as attempt 1 with no failure spent."""
    from kubernetes import client

    ns, name = real_operator["jobs"], f"late-{secrets.token_hex(2)}"
    _s3_secret(core, ns, testbed)
    job = _demo_job(name, images=images, real_node=real_node, testbed=testbed, prefix=s3_prefix,
                    args={"max_steps": 10, "save_steps": 10})
    late_repo, late_tag = f"kubetrain/late-{secrets.token_hex(3)}", "0.1.0"
    job["spec"]["image"] = f"{real_node.registry}/{late_repo}:{late_tag}"
    job["spec"]["runPolicy"] = {**job["spec"].get("runPolicy", {}), "startupGraceSeconds": 600}
    _kubectl(testbed_env, "apply", "-n", ns, "-f", "-", input=json.dumps(job))
    custom = client.CustomObjectsApi(core.api_client)

    def delayed():
        st = custom.get_namespaced_custom_object("kubetrain.io", "v1alpha1", ns, "trainingjobs", name).get("status") or {}
        cond = next((c for c in st.get("conditions", []) if c["type"] == "StartupDelayed"), None)
        return (st, cond) if cond and cond["status"] == "True" else None

    st, cond = wait_for(delayed, timeout=300, interval=2, what="condition StartupDelayed",
                        on_timeout=lambda: _kubectl(testbed_env, "describe", "pods", "-n", ns))
    assert cond["reason"] in ("ErrImagePull", "ImagePullBackOff") and late_repo in cond["message"], cond
    assert st["phase"] == "Pending" and st.get("failures", 0) == 0, st

    _registry_copy(real_node.registry, images["trainer"], late_repo, late_tag)
    st = _wait_finished(core, testbed_env, ns, name, timeout=900)
    assert st["phase"] == "Succeeded", st
    assert (st["attempt"], st.get("failures", 0), st.get("preemptions", 0)) == (1, 0, 0), st
    cond = next(c for c in st["conditions"] if c["type"] == "StartupDelayed")
    assert (cond["status"], cond["reason"]) == ("False", "PodsStarted"), cond
    warnings = [e.reason for e in core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items
                if e.type == "Warning"]
    assert "StartupDelayed" in warnings and "Failed" not in warnings, warnings


HF_FILES = {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
            "training_args.bin", "config.json"}
"""What the transformers Trainer writes into every whole checkpoint-<step> of examples/hf_trainer_script.py."""


def _hf_job(name: str, *, images, real_node, testbed, prefix: str, configmap: str, env: list) -> dict:
    """examples/trainingjob-hf.yaml on the real node: the unmodified HF script from a ConfigMap."""
    job = _example_job("trainingjob-hf.yaml", name, images=images, real_node=real_node, testbed=testbed,
                       prefix=prefix)
    spec = job["spec"]
    spec["podTemplate"]["volumes"][0]["configMap"]["name"] = configmap
    # The same thread count in both runs: the weights are compared bit for bit.
    spec["env"] = [{"name": "OMP_NUM_THREADS", "value": "1"}, *env]
    return job


def _log(core, ns: str, pod: str) -> str:
    from kubernetes import client

    try:
        # The client returns None, not "", for a container that has written nothing yet.
        return core.read_namespaced_pod_log(pod, ns) or ""
    except client.ApiException:
        return ""  # not created or not started yet


def _safetensors(s3, bucket: str, key: str) -> dict:
    from safetensors.torch import load

    return load(s3.get_object(Bucket=bucket, Key=key)["Body"].read())


def test_an_unmodified_hf_trainer_script_survives_preemption_mid_save_and_between_saves(
        real_node, real_operator, images, testbed_env, core, s3, s3_prefix, testbed):
    """The "bring your HF script" acceptance run: the real transformers Trainer as a command job, preempted
    (Eviction API, kubelet SIGTERM) once while checkpoint-10 is half written and once between saves. Each
    attempt resumes from the newest complete checkpoint, no manifest ever lists a partial folder, and the
    final weights equal those of a run that was never interrupted."""
    import torch
    from kubernetes import client

    ns, suffix = real_operator["jobs"], secrets.token_hex(2)
    _s3_secret(core, ns, testbed)
    script = (Path(__file__).resolve().parents[2] / "examples" / "hf_trainer_script.py").read_text()
    configmap = f"hf-script-{suffix}"
    core.create_namespaced_config_map(ns, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=configmap), data={"hf_trainer_script.py": script}))
    ref, name = f"hf-ref-{suffix}", f"hf-chaos-{suffix}"
    hold = [{"name": "KUBETRAIN_TEST_HF_HOLD", "value": "1:save:10,2:step:17"}]
    for job_name, env in ((ref, []), (name, hold)):
        _kubectl(testbed_env, "apply", "-n", ns, "-f", "-", input=json.dumps(_hf_job(
            job_name, images=images, real_node=real_node, testbed=testbed, prefix=s3_prefix, configmap=configmap,
            env=env)))
    prefix = f"{s3_prefix}{ns}/{name}/"

    def evict_when(pod: str, line: str, committed_step: int) -> str:
        describe = lambda: _kubectl(testbed_env, "describe", "pods", "-n", ns)  # noqa: E731
        wait_for(lambda: line in _log(core, ns, pod), timeout=600, interval=2, what=f"{pod}: {line!r}",
                 on_timeout=describe)
        wait_for(lambda: committed_step in _committed_steps(s3, testbed.bucket, prefix), timeout=120, interval=1,
                 what=f"checkpoint-{committed_step} committed", on_timeout=describe)
        logs = _log(core, ns, pod)
        core.create_namespaced_pod_eviction(pod, ns, client.V1Eviction(metadata=client.V1ObjectMeta(
            name=pod, namespace=ns)))
        return logs

    # Attempt 1 holds inside the save of checkpoint-10: model.safetensors is written, the rest is not.
    evict_when(f"{name}-a1-n0", "holding inside the save of checkpoint-10", 5)
    # Attempt 2 resumes from checkpoint-5 (the half-written 10 was never committed), saves 10 and 15 whole,
    # and is preempted at step 17, between saves.
    a2 = evict_when(f"{name}-a2-n0", "holding after step 17", 15)
    assert "restored checkpoint-5 (attempt 1)" in a2, a2[-3000:]

    st = _wait_finished(core, testbed_env, ns, name, timeout=900)
    assert st["phase"] == "Succeeded", st
    assert (st["attempt"], st["preemptions"], st.get("failures", 0)) == (3, 2, 0), st
    a3 = _log(core, ns, f"{name}-a3-n0")
    assert "restored checkpoint-15 (attempt 2)" in a3, a3[-3000:]
    assert "trained to step 30, resumed from" in a3 and "checkpoint-15" in a3, a3[-3000:]

    committed = _committed_steps(s3, testbed.bucket, prefix)
    # 20 and 25 may be missing: the uploader rightly skips a checkpoint the next one superseded before its
    # upload began (the watcher can find checkpoint-20 and 25 at once; a full run saw it once).
    assert {5, 10, 15, 30} <= set(committed) <= {5, 10, 15, 20, 25, 30}, sorted(committed)
    assert {s: m["attempt"] for s, m in committed.items()} == {
        s: a for s, a in {5: 1, 10: 2, 15: 2, 20: 3, 25: 3, 30: 3}.items() if s in committed}
    for step, manifest in committed.items():
        listed = {f["path"] for f in manifest["files"]}
        assert HF_FILES <= listed, f"checkpoint-{step} lists a partial folder: {sorted(listed)}"

    st_ref = _wait_finished(core, testbed_env, ns, ref, timeout=600)
    assert st_ref["phase"] == "Succeeded" and st_ref["attempt"] == 1, st_ref
    ours = _safetensors(s3, testbed.bucket, f"{prefix}final/model.safetensors")
    straight = _safetensors(s3, testbed.bucket, f"{s3_prefix}{ns}/{ref}/final/model.safetensors")
    assert ours.keys() == straight.keys() and ours
    differ = [k for k in ours if not torch.equal(ours[k], straight[k])]
    assert not differ, f"final weights differ from the uninterrupted run in {differ}"
    core.delete_namespaced_config_map(configmap, ns)
