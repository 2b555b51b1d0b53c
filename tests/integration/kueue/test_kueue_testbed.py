"""Kueue runs on the testbed and follows its protocol with Workloads built by kubetrain.kueue (issue 14,
phase A): no operator runs here, the tests create the Workload a queued TrainingJob gets, by hand, and
read Kueue's answer the way the operator will (WorkloadView)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kubetrain import kueue, kueue_admission
from kubetrain.api import Job
from kubetrain_testbed import wait_until

GROUP, VERSION = kueue.GROUP, kueue.VERSION


@pytest.fixture
def custom(kueue_api):
    return kueue_api


def make_trainingjob(custom, namespace: str, name: str, *, queue: str, nodes: int, cpu: str = "1",
                     priority_class: str | None = None) -> tuple[Job, dict[str, str]]:
    """A stored TrainingJob (no operator runs: nothing acts on it), as the operator would read it."""
    labels = {kueue.LABEL_QUEUE_NAME: queue}
    template: dict[str, Any] = {"priorityClassName": priority_class} if priority_class else {}
    body = {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"image": "kubetrain/trainer:0.1.0", "nodes": nodes,
                     "trainer": {"builtin": {"task": "regression"}},
                     "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}, "limits": {"memory": "1Gi"}},
                     "podTemplate": template}}
    stored = custom.create_namespaced_custom_object("kubetrain.io", "v1alpha1", namespace, "trainingjobs", body)
    return Job.from_storage(stored), stored["metadata"]["labels"]


def create_workload(custom, job: Job, labels: dict[str, str], priority: int | None = None) -> str:
    body = kueue.build_workload(job, labels=labels, priority=priority)
    custom.create_namespaced_custom_object(GROUP, VERSION, job.namespace, kueue.PLURAL, body)
    return body["metadata"]["name"]


def read(custom, namespace: str, name: str) -> kueue.WorkloadView:
    return kueue.WorkloadView.from_storage(
        custom.get_namespaced_custom_object(GROUP, VERSION, namespace, kueue.PLURAL, name))


def test_kueue_admits_a_workload_that_fits(custom, kueue_queue, trainingjob_crd, kueue_flavor):
    job, labels = make_trainingjob(custom, kueue_queue.namespace, "fits", queue=kueue_queue.local_queue, nodes=2)
    name = create_workload(custom, job, labels)
    assert len(name) <= 63 and name.startswith("trainingjob-fits-")
    view = wait_until(lambda: read(custom, job.namespace, name), lambda v: v.admitted, timeout=60,
                      what=f"Kueue admits Workload {name}")
    assert view.quota_reserved and view.cluster_queue == kueue_queue.cluster_queue
    assert view.evicted is None and view.pending is None and not view.topology_assigned
    [assignment] = view.assignments
    assert assignment.name == "workers" and assignment.count == 2
    assert set(assignment.flavors.values()) == {kueue_flavor}
    raw = custom.get_namespaced_custom_object(GROUP, VERSION, job.namespace, kueue.PLURAL, name)
    assert raw["status"]["admission"]["podSetAssignments"][0]["resourceUsage"]["cpu"] == "2"
    assert raw["metadata"]["finalizers"] == [kueue.FINALIZER]
    # Kueue's admission as the operator will merge it into the pods (this flavor adds nothing).
    assert kueue_admission.pod_set_info(view, {kueue_flavor: {}}) == kueue_admission.PodSetInfo()


def test_a_workload_over_the_quota_stays_pending_with_kueues_reason(custom, kueue_queue, trainingjob_crd):
    job, labels = make_trainingjob(custom, kueue_queue.namespace, "too-big", queue=kueue_queue.local_queue, nodes=4)
    name = create_workload(custom, job, labels)
    view = wait_until(lambda: read(custom, job.namespace, name), lambda v: v.pending is not None, timeout=60,
                      what=f"Kueue says why Workload {name} waits")
    assert view.pending.reason == "ExceedsMaxQuota", view.pending
    assert "insufficient quota" in view.pending.message and "workers" in view.pending.message, view.pending
    time.sleep(3)  # and it stays so: nothing is admitted later
    view = read(custom, job.namespace, name)
    assert not view.admitted and not view.quota_reserved and view.assignments == ()


def test_a_second_job_waits_for_quota_while_the_first_holds_it(custom, kueue_queue, trainingjob_crd):
    first, labels1 = make_trainingjob(custom, kueue_queue.namespace, "first", queue=kueue_queue.local_queue, nodes=2)
    n1 = create_workload(custom, first, labels1)
    wait_until(lambda: read(custom, first.namespace, n1), lambda v: v.admitted, timeout=60, what="first admitted")
    second, labels2 = make_trainingjob(custom, kueue_queue.namespace, "second", queue=kueue_queue.local_queue, nodes=2)
    n2 = create_workload(custom, second, labels2)
    view = wait_until(lambda: read(custom, second.namespace, n2), lambda v: v.pending is not None, timeout=60,
                      what="second waits")
    assert view.pending.reason == "WaitingForQuota", view.pending
    assert not view.admitted
    # The first finishes (the operator sets Finished=True): its quota goes to the second.
    finished = {"type": kueue.FINISHED, "status": "True", "reason": kueue.FINISHED_SUCCEEDED,
                "message": "The job succeeded", "lastTransitionTime": _now()}
    _patch_conditions(custom, first.namespace, n1, [finished])
    wait_until(lambda: read(custom, second.namespace, n2), lambda v: v.admitted, timeout=60,
               what="second admitted after the first finished")


def test_high_priority_evicts_low_and_is_admitted_once_low_lets_go(custom, kueue_queue, trainingjob_crd,
                                                                   priority_classes):
    """preemption.withinClusterQueue: LowerPriority. Kueue marks the low Workload Evicted (Preempted); the
    high one is admitted only after the low one's job controller (later: the operator) has stopped its
    pods and cleared the admission, the way Kueue's own integrations do."""
    low, ll = make_trainingjob(custom, kueue_queue.namespace, "low", queue=kueue_queue.local_queue, nodes=3,
                               priority_class="low")
    n_low = create_workload(custom, low, ll, priority=priority_classes["low"])
    wait_until(lambda: read(custom, low.namespace, n_low), lambda v: v.admitted, timeout=60, what="low admitted")
    stored = custom.get_namespaced_custom_object(GROUP, VERSION, low.namespace, kueue.PLURAL, n_low)
    assert stored["spec"]["priorityClassRef"] == {"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "low"}

    high, hl = make_trainingjob(custom, kueue_queue.namespace, "high", queue=kueue_queue.local_queue, nodes=3,
                                priority_class="high")
    n_high = create_workload(custom, high, hl, priority=priority_classes["high"])
    view = wait_until(lambda: read(custom, low.namespace, n_low), lambda v: v.evicted is not None, timeout=60,
                      what="low evicted")
    assert view.evicted.reason == kueue.EVICTED_BY_PREEMPTION, view.evicted
    time.sleep(2)
    assert not read(custom, high.namespace, n_high).admitted  # the low one still holds the quota
    # What the operator does once the low job's pods are gone.
    now = _now()
    _patch_status(custom, low.namespace, n_low, {"admission": None}, [
        {"type": kueue.QUOTA_RESERVED, "status": "False", "reason": "Pending", "message": view.evicted.message,
         "lastTransitionTime": now},
        {"type": kueue.ADMITTED, "status": "False", "reason": "NoReservation", "message": "The workload has no reservation",
         "lastTransitionTime": now},
        {"type": kueue.REQUEUED, "status": "True", "reason": kueue.EVICTED_BY_PREEMPTION, "message": view.evicted.message,
         "lastTransitionTime": now},
    ])
    wait_until(lambda: read(custom, high.namespace, n_high), lambda v: v.admitted, timeout=60, what="high admitted")
    low_view = read(custom, low.namespace, n_low)
    assert not low_view.admitted and not low_view.quota_reserved


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _patch_conditions(custom, namespace: str, name: str, conditions: list[dict]) -> None:
    _patch_status(custom, namespace, name, {}, conditions)


def _patch_status(custom, namespace: str, name: str, fields: dict, conditions: list[dict]) -> None:
    """Replace the given conditions (by type) and fields of the Workload's status (a merge patch)."""
    current = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, kueue.PLURAL, name)
    replaced = {c["type"] for c in conditions}
    kept = [c for c in (current.get("status") or {}).get("conditions") or () if c["type"] not in replaced]
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, kueue.PLURAL, name,
        {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]},
         "status": {**fields, "conditions": kept + conditions}},
        _content_type="application/merge-patch+json")
