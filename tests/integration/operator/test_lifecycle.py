"""A TrainingJob's life on the real testbed: success, failures, suspend, deadline, TTL, deletion,
and an operator killed in the middle of creating a gang."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from kubetrain_optest import kwok_exit, spec
from kubetrain_testbed import wait_until

pytestmark = pytest.mark.integration


def test_gang_runs_to_success(operator, jobs, kubectl, pod_timeline) -> None:
    jobs.create("ok", spec(nodes=3, checkpoint={"uri": "s3://bkt/p", "credentialsSecret": {"name": "s3"}}))
    pods = jobs.wait_pods("ok", 3, attempt=1, running=True)
    assert sorted(p.metadata.name for p in pods) == ["ok-a1-n0", "ok-a1-n1", "ok-a1-n2"]
    assert all(p.spec.node_name for p in pods), "scheduled onto kwok nodes"
    pod0 = next(p for p in pods if p.metadata.name == "ok-a1-n0")
    env = {e.name: e.value for e in pod0.spec.containers[0].env}
    assert env["MASTER_ADDR"] == f"ok-n0.ok.{jobs.namespace}.svc" and env["NNODES"] == "3"
    assert pod0.metadata.owner_references[0].kind == "TrainingJob"
    # The operator creates the headless service after the pods: kwok may run the pods first.
    svc = wait_until(lambda: jobs.core.read_namespaced_service("ok", jobs.namespace), timeout=120,
                     what="headless service ok")
    assert svc.spec.cluster_ip == "None"

    status = jobs.wait_phase("ok", "Running", nodesReady=3)
    assert status["attempt"] == 1 and status["nodesTotal"] == 3 and status["restarts"] == 0

    ckpt = json.dumps({"kind": "kubetrain.io/last-checkpoint", "step": 40,
                       "uri": f"s3://bkt/p/{jobs.namespace}/ok/checkpoint-40", "time": "2026-01-01T00:00:00Z"})
    jobs.finish_pod("ok-a1-n1", 0)
    jobs.finish_pod("ok-a1-n2", 0)
    jobs.finish_pod("ok-a1-n0", 0, message=ckpt)
    status = jobs.wait_phase("ok", "Succeeded")
    assert status["lastCheckpoint"]["step"] == 40
    assert status["completionTime"] and status["failures"] == 0 and status["preemptions"] == 0
    assert {c["type"]: c["status"] for c in status["conditions"]}["Succeeded"] == "True"
    reasons = wait_until(lambda: jobs.event_reasons("ok"), lambda r: {"Created", "Running", "Succeeded"} <= set(r),
                         timeout=60, what="events Created, Running, Succeeded")
    assert sorted(reasons) == ["Created", "Running", "Succeeded"], "one event per transition"
    table = kubectl("get", "tj", "ok", "-n", jobs.namespace)
    header, row = table.splitlines()[:2]
    assert header.split()[:7] == ["NAME", "PHASE", "READY", "NODES", "ATTEMPT", "RESTARTS", "PREEMPTIONS"]
    assert row.split()[:2] == ["ok", "Succeeded"] and "40" in row.split()
    pod_timeline.wait_attempts([1])


def test_application_failure_backs_off_then_fails(operator, jobs, pod_timeline) -> None:
    jobs.create("crash", spec(nodes=2, runPolicy={"backoffLimit": 2, "backoffSeconds": 1},
                              podTemplate={"annotations": kwok_exit(3, "1s", "Traceback: ValueError boom")}))
    status = jobs.wait_phase("crash", "Failed", timeout=240)
    assert status["failures"] == 3 and status["preemptions"] == 0 and status["restarts"] == 2
    assert status["attempt"] == 3
    assert "exited with code 3" in status["message"] and "kubectl logs" in status["message"]
    assert "boom" not in status["message"], "a pod's output is never copied into status"
    failed = {c["type"]: c for c in status["conditions"]}["Failed"]
    assert failed["reason"] == "BackoffLimitExceeded"
    # Events are posted in the background, each reconcile's on their own: wait for all of them, then count.
    reasons = wait_until(lambda: jobs.event_reasons("crash"),
                         lambda r: "Failed" in r and r.count("BackoffRestart") >= 2 and r.count("Created") >= 3,
                         timeout=60, what="Failed, 2 BackoffRestart and 3 Created events")
    assert reasons.count("BackoffRestart") == 2 and reasons.count("Failed") == 1 and reasons.count("Created") == 3
    pod_timeline.wait_attempts([1, 2, 3])
    pod_timeline.check_no_overlap()


def test_invalid_configuration_exit_code_fails_at_once(operator, jobs) -> None:
    jobs.create("badargs", spec(nodes=2, podTemplate={"annotations": kwok_exit(82, "1s")}))
    status = jobs.wait_phase("badargs", "Failed", timeout=120)
    assert status["attempt"] == 1 and status["failures"] == 0 and status["restarts"] == 0
    assert "code 82" in status["message"]
    assert {c["type"]: c for c in status["conditions"]}["Failed"]["reason"] == "InvalidConfiguration"


def test_suspend_and_resume(operator, jobs, pod_timeline) -> None:
    jobs.create("sus", spec(nodes=2))
    jobs.wait_phase("sus", "Running")
    jobs.patch_spec("sus", {"runPolicy": {"suspend": True}})
    jobs.wait_phase("sus", "Suspended")
    wait_until(lambda: jobs.pods("sus"), lambda p: not p, timeout=120, what="pods of a suspended job gone")
    assert jobs.get("sus")["metadata"]["name"] == "sus", "the job is kept"
    jobs.patch_spec("sus", {"runPolicy": {"suspend": False}})
    status = jobs.wait_phase("sus", "Running", attempt=2)
    assert status["restarts"] == 1 and status["failures"] == 0 and status["preemptions"] == 0
    wait_until(lambda: jobs.event_reasons("sus"), lambda r: {"Suspended", "Resumed"} <= set(r), timeout=60,
               what="Suspended and Resumed events")
    pod_timeline.check_no_overlap()


def test_active_deadline_fails_the_job(operator, jobs) -> None:
    jobs.create("late", spec(nodes=1, runPolicy={"activeDeadlineSeconds": 3}))
    status = jobs.wait_phase("late", "Failed", timeout=120)
    assert {c["type"]: c for c in status["conditions"]}["Failed"]["reason"] == "DeadlineExceeded"
    # One Warning, Failed, as every failure's (the reason is condition Failed's): no DeadlineExceeded event besides.
    wait_until(lambda: jobs.event_messages("late", "Failed"),
               lambda ms: any("activeDeadlineSeconds=3 exceeded" in m for m in ms), timeout=60,
               what="the Failed event naming the deadline")
    assert "DeadlineExceeded" not in jobs.event_reasons("late")
    wait_until(lambda: jobs.pods("late"), lambda p: not p, timeout=120, what="running pods deleted")


def test_ttl_after_finished_deletes_the_job_and_what_it_owns(operator, jobs) -> None:
    created = jobs.create("short", spec(nodes=2, runPolicy={"ttlSecondsAfterFinished": 2},
                                        podTemplate={"annotations": kwok_exit(0, "1s")}))
    # Succeeded lasts only 2 s before the TTL deletes the job: polling could miss it on a loaded
    # machine, a watch from the creation's resourceVersion cannot.
    history = jobs.history_until_deleted("short", created["metadata"]["resourceVersion"], timeout=180)
    kinds = [kind for kind, _ in history]
    phases = [st.get("phase") for _, st in history]
    assert kinds and kinds[-1] == "DELETED", f"job not deleted by its TTL: {history}"
    assert "Succeeded" in phases, f"the job was deleted without having succeeded: {phases}"

    def gone() -> bool:
        try:
            jobs.get("short")
            return False
        except client.ApiException as exc:
            return exc.status == 404

    wait_until(gone, timeout=60, what="job deleted by its TTL")
    wait_until(lambda: jobs.pods("short"), lambda p: not p, timeout=120, what="pods garbage-collected")


def test_deleting_a_job_removes_everything_it_owns(operator, jobs) -> None:
    jobs.create("bye", spec(nodes=2))
    jobs.wait_phase("bye", "Running")
    jobs.delete("bye")
    wait_until(lambda: jobs.pods("bye"), lambda p: not p, timeout=120, what="pods garbage-collected")

    def service_gone() -> bool:
        try:
            jobs.core.read_namespaced_service("bye", jobs.namespace)
            return False
        except client.ApiException as exc:
            return exc.status == 404

    wait_until(service_gone, timeout=120, what="service garbage-collected")


@pytest.mark.slow
def test_operator_killed_mid_gang_creation_makes_no_duplicates(operator, jobs, pod_timeline) -> None:
    nodes, admitted = 24, 6
    # One API thread: the gang's pods are created one after another.
    operator.stop()
    operator.env["KUBETRAIN_API_THREADS"] = "1"
    operator.start()
    # Let the operator finish starting (it lists CRDs, pods and nodes first).
    jobs.create("warmup", spec(nodes=1))
    jobs.wait_phase("warmup", "Running", timeout=120)
    # A pod quota stops the gang part-way however fast or slow this machine is: the API server admits
    # `admitted` of its pods and refuses the others (403, which the operator retries). So the SIGKILL
    # surely lands with the gang half-created and the new attempt not yet recorded in the status,
    # instead of racing a poll against the operator's pod creation.
    limit = str(len(jobs.core.list_namespaced_pod(jobs.namespace).items) + admitted)
    jobs.core.create_namespaced_resource_quota(jobs.namespace, {
        "metadata": {"name": "stop-the-gang"}, "spec": {"hard": {"pods": limit}}})
    wait_until(lambda: jobs.core.read_namespaced_resource_quota("stop-the-gang", jobs.namespace).status,
               lambda st: st is not None and (st.hard or {}).get("pods") == limit and "pods" in (st.used or {}),
               timeout=120, what="the pod quota computed by the quota controller")
    jobs.create("big", spec(nodes=nodes))
    wait_until(lambda: jobs.pods("big"), lambda p: len(p) >= admitted, timeout=120,
               what=f"the {admitted} pods of the gang the quota admits")
    operator.kill()
    created_before = len(jobs.pods("big"))
    assert created_before < nodes, "the operator was not killed in the middle of creating the gang"
    jobs.core.delete_namespaced_resource_quota("stop-the-gang", jobs.namespace)
    operator.start()
    status = jobs.wait_phase("big", "Running", timeout=240)
    pods = jobs.pods("big")
    assert len(pods) == nodes and {p.metadata.labels["kubetrain.io/attempt"] for p in pods} == {"1"}
    assert sorted(int(p.metadata.labels["kubetrain.io/node-rank"]) for p in pods) == list(range(nodes))
    assert status["attempt"] == 1 and status["restarts"] == 0 and status["preemptions"] == 0
    added = pod_timeline.wait_added(nodes, "big-")
    assert len(added) == len(set(added)) == nodes, "each pod created exactly once, none deleted"
    print(f"pods created before SIGKILL: {created_before}/{nodes}")
