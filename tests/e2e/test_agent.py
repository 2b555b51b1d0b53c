"""The test node agent behaves like a kubelet towards the real API server.

Everything later e2e tests rely on is pinned here against the real testbed:
the node is Ready and keeps its Lease fresh; a pod's env, secrets, config maps
and volumes resolve; exit codes and termination messages arrive in the pod
status; deletion and eviction deliver SIGTERM, honour the grace period and
finalize the pod; processes never outlive their pod or the agent; a pod runs
with its own ServiceAccount's identity, not the agent's.
"""

from __future__ import annotations

import json
import secrets
import signal

import pytest

from .helpers import PodRecorder, pids_with_env, pod_manifest, signal_ready, terminated, wait_for, wait_phase

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Writes a JSON object to the termination log: the test reads it back from the pod status.
REPORT = "import json,os,sys; open(os.environ['KUBETRAIN_TERMINATION_LOG'],'w').write(json.dumps({})); sys.exit({})"


def report(expr: str, code: int = 0) -> list[str]:
    return ["python", "-c", REPORT.format(expr, code)]


def test_node_is_ready_and_renews_its_lease(agent, kube_api, core):
    from kubernetes import client

    node = core.read_node(agent.node_name)
    assert node.metadata.labels["kubetrain.io/agent"] == "true"
    assert "kwok.x-k8s.io/node" not in (node.metadata.annotations or {})
    assert node.status.capacity["cpu"] and node.status.capacity["pods"] == "110"
    leases = client.CoordinationV1Api(kube_api)
    first = leases.read_namespaced_lease(agent.node_name, "kube-node-lease").spec.renew_time
    wait_for(lambda: leases.read_namespaced_lease(agent.node_name, "kube-node-lease").spec.renew_time > first,
             timeout=60, what="the node lease to be renewed")


def test_pod_runs_with_resolved_env_volumes_and_reports_success(agent, core, namespace, kube_api):
    from kubernetes import client

    core.create_namespaced_secret(namespace, client.V1Secret(metadata=client.V1ObjectMeta(name="creds"),
                                                             string_data={"accessKeyId": "AKIA-e2e"}))
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="cfg"), data={"ds_config.json": '{"zero": 3}', "MODE": "fast"}))
    expr = ("dict(secret=os.environ['SECRET'], mode=os.environ['CM_MODE'], pod=os.environ['POD'], ns=os.environ['NS'],"
            " expanded=os.environ['EXPANDED'], master=os.environ['MASTER_ADDR'],"
            " ds=open(os.environ['KUBETRAIN_DEEPSPEED_CONFIG']).read(), ds_path=os.environ['KUBETRAIN_DEEPSPEED_CONFIG'],"
            " cwd=os.getcwd(), exe=sys.executable)")
    env = [
        {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "accessKeyId"}}},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "EXPANDED", "value": "$(POD)-in-$(NS)"},
        {"name": "MASTER_ADDR", "value": "job-n0.job.ns.svc"},
        {"name": "KUBETRAIN_DEEPSPEED_CONFIG", "value": "/etc/kubetrain/deepspeed/ds_config.json"},
    ]
    pod = pod_manifest("envcheck", ["sh", "-c", "sleep 1; exec \"$@\"", "sh", *report(expr)], env=env,
                       envFrom=[{"prefix": "CM_", "configMapRef": {"name": "cfg"}}],
                       volumeMounts=[{"name": "ds", "mountPath": "/etc/kubetrain/deepspeed"}],
                       volumes=[{"name": "ds", "configMap": {"name": "cfg"}}])
    rec = PodRecorder(kube_api, namespace, "envcheck")
    core.create_namespaced_pod(namespace, pod)
    done = wait_phase(core, namespace, "envcheck", ("Succeeded", "Failed"), on_timeout=agent.log_tail)
    rec.stop()
    assert done.status.phase == "Succeeded", done.status
    cs = done.status.container_statuses[0]
    assert cs.state.terminated.exit_code == 0 and cs.state.terminated.reason == "Completed"
    got = json.loads(cs.state.terminated.message)
    assert got["secret"] == "AKIA-e2e" and got["mode"] == "fast"
    assert (got["pod"], got["ns"], got["expanded"]) == ("envcheck", namespace, f"envcheck-in-{namespace}")
    assert got["master"] == "127.0.0.1"
    assert got["ds"] == '{"zero": 3}' and got["ds_path"].startswith(str(agent.state_dir))
    assert got["cwd"].startswith(str(agent.state_dir))
    assert "Running" in rec.phases(), rec.phases()
    running = [s["status"] for s in rec.states if (s.get("status") or {}).get("phase") == "Running"][-1]
    assert running["podIP"] == "127.0.0.1"
    assert {c["type"]: c["status"] for c in running["conditions"]}["Ready"] == "True"
    assert done.status.start_time is not None


def test_failure_reports_exit_code_and_falls_back_to_the_log(agent, core, namespace):
    pod = pod_manifest("fails", ["python", "-c", "import sys; print('boom: bad shape', file=sys.stderr); sys.exit(3)"],
                       terminationMessagePolicy="FallbackToLogsOnError")
    core.create_namespaced_pod(namespace, pod)
    done = wait_phase(core, namespace, "fails", ("Succeeded", "Failed"), on_timeout=agent.log_tail)
    assert done.status.phase == "Failed"
    t = done.status.container_statuses[0].state.terminated
    assert (t.exit_code, t.reason) == (3, "Error")
    assert "boom: bad shape" in t.message
    missing = pod_manifest("nobinary", ["definitely-not-a-command-kt"])
    core.create_namespaced_pod(namespace, missing)
    done = wait_phase(core, namespace, "nobinary", ("Succeeded", "Failed"), on_timeout=agent.log_tail)
    t = done.status.container_statuses[0].state.terminated
    assert (done.status.phase, t.reason) == ("Failed", "StartError")


def test_missing_secret_waits_then_starts_once_it_exists(agent, core, namespace):
    from kubernetes import client

    env = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "late", "key": "t"}}}]
    core.create_namespaced_pod(namespace, pod_manifest("late", report("dict(t=os.environ['TOKEN'])"), env=env))

    def waiting_reason():
        st = core.read_namespaced_pod("late", namespace).status
        return st.container_statuses and st.container_statuses[0].state.waiting and st.container_statuses[0].state.waiting.reason

    assert wait_for(waiting_reason, timeout=120, what="CreateContainerConfigError") == "CreateContainerConfigError"
    core.create_namespaced_secret(namespace, client.V1Secret(metadata=client.V1ObjectMeta(name="late"), string_data={"t": "v"}))
    done = wait_phase(core, namespace, "late", ("Succeeded", "Failed"), on_timeout=agent.log_tail)
    assert json.loads(done.status.container_statuses[0].state.terminated.message) == {"t": "v"}


# Traps SIGTERM like the trainer: records it and exits 83 ("preempted"); a grandchild must die with the pod.
TRAP = """
import os, signal, subprocess, sys, time
child = subprocess.Popen(['sleep', '300'])
def term(*_):
    open(os.environ['KUBETRAIN_TERMINATION_LOG'], 'w').write('got SIGTERM')
    sys.exit(83)
signal.signal(signal.SIGTERM, term)
open(os.path.join(os.environ['HOME'], 'ready'), 'w').close()
while True: time.sleep(0.1)
"""


def _running(core, ns, name, agent):
    return wait_phase(core, ns, name, ("Running",), on_timeout=agent.log_tail)


def _trap_ready(tag: str) -> bool:
    """TRAP's process and its grandchild exist, and its SIGTERM handler is installed (it starts the
    grandchild first: two processes alone do not mean that a SIGTERM would be caught yet)."""
    return len(pids_with_env(tag)) >= 2 and signal_ready(tag, signal.SIGTERM)


def test_delete_sends_sigterm_and_finalizes_within_the_grace(agent, core, namespace, kube_api):
    tag = f"KT_TEST_TAG={secrets.token_hex(6)}"
    env = [{"name": "KT_TEST_TAG", "value": tag.split("=", 1)[1]}]
    core.create_namespaced_pod(namespace, pod_manifest("trapper", ["python", "-c", TRAP], env=env, grace=60))
    _running(core, namespace, "trapper", agent)
    wait_for(lambda: _trap_ready(tag), timeout=120, what="the pod's process with its SIGTERM handler, and its grandchild")
    rec = PodRecorder(kube_api, namespace, "trapper")
    core.delete_namespaced_pod("trapper", namespace)
    took = rec.wait_deleted(timeout=50)
    assert took < 30, f"a pod that exits on SIGTERM must be finalized promptly, took {took:.1f}s"
    t = terminated(rec.last_status())
    assert (t.get("exitCode"), t.get("message")) == (83, "got SIGTERM"), rec.last_status()
    wait_for(lambda: not pids_with_env(tag), timeout=60, what="no process of the deleted pod left")

    # A process that ignores SIGTERM is killed once the grace period is over.
    stubborn = "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    tag = f"KT_TEST_TAG={secrets.token_hex(6)}"
    env = [{"name": "KT_TEST_TAG", "value": tag.split("=", 1)[1]}]
    core.create_namespaced_pod(namespace, pod_manifest("stubborn", ["python", "-c", stubborn], env=env, grace=3))
    _running(core, namespace, "stubborn", agent)
    wait_for(lambda: signal_ready(tag, signal.SIGTERM, ignored=True), timeout=120, what="SIGTERM ignored by the pod")
    rec = PodRecorder(kube_api, namespace, "stubborn")
    core.delete_namespaced_pod("stubborn", namespace)
    took = rec.wait_deleted(timeout=60)
    # Killed only after the grace period (3 s), and not much later (a bound with ample margin for a
    # loaded machine, far below the 300 s the process would otherwise sleep).
    assert 2.5 <= took < 30, took
    assert terminated(rec.last_status()).get("exitCode") == 137, rec.last_status()


def test_eviction_marks_disruption_and_delivers_sigterm(agent, core, namespace, kube_api):
    from kubernetes import client

    tag = f"KT_TEST_TAG={secrets.token_hex(6)}"
    env = [{"name": "KT_TEST_TAG", "value": tag.split("=", 1)[1]}]
    core.create_namespaced_pod(namespace, pod_manifest("victim", ["python", "-c", TRAP], env=env, grace=30))
    _running(core, namespace, "victim", agent)
    wait_for(lambda: _trap_ready(tag), timeout=120, what="the pod's SIGTERM handler installed")
    rec = PodRecorder(kube_api, namespace, "victim")
    core.create_namespaced_pod_eviction("victim", namespace, client.V1Eviction(
        metadata=client.V1ObjectMeta(name="victim", namespace=namespace)))
    rec.wait_deleted(timeout=120)
    last = rec.last_status()
    conds = {c["type"]: c for c in last.get("conditions") or []}
    assert conds.get("DisruptionTarget", {}).get("status") == "True", last
    assert terminated(last).get("exitCode") == 83 and last["phase"] == "Failed", last


WHOAMI = """
import json, os
from kubernetes import client, config
api = config.new_client_from_config(config_file=os.environ['KUBECONFIG'])
me = client.AuthenticationV1Api(api).create_self_subject_review(client.V1SelfSubjectReview())
try:
    client.CoreV1Api(api).list_namespaced_secret(os.environ['NS']); listed = 'allowed'
except client.ApiException as e:
    listed = e.status
open(os.environ['KUBETRAIN_TERMINATION_LOG'], 'w').write(json.dumps({'user': me.status.user_info.username, 'secrets': listed}))
"""


def test_pod_gets_its_service_account_identity(agent, core, namespace):
    env = [{"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    core.create_namespaced_pod(namespace, pod_manifest("whoami", ["python", "-c", WHOAMI], env=env))
    done = wait_phase(core, namespace, "whoami", ("Succeeded", "Failed"), timeout=180, on_timeout=agent.log_tail)
    t = done.status.container_statuses[0].state.terminated
    assert done.status.phase == "Succeeded", t
    got = json.loads(t.message)
    assert got == {"user": f"system:serviceaccount:{namespace}:default", "secrets": 403}


def test_restart_policy_always_restarts_with_backoff(agent, core, namespace):
    core.create_namespaced_pod(namespace, pod_manifest("crashy", ["python", "-c", "import sys; sys.exit(1)"],
                                                       restart_policy="Always"))

    def restarted_twice():
        st = core.read_namespaced_pod("crashy", namespace).status
        return st.container_statuses and st.container_statuses[0].restart_count >= 2 and st

    st = wait_for(restarted_twice, timeout=120, what="two restarts", on_timeout=agent.log_tail)
    assert st.phase == "Running"
    assert st.container_statuses[0].last_state.terminated.exit_code == 1


def test_agent_crash_restart_and_graceful_shutdown(agent_factory, core, namespace, tmp_path):
    """SIGKILLed agent: its processes survive; the next agent kills them and fails the pod. SIGTERM: nothing survives."""
    node = f"kubetrain-e2e-crash-{secrets.token_hex(2)}"
    first = agent_factory(node, state_dir=tmp_path)
    tag = f"KT_TEST_TAG={secrets.token_hex(6)}"
    pod = pod_manifest("sleeper", ["python", "-c", TRAP], env=[{"name": "KT_TEST_TAG", "value": tag.split("=", 1)[1]}])
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    core.create_namespaced_pod(namespace, pod)
    _running(core, namespace, "sleeper", first)
    wait_for(lambda: len(pids_with_env(tag)) >= 2, timeout=120, what="pod processes")
    first.crash()
    assert pids_with_env(tag), "without an agent the container keeps running (as with a dead kubelet)"

    second = agent_factory(node, state_dir=tmp_path)
    wait_for(lambda: not pids_with_env(tag), timeout=60, what="orphans swept by the new agent", on_timeout=second.log_tail)
    done = wait_phase(core, namespace, "sleeper", ("Failed",), on_timeout=second.log_tail)
    assert done.status.container_statuses[0].state.terminated.reason == "ContainerStatusUnknown"

    pod["metadata"]["name"] = "sleeper2"
    core.create_namespaced_pod(namespace, pod)
    _running(core, namespace, "sleeper2", second)
    # The SIGTERM of the shutdown must find TRAP's handler installed: it reports exit code 83 below.
    wait_for(lambda: _trap_ready(tag), timeout=120, what="pod processes with the SIGTERM handler installed")
    assert second.stop() == 0
    assert not pids_with_env(tag), "graceful agent shutdown left processes behind"
    st = core.read_namespaced_pod("sleeper2", namespace).status
    conds = {c.type: c for c in st.conditions}
    assert st.phase == "Failed" and conds["DisruptionTarget"].reason == "TerminationByKubelet"
    assert st.container_statuses[0].state.terminated.exit_code == 83
