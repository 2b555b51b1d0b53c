"""The operator queues TrainingJobs through Kueue (issue 14, acceptance): the real API server, scheduler,
kwok nodes and Kueue v0.19.2, with the per-test ClusterQueue of conftest.py (cpu 3, pods 3, preemption
within the queue: LowerPriority). The operator runs as in tests/integration/operator (a subprocess with
the testbed's kubeconfig, watching only the test's namespace)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kubetrain import kueue as kq
from kubetrain_testbed import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from kubetrain_optest import Jobs, spec

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.integration
TIMEOUT = 120.0


@pytest.fixture
def operator(trainingjob_crd, kueue, testbed_env, namespace, tmp_path):
    env = {**testbed_env, "KUBETRAIN_NAMESPACES": namespace, "KUBETRAIN_LOG_LEVEL": "INFO",
           "PYTHONPATH": str(ROOT / "operator") + os.pathsep + testbed_env.get("PYTHONPATH", "")}
    log_path = tmp_path / "operator.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kubetrain", "operator", "run"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT)
    yield proc
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
    # Shown by pytest only when the test fails.
    print("\n--- operator log tail ---\n" + "\n".join(log_path.read_text(errors="replace").splitlines()[-80:]))


@pytest.fixture
def jobs(kube_api, namespace) -> Jobs:
    return Jobs(kube_api, namespace)


def create(jobs: Jobs, name: str, queue: str, nodes: int, **extra: Any) -> dict[str, Any]:
    body = {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": name, "namespace": jobs.namespace, "labels": {kq.LABEL_QUEUE_NAME: queue}},
            "spec": spec(nodes=nodes, **extra)}
    return jobs.custom.create_namespaced_custom_object("kubetrain.io", "v1alpha1", jobs.namespace, "trainingjobs",
                                                       body)


def queued_reason(status: dict[str, Any]) -> str | None:
    cond = next((c for c in status.get("conditions") or () if c["type"] == "Queued"), None)
    return cond["reason"] if cond and cond["status"] == "True" else None


def wait_queued(jobs: Jobs, name: str, reason: str | None = None, timeout: float = TIMEOUT) -> dict[str, Any]:
    return jobs.wait(name, lambda s: s.get("phase") == "Queued" and queued_reason(s) is not None
                     and (reason is None or queued_reason(s) == reason), timeout=timeout,
                     what=f"{name} Queued ({reason or 'any reason'})")


class WatchLog:
    """A background watch on one kind of custom object in the test's namespace: `record` sees every object in
    the order the API server sent it, so a state that lasts a few milliseconds (Kueue answers at once on a
    fast machine) is not missed between two polls. `first_event_within`: wait until the watch streams."""

    def __init__(self, jobs: Jobs, group: str, version: str, plural: str, *, first_event_within: float = 0.0,
                 **list_kwargs: Any) -> None:
        import threading

        from kubernetes import watch

        self._stopped = False
        self._watch = watch.Watch()
        self._streaming = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(jobs, (group, version, jobs.namespace, plural),
                                                                list_kwargs), daemon=True)
        self._thread.start()
        if first_event_within and not self._streaming.wait(first_event_within):
            raise AssertionError(f"no watch event on {plural} {list_kwargs} within {first_event_within:.0f} s")

    def _run(self, jobs: Jobs, where: tuple, list_kwargs: dict[str, Any]) -> None:
        try:
            for event in self._watch.stream(jobs.custom.list_namespaced_custom_object, *where, timeout_seconds=600,
                                            **list_kwargs):
                self._streaming.set()
                self.record(event["object"])
        except Exception:  # the stream ends when the test stops it or the testbed goes
            if not self._stopped:
                raise

    def record(self, obj: dict[str, Any]) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stopped = True
        self._watch.stop()


class QueuedLog(WatchLog):
    """Every (Queued reason, attempt, preemptions, failures) one existing job's status passed through, in
    order. Built once the watch streams (the job must exist)."""

    def __init__(self, jobs: Jobs, name: str) -> None:
        self.seen: list[dict[str, Any]] = []
        super().__init__(jobs, "kubetrain.io", "v1alpha1", "trainingjobs", first_event_within=30,
                         field_selector=f"metadata.name={name}")

    def record(self, obj: dict[str, Any]) -> None:
        status = obj.get("status") or {}
        reason = queued_reason(status) if status.get("phase") == "Queued" else None
        if reason is not None and (not self.seen or self.seen[-1]["reason"] != reason):
            self.seen.append({"reason": reason, "attempt": status.get("attempt", 0),
                              "preemptions": status.get("preemptions", 0), "failures": status.get("failures", 0)})

    def wait_reason(self, reason: str, timeout: float = TIMEOUT) -> dict[str, Any]:
        """The first record with `reason`."""
        return wait_until(lambda: [r for r in self.seen if r["reason"] == reason], bool, timeout=timeout,
                          what=f"Queued ({reason}) in the job's status")[0]


@pytest.fixture
def queued_log(jobs):
    logs: list[QueuedLog] = []
    yield lambda name: logs.append(QueuedLog(jobs, name)) or logs[-1]
    for log in logs:
        log.stop()


def live_pods(jobs: Jobs, name: str) -> list[Any]:
    return [p for p in jobs.pods(name) if p.metadata.deletion_timestamp is None]


def finish(jobs: Jobs, name: str, attempt: int, nodes: int) -> None:
    for rank in range(nodes):
        jobs.finish_pod(f"{name}-a{attempt}-n{rank}", 0)


def test_a_gang_over_the_quota_stays_queued_with_kueues_reason_and_no_pod(operator, jobs, kueue_queue, kubectl):
    create(jobs, "big", kueue_queue.local_queue, nodes=4)
    status = wait_queued(jobs, "big", "ExceedsMaxQuota")
    assert "insufficient quota" in status["message"], status["message"]
    assert status.get("attempt", 0) == 0
    header, row = kubectl("get", "tj", "big", "-n", jobs.namespace).splitlines()[:2]
    assert "KUEUE" in header.split() and "ExceedsMaxQuota" in row.split() and "Queued" in row.split()
    time.sleep(5)  # and it stays so
    assert jobs.status("big")["phase"] == "Queued" and jobs.pods("big") == []


def test_a_second_gang_waits_with_no_pod_then_runs_when_the_first_finishes(operator, jobs, kueue_queue):
    create(jobs, "first", kueue_queue.local_queue, nodes=2)
    jobs.wait_phase("first", "Running", nodesReady=2)
    create(jobs, "second", kueue_queue.local_queue, nodes=2)
    status = wait_queued(jobs, "second")
    assert queued_reason(status) in ("WaitingForQuota", "Pending", kq.PENDING), status
    assert jobs.pods("second") == []
    finish(jobs, "first", 1, 2)
    jobs.wait_phase("first", "Succeeded")
    jobs.wait_phase("second", "Running", nodesReady=2)
    assert len(live_pods(jobs, "second")) == 2


def test_a_missing_local_queue_keeps_the_job_queued_with_a_reason(operator, jobs, kueue_queue):
    create(jobs, "lost", "no-such-queue", nodes=1)
    status = wait_queued(jobs, "lost", timeout=60)
    status = jobs.wait("lost", lambda s: "no-such-queue" in s.get("message", ""), timeout=60,
                       what="the message names the missing LocalQueue")
    assert jobs.pods("lost") == [] and status["phase"] == "Queued"


def test_an_invalid_queue_label_is_refused_naming_the_label(operator, jobs, kueue_queue):
    create(jobs, "bad", "Bad_Queue", nodes=1)
    status = jobs.wait_phase("bad", "Failed")
    assert kq.LABEL_QUEUE_NAME in status["message"], status["message"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidQueueName"
    assert jobs.pods("bad") == []


def test_suspend_frees_the_quota_and_resume_requeues_without_backoff(operator, jobs, kueue_queue):
    create(jobs, "one", kueue_queue.local_queue, nodes=2)
    jobs.wait_phase("one", "Running", nodesReady=2)
    create(jobs, "two", kueue_queue.local_queue, nodes=2)
    wait_queued(jobs, "two")
    jobs.patch_spec("one", {"runPolicy": {"suspend": True}})
    jobs.wait_phase("one", "Suspended")
    jobs.wait_phase("two", "Running", nodesReady=2)
    assert live_pods(jobs, "one") == []
    jobs.patch_spec("one", {"runPolicy": {"suspend": False}})
    status = wait_queued(jobs, "one")
    assert status["failures"] == 0 and live_pods(jobs, "one") == []
    finish(jobs, "two", 1, 2)
    status = jobs.wait_phase("one", "Running", nodesReady=2, timeout=180)
    assert status["attempt"] == 2 and status["failures"] == 0


def test_a_low_priority_gang_is_preempted_counted_as_a_preemption_and_readmitted(operator, jobs, kueue_queue,
                                                                                  priority_classes, queued_log):
    create(jobs, "low", kueue_queue.local_queue, nodes=3, runPolicy={"backoffLimit": 0},
           podTemplate={"priorityClassName": "low"})
    jobs.wait_phase("low", "Running", nodesReady=3)
    log = queued_log("low")
    create(jobs, "high", kueue_queue.local_queue, nodes=3, podTemplate={"priorityClassName": "high"})
    # Queued/Preempted lasts until Kueue's next word on the Workload (Pending, WaitingForQuota): milliseconds
    # on a fast machine, so it is read from the watch, not polled.
    record = log.wait_reason("Preempted")
    assert record["preemptions"] == 1 and record["failures"] == 0, log.seen
    status = wait_queued(jobs, "low")
    assert status["preemptions"] == 1 and status["failures"] == 0
    jobs.wait_phase("high", "Running", nodesReady=3, timeout=180)
    assert live_pods(jobs, "low") == []
    wait_until(lambda: jobs.event_messages("low", "Preempted"), timeout=30, what="a Preempted event on the low job")
    finish(jobs, "high", 1, 3)
    status = jobs.wait_phase("low", "Running", nodesReady=3, timeout=180)
    assert status["attempt"] == 2 and status["preemptions"] == 1 and status["failures"] == 0


def test_a_gang_that_never_gets_ready_is_evicted_by_the_pods_ready_timeout_and_requeued(operator, jobs, kueue_queue,
                                                                                        queued_log):
    """waitForPodsReady (30 s on the testbed): the operator's PodsReady stays False/WaitForStart while a pod is
    unschedulable, Kueue evicts the gang (PodsReadyTimeout), the operator deletes its pods, counts a preemption
    (no failure) and the evicted attempt holds no pod while the job waits in its queue."""
    create(jobs, "stuck", kueue_queue.local_queue, nodes=2,
           podTemplate={"nodeSelector": {"kubetrain.io/no-such-node": "anywhere"}})
    jobs.wait_phase("stuck", "Pending")
    assert len(jobs.pods("stuck")) == 2
    log = queued_log("stuck")  # the eviction comes after the 30 s PodsReady timeout
    # Kueue requeues the evicted gang and, with its short requeue backoff, may readmit it within
    # milliseconds (a fast machine saw three evictions in two minutes): the reason is read from the watch.
    record = log.wait_reason("PodsReadyTimeout", timeout=150)
    assert record["failures"] == 0 and record["preemptions"] >= 1, log.seen
    evicted = record["attempt"]
    wait_until(lambda: [p.metadata.name for p in jobs.pods("stuck")
                        if p.metadata.name.startswith(f"stuck-a{evicted}-")], lambda left: not left,
               timeout=TIMEOUT, what=f"attempt {evicted}'s pods deleted after the eviction")
    assert jobs.get("stuck")["status"]["failures"] == 0


@pytest.fixture
def admission_policy(kubectl, namespace):
    """The chart's ValidatingAdmissionPolicy for admitted jobs (charts/kubetrain/templates/kueue-policy.yaml),
    rendered by helm and applied for this test only (it is cluster-scoped)."""
    helm = Path(subprocess.run(["bash", str(ROOT / "testbed" / "build.sh"), "--print"], check=True,
                               capture_output=True, text=True).stdout.strip()) / "helm"
    rendered = subprocess.run([str(helm), "template", f"kq{namespace[-8:]}", str(ROOT / "charts" / "kubetrain"),
                               "--show-only", "templates/kueue-policy.yaml"], check=True, capture_output=True,
                              text=True).stdout
    path = Path(f"/tmp/kueue-policy-{namespace}.yaml")
    path.write_text(rendered)
    kubectl("apply", "-f", str(path))
    yield
    kubectl("delete", "--ignore-not-found", "-f", str(path))
    path.unlink()


def test_an_admitted_gang_cannot_change_size_resources_or_queue(operator, jobs, kueue_queue, admission_policy):
    from kubernetes import client

    create(jobs, "fixed", kueue_queue.local_queue, nodes=2)
    jobs.wait_phase("fixed", "Running", nodesReady=2)

    def refused(body: dict[str, Any], dry_run: bool = True) -> str:
        try:
            jobs.custom.patch_namespaced_custom_object("kubetrain.io", "v1alpha1", jobs.namespace, "trainingjobs",
                                                       "fixed", body, dry_run="All" if dry_run else None)
        except client.ApiException as exc:
            return str(exc.body)
        return ""

    # The policy takes effect a moment after it is created: probe with dry runs only.
    message = wait_until(lambda: refused({"spec": {"nodes": 3}}), bool, timeout=60, what="spec.nodes refused")
    assert "spec.nodes" in message
    assert "spec.resources" in refused({"spec": {"resources": {"requests": {"cpu": "200m", "memory": "64Mi"}}}})
    assert kq.LABEL_QUEUE_NAME in refused({"metadata": {"labels": {kq.LABEL_QUEUE_NAME: "other"}}})
    assert refused({"spec": {"runPolicy": {"backoffLimit": 5}}}) == "", "other fields stay editable"
    # Suspended, the gang may change; resumed, Kueue admits the new size and the new gang starts.
    jobs.patch_spec("fixed", {"runPolicy": {"suspend": True}})
    jobs.wait_phase("fixed", "Suspended")
    assert refused({"spec": {"nodes": 3}}, dry_run=False) == ""
    jobs.patch_spec("fixed", {"runPolicy": {"suspend": False}})
    status = jobs.wait_phase("fixed", "Running", nodesReady=3, timeout=180)
    assert status["nodesTotal"] == 3 and status["failures"] == 0
    uid = jobs.get("fixed")["metadata"]["uid"]
    wl = jobs.custom.get_namespaced_custom_object(kq.GROUP, kq.VERSION, jobs.namespace, kq.PLURAL,
                                                  kq.workload_name("fixed", uid))
    assert wl["spec"]["podSets"][0]["count"] == 3, "Kueue counts the gang that runs"
    assert wl["status"]["admission"]["podSetAssignments"][0]["count"] == 3


def test_a_missing_priority_class_keeps_the_job_queued_with_a_reason(operator, jobs, kueue_queue):
    create(jobs, "nopri", kueue_queue.local_queue, nodes=1, podTemplate={"priorityClassName": "no-such-class"})
    status = wait_queued(jobs, "nopri", "PriorityClassNotFound")
    assert "no-such-class" in status["message"] and jobs.pods("nopri") == []


def test_a_resource_the_cluster_queue_does_not_cover_keeps_the_job_queued_with_no_pod(operator, jobs, kueue_queue):
    """Kueue v0.19.2 (granular pending reasons on) cannot write its answer for an uncovered resource: its
    status update carries an empty condition reason, which the API server refuses ("Could not update Workload
    status" in kueue.log). The job must still wait Queued and create no pod."""
    create(jobs, "gpu", kueue_queue.local_queue, nodes=1,
           resources={"requests": {"cpu": "100m", "memory": "64Mi", "example.com/gpu": "1"},
                      "limits": {"example.com/gpu": "1"}})
    status = wait_queued(jobs, "gpu")
    time.sleep(5)
    status = jobs.status("gpu")
    assert status["phase"] == "Queued" and queued_reason(status) and jobs.pods("gpu") == []


def workloads(jobs: Jobs) -> list[dict[str, Any]]:
    return jobs.custom.list_namespaced_custom_object(kq.GROUP, kq.VERSION, jobs.namespace, kq.PLURAL)["items"]


def test_a_workload_deleted_by_hand_stops_the_gang_and_is_recreated(operator, jobs, kueue_queue):
    from kubetrain_testbed import wait_until

    create(jobs, "again", kueue_queue.local_queue, nodes=2)
    jobs.wait_phase("again", "Running", nodesReady=2)
    [first] = workloads(jobs)
    jobs.custom.delete_namespaced_custom_object(kq.GROUP, kq.VERSION, jobs.namespace, kq.PLURAL,
                                                first["metadata"]["name"])
    status = jobs.wait_phase("again", "Running", nodesReady=2, attempt=2, timeout=180)
    assert status["failures"] == 0 and status["preemptions"] == 1
    [second] = wait_until(lambda: workloads(jobs), lambda w: len(w) == 1 and w[0]["metadata"]["uid"]
                          != first["metadata"]["uid"], timeout=60, what="a new Workload")
    assert kq.WorkloadView.from_storage(second).admitted


def test_deleting_a_job_lets_its_workload_go(operator, jobs, kueue_queue):
    from kubetrain_testbed import wait_until

    create(jobs, "bye", kueue_queue.local_queue, nodes=2)
    jobs.wait_phase("bye", "Running", nodesReady=2)
    assert len(workloads(jobs)) == 1
    jobs.delete("bye")
    wait_until(lambda: workloads(jobs), lambda w: w == [], timeout=120,
               what="the Workload is deleted with its job (the operator removed its finalizer)")
    # and its quota is free: a job of the full quota is admitted
    create(jobs, "next", kueue_queue.local_queue, nodes=3)
    jobs.wait_phase("next", "Running", nodesReady=3, timeout=180)


class PodsReadyLog(WatchLog):
    """Every PodsReady (status, reason) of the namespace's Workloads, in the order the API server sent
    them (a short-lived False/WaitForRecovery between two polls is not missed)."""

    def __init__(self, jobs: Jobs) -> None:
        self.seen: list[tuple[str, str]] = []
        super().__init__(jobs, kq.GROUP, kq.VERSION, kq.PLURAL)

    def record(self, obj: dict[str, Any]) -> None:
        cond = kq.WorkloadView.from_storage(obj).pods_ready
        if cond is not None and (not self.seen or self.seen[-1] != (cond.status, cond.reason)):
            self.seen.append((cond.status, cond.reason))


def test_a_gang_recreated_after_a_pod_failure_reports_wait_for_recovery_then_recovered(operator, jobs, kueue_queue):
    """PodsReady (issue 14, mechanism 3): Kueue's waitForPodsReady reads it, so a gang the operator
    recreates after a failure says False/WaitForRecovery until its new pods are Ready, then True/Recovered;
    the Workload keeps its admission throughout (no eviction, no requeue)."""
    from kubetrain_testbed import wait_until

    log = PodsReadyLog(jobs)
    try:
        # Kueue's recovery timeout (30 s on the testbed) runs from the failure to the new gang's Ready: the
        # default 10 s backoff would spend a third of it, and a loaded machine the rest (an eviction).
        create(jobs, "heal", kueue_queue.local_queue, nodes=2, runPolicy={"backoffLimit": 2, "backoffSeconds": 1})
        jobs.wait_phase("heal", "Running", nodesReady=2)
        wait_until(lambda: list(log.seen), lambda s: ("True", kq.STARTED) in s, timeout=60,
                   what="PodsReady True/Started")
        jobs.finish_pod("heal-a1-n1", 1, "a worker crashed")
        status = jobs.wait_phase("heal", "Running", nodesReady=2, attempt=2, timeout=180)
        assert status["failures"] == 1 and status.get("preemptions", 0) == 0, status
        seen = wait_until(lambda: list(log.seen), lambda s: s and s[-1] == ("True", kq.RECOVERED), timeout=60,
                          what="PodsReady True/Recovered")
    finally:
        log.stop()
    started = seen.index(("True", kq.STARTED))
    assert ("False", kq.WAIT_FOR_RECOVERY) in seen[started:], seen
    [wl] = workloads(jobs)
    view = kq.WorkloadView.from_storage(wl)
    assert view.admitted and view.finished is None, wl["status"]


def test_an_exhausted_backoff_limit_finishes_the_workload_as_failed_and_frees_the_quota(operator, jobs, kueue_queue):
    """Finished (issue 14, mechanism 6): a job that fails for good sets Finished=True/Failed on its
    Workload, which releases its quota to the next job at once."""
    from kubetrain_testbed import wait_until

    create(jobs, "doomed", kueue_queue.local_queue, nodes=3, runPolicy={"backoffLimit": 0})
    jobs.wait_phase("doomed", "Running", nodesReady=3)
    create(jobs, "waiting", kueue_queue.local_queue, nodes=3)
    wait_queued(jobs, "waiting")
    jobs.finish_pod("doomed-a1-n0", 1, "out of luck")
    jobs.wait_phase("doomed", "Failed")
    [wl] = wait_until(lambda: [w for w in workloads(jobs) if w["metadata"]["ownerReferences"][0]["name"] == "doomed"],
                      lambda w: len(w) == 1 and kq.WorkloadView.from_storage(w[0]).finished is not None,
                      timeout=60, what="the failed job's Workload Finished")
    finished = kq.WorkloadView.from_storage(wl).finished
    assert (finished.status, finished.reason) == ("True", kq.FINISHED_FAILED), wl["status"]
    jobs.wait_phase("waiting", "Running", nodesReady=3, timeout=180)


def test_removing_the_label_of_a_queued_job_runs_it_without_kueue_and_deactivates_its_workload(operator, jobs,
                                                                                              kueue_queue):
    create(jobs, "leaver", kueue_queue.local_queue, nodes=4)  # over the queue's quota: it waits
    wait_queued(jobs, "leaver", "ExceedsMaxQuota")
    jobs.custom.patch_namespaced_custom_object("kubetrain.io", "v1alpha1", jobs.namespace, "trainingjobs", "leaver",
                                               {"metadata": {"labels": {kq.LABEL_QUEUE_NAME: None}}})
    status = jobs.wait_phase("leaver", "Running", nodesReady=4)
    queued = next(c for c in status["conditions"] if c["type"] == "Queued")
    assert (queued["status"], queued["reason"]) == ("False", "QueueLabelRemoved"), queued
    [body] = wait_until(lambda: workloads(jobs), lambda w: len(w) == 1 and w[0]["spec"].get("active") is False,
                        timeout=60, what="the job's Workload deactivated")
    assert not kq.WorkloadView.from_storage(body).admitted
    wait_until(lambda: jobs.event_messages("leaver", "QueueLabelRemoved"), lambda ms: len(ms) == 1, timeout=30,
               what="one QueueLabelRemoved event")
