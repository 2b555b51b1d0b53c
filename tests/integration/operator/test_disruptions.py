"""Preemption, eviction, node loss and the trainer's "preempted" exit code on the real testbed:
each restarts the whole gang as a new attempt, counts a preemption, never spends backoffLimit,
and attempts never overlap.

Tests that take nodes away use their own fake nodes (a unique label), never the shared ones.
"""

from __future__ import annotations

import datetime
import json
import secrets
import time

import pytest
from kubernetes import client

from kubetrain_optest import spec
from kubetrain_testbed import fake_node, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def own_nodes(kube_api, kubectl):
    """Create fake nodes in a private pool; returns (create(n, cpu) -> names, pool label)."""
    pool = f"pool-{secrets.token_hex(3)}"
    names: list[str] = []
    core = client.CoreV1Api(kube_api)

    def create(count: int, cpu: str = "2") -> list[str]:
        new = [f"{pool}-{len(names) + i}" for i in range(count)]
        for name in new:
            kubectl("apply", "-f", "-", input=json.dumps(
                fake_node(name=name, cpu=cpu, memory="8Gi", gpus="0", labels={"pool": pool})))
        names.extend(new)
        wait_until(lambda: [core.read_node(n) for n in new],
                   lambda ns: all(any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or ())
                                  for n in ns), timeout=120, what=f"nodes {new} Ready")
        return new

    yield create, pool
    for name in names:
        try:
            core.delete_node(name)
        except client.ApiException:
            pass


def assert_preempted_once(jobs, name: str, timeline, *, attempt: int = 2) -> dict:
    # Generous: a NotReady node takes node-monitor-grace-period (20 s) plus the job's grace to notice.
    status = jobs.wait(name, lambda s: s.get("attempt") == attempt and s.get("phase") in ("Pending", "Running"),
                       timeout=240, what=f"{name} attempt {attempt}")
    assert status["preemptions"] == 1 and status["failures"] == 0 and status["restarts"] == 1
    wait_until(lambda: jobs.event_reasons(name), lambda r: "Preempted" in r and "Restarting" in r,
               timeout=60, what="Preempted and Restarting events")
    timeline.check_no_overlap()
    return status


def test_scheduler_preemption_restarts_the_whole_gang(operator, jobs, own_nodes, kube_api, pod_timeline) -> None:
    create_nodes, pool = own_nodes
    create_nodes(1, cpu="2")
    sched = client.SchedulingV1Api(kube_api)
    low, high = f"low-{pool}", f"high-{pool}"
    sched.create_priority_class({"metadata": {"name": low}, "value": 10})
    sched.create_priority_class({"metadata": {"name": high}, "value": 1000})
    try:
        jobs.create("pre", spec(nodes=2, resources={"requests": {"cpu": "1"}},
                                podTemplate={"priorityClassName": low, "nodeSelector": {"pool": pool}}))
        jobs.wait_phase("pre", "Running")
        # A higher-priority pod that only fits if one of ours goes: the real scheduler preempts one.
        jobs.core.create_namespaced_pod(jobs.namespace, {
            "metadata": {"name": "vip"},
            "spec": {"priorityClassName": high, "nodeSelector": {"pool": pool},
                     "containers": [{"name": "c", "image": "x", "resources": {"requests": {"cpu": "1"}}}]}})
        assert_preempted_once(jobs, "pre", pod_timeline)
        wait_until(lambda: jobs.event_messages("pre", "Preempted"), lambda ms: any("PreemptionByScheduler" in m for m in ms),
                   timeout=30, what="the Preempted event of pre")  # posted after the status write
        jobs.core.delete_namespaced_pod("vip", jobs.namespace)
        jobs.wait_phase("pre", "Running", attempt=2, timeout=120)
        pod_timeline.wait_attempts([1, 2])
    finally:
        for pc in (low, high):
            sched.delete_priority_class(pc)


def test_eviction_api_restarts_the_whole_gang(operator, jobs, pod_timeline) -> None:
    jobs.create("evict", spec(nodes=3))
    jobs.wait_phase("evict", "Running")
    jobs.core.create_namespaced_pod_eviction("evict-a1-n1", jobs.namespace, {
        "metadata": {"name": "evict-a1-n1", "namespace": jobs.namespace}})
    assert_preempted_once(jobs, "evict", pod_timeline)
    wait_until(lambda: jobs.event_messages("evict", "Preempted"), lambda ms: any("EvictionByEvictionAPI" in m for m in ms),
                   timeout=30, what="the Preempted event of evict")  # posted after the status write
    jobs.wait_phase("evict", "Running", attempt=2, timeout=120)
    assert len(jobs.pods("evict", attempt=2)) == 3 and not jobs.pods("evict", attempt=1)


def test_preempted_exit_code_does_not_spend_backoff_limit(operator, jobs, pod_timeline) -> None:
    jobs.create("sigterm", spec(nodes=2, runPolicy={"backoffLimit": 0},
                                checkpoint={"uri": "s3://bkt", "credentialsSecret": {"name": "s3"}}))
    jobs.wait_phase("sigterm", "Running")
    jobs.finish_pod("sigterm-a1-n0", 83, message=json.dumps({
        "kind": "kubetrain.io/last-checkpoint", "step": 7, "uri": f"s3://bkt/{jobs.namespace}/sigterm/checkpoint-7"}))
    jobs.finish_pod("sigterm-a1-n1", 1)   # the peer dies of the lost rendezvous: not the user's fault
    status = assert_preempted_once(jobs, "sigterm", pod_timeline)
    assert status["lastCheckpoint"]["step"] == 7


def test_deleted_node_restarts_the_gang_elsewhere(operator, jobs, own_nodes, pod_timeline) -> None:
    create_nodes, pool = own_nodes
    first, second = create_nodes(2, cpu="2")
    jobs.create("lost", spec(nodes=1, resources={"requests": {"cpu": "1500m"}},
                             runPolicy={"nodeLostGraceSeconds": 1},
                             podTemplate={"nodeSelector": {"pool": pool}}))
    jobs.wait_phase("lost", "Running")
    node = jobs.pods("lost")[0].spec.node_name
    jobs.core.delete_node(node)
    assert_preempted_once(jobs, "lost", pod_timeline)
    jobs.wait_phase("lost", "Running", attempt=2, timeout=120)
    assert jobs.pods("lost", attempt=2)[0].spec.node_name == ({first, second} - {node}).pop()


@pytest.mark.slow
def test_not_ready_node_restarts_the_gang(operator, jobs, own_nodes, kube_api, pod_timeline) -> None:
    """A node whose kubelet stops reporting: the real node lifecycle controller marks it
    NotReady (its Lease is never renewed) and the gang restarts on another node.

    The node is not managed by kwok: this test plays its kubelet (Ready, pods Running)
    and then simply stops, exactly what a dead kubelet does."""
    create_nodes, pool = own_nodes
    core = client.CoreV1Api(kube_api)
    dead = f"{pool}-dead"
    node = fake_node(name=dead, cpu="2", memory="8Gi", gpus="0", labels={"pool": pool})
    del node["metadata"]["annotations"]["kwok.x-k8s.io/node"]
    core.create_node(node)
    try:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        last_beat = [0.0]

        def heartbeat() -> None:
            """Post the node's status as its kubelet would (every 2 s at most): until the test stops
            calling this, the node stays Ready however long the steps below take on a loaded machine
            (a single post would give them only node-monitor-grace-period, 20 s)."""
            if time.monotonic() - last_beat[0] < 2:
                return
            beat = datetime.datetime.now(datetime.timezone.utc).isoformat()
            core.patch_node_status(dead, {"status": {"conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "played by the test",
                 "lastHeartbeatTime": beat, "lastTransitionTime": now}]}})
            last_beat[0] = time.monotonic()

        def beating(observe):
            def observe_and_beat():
                heartbeat()
                return observe()
            return observe_and_beat

        heartbeat()
        jobs.create("dark", spec(nodes=1, resources={"requests": {"cpu": "1500m"}},
                                 runPolicy={"nodeLostGraceSeconds": 2},
                                 podTemplate={"nodeSelector": {"pool": pool}}))
        pod = wait_until(beating(lambda: jobs.pods("dark")), lambda p: p and p[0].spec.node_name == dead,
                         timeout=120, what="pod bound to the node the test plays")[0]
        heartbeat()
        core.patch_namespaced_pod_status(pod.metadata.name, jobs.namespace, {"status": {
            "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "trainer", "image": "x", "imageID": "", "ready": True,
                                   "restartCount": 0, "state": {"running": {"startedAt": now}}}]}})
        wait_until(beating(lambda: jobs.status("dark")), lambda s: s.get("phase") == "Running", timeout=120,
                   interval=0.3, what="dark phase Running")
        create_nodes(1, cpu="2")  # somewhere for attempt 2 to go
        # The test (the "kubelet") stops here: after node-monitor-grace-period the node is NotReady.
        assert_preempted_once(jobs, "dark", pod_timeline)
        wait_until(lambda: jobs.event_messages("dark", "Preempted"), lambda ms: any(f"node {dead} is NotReady" in m for m in ms),
                   timeout=30, what="the Preempted event of dark")  # posted after the status write
        jobs.wait_phase("dark", "Running", attempt=2, timeout=120)
        assert jobs.pods("dark", attempt=2)[0].spec.node_name != dead
        assert not jobs.pods("dark", attempt=1), "the pod on the dead node was force-deleted"
    finally:
        core.delete_node(dead)


def test_max_preemptions_fails_the_job(operator, jobs) -> None:
    jobs.create("fragile", spec(nodes=1, runPolicy={"maxPreemptions": 0}))
    jobs.wait_phase("fragile", "Running")
    jobs.finish_pod("fragile-a1-n0", 83)
    status = jobs.wait_phase("fragile", "Failed", timeout=120)
    assert status["preemptions"] == 1
    assert {c["type"]: c for c in status["conditions"]}["Failed"]["reason"] == "MaxPreemptionsExceeded"
