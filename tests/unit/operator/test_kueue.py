"""The Workload the operator owns for a queued TrainingJob, and how it reads Kueue's answer (issue 14).

Field names, reasons and the name scheme are Kueue v0.19.2's (apis/kueue/v1beta2/workload_types.go,
pkg/controller/jobframework/workload_names.go, generatePodsReadyCondition, pkg/podset)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kubetrain import builders, kueue, kueue_admission
from kubetrain.api import Job
from kubetrain.kueue import Condition, KueueError, WorkloadView
from kubetrain.kueue_admission import PodSetInfo

BODY: dict[str, Any] = {
    "metadata": {"name": "gpt-small", "namespace": "ml", "uid": "0b1c2d3e-aaaa-bbbb-cccc-000000000001",
                 "generation": 1, "creationTimestamp": "2026-12-03T13:00:00Z",
                 "labels": {"kueue.x-k8s.io/queue-name": "team-a"}},
    "spec": {
        "image": "reg/trainer:0.1.0", "nodes": 3,
        "resources": {"requests": {"cpu": "2"}, "limits": {"nvidia.com/gpu": 1}},
        "trainer": {"builtin": {"task": "regression"}},
        "podTemplate": {"labels": {"team": "a"}, "annotations": {"x": "y"}, "nodeSelector": {"pool": "gpu"}},
    },
}


def make_job(**spec: Any) -> tuple[Job, dict[str, str]]:
    body = copy.deepcopy(BODY)
    body["spec"].update(spec)
    return Job.from_storage(body), dict(body["metadata"]["labels"])


# ------------------------------------------------------------------ the Workload body

def test_workload_metadata_owner_finalizer_uid_label() -> None:
    job, labels = make_job()
    wl = kueue.build_workload(job, labels=labels)
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2" and wl["kind"] == "Workload"
    meta = wl["metadata"]
    assert meta["namespace"] == "ml"
    assert meta["labels"] == {"kueue.x-k8s.io/job-uid": job.uid}
    assert meta["finalizers"] == ["kueue.x-k8s.io/resource-in-use"]
    assert meta["ownerReferences"] == [{"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                        "name": "gpt-small", "uid": job.uid, "controller": True,
                                        "blockOwnerDeletion": True}]


def test_workload_spec_queue_active_and_one_podset_of_nodes() -> None:
    job, labels = make_job()
    spec = kueue.build_workload(job, labels=labels)["spec"]
    assert spec["queueName"] == "team-a"
    assert spec["active"] is True
    assert "priorityClassRef" not in spec and "priority" not in spec
    [podset] = spec["podSets"]
    assert podset["name"] == "workers" and podset["count"] == 3


def test_suspended_job_has_an_inactive_workload() -> None:
    job, labels = make_job(runPolicy={"suspend": True})
    assert kueue.build_workload(job, labels=labels)["spec"]["active"] is False


def test_podset_template_is_the_pod_the_operator_creates() -> None:
    """Same spec as builders.get_pod (resources, nodeSelector, tolerations decide Kueue's flavors),
    metadata reduced to what a Workload allows, nothing that changes between attempts."""
    job, labels = make_job()
    template = kueue.build_workload(job, labels=labels)["spec"]["podSets"][0]["template"]
    pod = builders.get_pod(job=job, attempt=0, rank=0)
    assert template["spec"] == pod["spec"]
    assert template["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "2"}, "limits": {"nvidia.com/gpu": 1}}
    assert template["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert set(template["metadata"]) == {"labels", "annotations"}
    assert template["metadata"]["labels"] == {"team": "a", "kubetrain.io/job-name": "gpt-small",
                                              "app.kubernetes.io/managed-by": "kubetrain"}
    assert template["metadata"]["annotations"] == {"x": "y"}


def test_podset_template_does_not_depend_on_the_attempt() -> None:
    job, labels = make_job()
    assert kueue.build_workload(job, labels=labels) == kueue.build_workload(job, labels=labels)
    changed, _ = make_job(nodes=4, resources={"requests": {"cpu": "3"}})
    a = kueue.build_workload(job, labels=labels)["spec"]["podSets"][0]
    b = kueue.build_workload(changed, labels=labels)["spec"]["podSets"][0]
    assert (a["count"], b["count"]) == (3, 4) and a["template"] != b["template"]


@pytest.mark.parametrize("labels, template, want", [
    ({}, {}, None),
    ({}, {"priorityClassName": "high"},
     {"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "high"}),
    ({"kueue.x-k8s.io/priority-class": "urgent"}, {},
     {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "urgent"}),
    # The label selects a WorkloadPriorityClass even when the pods have a PriorityClass.
    ({"kueue.x-k8s.io/priority-class": "urgent"}, {"priorityClassName": "high"},
     {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "urgent"}),
])
def test_priority_class_ref(labels: dict, template: dict, want: dict | None) -> None:
    job, base = make_job(podTemplate=template)
    all_labels = {**base, **labels}
    ref = kueue.priority_ref(job, all_labels)
    assert (ref.as_ref() if ref else None) == want
    if want is None:
        return
    spec = kueue.build_workload(job, labels=all_labels, priority=1000)["spec"]
    assert spec["priorityClassRef"] == want and spec["priority"] == 1000
    with pytest.raises(KueueError, match="PriorityClass"):
        kueue.build_workload(job, labels=all_labels)  # the value must be read first


@pytest.mark.parametrize("value", ["Team-A", "-a", "a-", "a_b", "", "x" * 64, "a b"])
def test_invalid_queue_label_is_refused_naming_the_label(value: str) -> None:
    with pytest.raises(KueueError) as err:
        kueue.queue_name({"kueue.x-k8s.io/queue-name": value})
    assert err.value.field == "metadata.labels[kueue.x-k8s.io/queue-name]"


def test_queue_name_absent_and_valid() -> None:
    assert kueue.queue_name({}) is None and kueue.queue_name(None) is None
    assert kueue.queue_name({"kueue.x-k8s.io/queue-name": "team-a.gpu"}) == "team-a.gpu"
    job, _ = make_job()
    with pytest.raises(KueueError, match="not set"):
        kueue.build_workload(job, labels={})


@pytest.mark.parametrize("name, uid, want", [
    # Kueue v0.19.2's jobframework.GetWorkloadNameForOwnerWithGVK (ShortWorkloadNames on) for the GVK
    # kubetrain.io/v1alpha1 TrainingJob, run once with `go run` against the module: the same strings.
    ("gpt-small", "u-1", "trainingjob-gpt-small-2d313"),
    ("a" * 63, "u", "trainingjob-" + "a" * 45 + "-0dbed"),
])
def test_workload_name_is_kueues_scheme_at_most_63(name: str, uid: str, want: str) -> None:
    got = kueue.workload_name(name, uid)
    assert got == want and len(got) <= 63
    assert got != kueue.workload_name(name, uid + "x")  # a job re-created under the name gets another


# ------------------------------------------------------------------ reading the status

def cond(kind: str, status: str, reason: str = "", message: str = "") -> dict[str, str]:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-12-03T13:00:00Z"}


ADMISSION = {"clusterQueue": "cq", "podSetAssignments": [
    {"name": "workers", "flavors": {"cpu": "default", "nvidia.com/gpu": "gpu-a"}, "count": 3,
     "resourceUsage": {"cpu": "6"}}]}


def view(*conds: dict, admission: dict | None = None, active: bool | None = None, **status: Any) -> WorkloadView:
    spec: dict[str, Any] = {"queueName": "team-a"}
    if active is not None:
        spec["active"] = active
    body = {"metadata": {"name": "wl", "uid": "w-1"}, "spec": spec,
            "status": {"conditions": list(conds), **({"admission": admission} if admission else {}), **status}}
    return WorkloadView.from_storage(body)


def test_new_workload_has_said_nothing() -> None:
    v = view()
    assert not v.quota_reserved and not v.admitted and v.evicted is None and v.pending is None
    assert v.finished is None and v.active and v.assignments == () and not v.topology_assigned


@pytest.mark.parametrize("reason, message", [
    ("ExceedsMaxQuota", "couldn't assign flavors to pod set workers: insufficient quota for cpu in flavor default, "
                        "request > maximum capacity (8 > 6)"),
    ("WaitingForQuota", "couldn't assign flavors to pod set workers: insufficient unused quota for cpu"),
    ("Pending", "LocalQueue team-a doesn't exist"),
])
def test_pending_carries_kueues_reason_and_message(reason: str, message: str) -> None:
    v = view(cond("QuotaReserved", "False", reason, message), cond("Admitted", "False", "NoReservation", "x"))
    assert v.pending == Condition("False", reason, message)
    assert not v.admitted and not v.quota_reserved


def test_admitted_with_assignments() -> None:
    v = view(cond("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
             cond("Admitted", "True", "Admitted", "The workload is admitted"), admission=ADMISSION)
    assert v.quota_reserved and v.admitted and v.pending is None and v.cluster_queue == "cq"
    assert v.assignments == (kueue.Assignment(name="workers", flavors={"cpu": "default", "nvidia.com/gpu": "gpu-a"},
                                              count=3),)
    assert not v.topology_assigned


@pytest.mark.parametrize("extra", [{"topologyAssignment": {"levels": ["kubernetes.io/hostname"], "slices": []}},
                                   {"delayedTopologyRequest": "Pending"}])
def test_topology_assignment_is_unsupported(extra: dict) -> None:
    admission = copy.deepcopy(ADMISSION)
    admission["podSetAssignments"][0].update(extra)
    v = view(cond("Admitted", "True", "Admitted"), admission=admission)
    assert v.topology_assigned
    with pytest.raises(KueueError, match="topology"):
        kueue_admission.pod_set_info(v, FLAVORS)


@pytest.mark.parametrize("reason", ["Preempted", "PodsReadyTimeout", "Deactivated", "NodeFailures"])
def test_evicted_reason_and_message(reason: str) -> None:
    v = view(cond("QuotaReserved", "True", "QuotaReserved"), cond("Admitted", "True", "Admitted"),
             cond("Evicted", "True", reason, "Preempted to accommodate a workload (UID: x)"), admission=ADMISSION)
    assert v.evicted == Condition("True", reason, "Preempted to accommodate a workload (UID: x)")
    assert v.admitted  # the operator stops the pods first, then clears the admission


def test_evicted_false_and_requeued_and_finished() -> None:
    v = view(cond("Evicted", "False", "x"), cond("Requeued", "True", "Preempted", "m"),
             cond("Finished", "True", "Succeeded", "done"), requeueState={"count": 2})
    assert v.evicted is None and v.requeued == Condition("True", "Preempted", "m")
    assert v.finished == Condition("True", "Succeeded", "done") and v.requeue_count == 2


def test_deactivated_by_kueue_only_when_the_job_is_not_suspended() -> None:
    target = cond("DeactivationTarget", "True", "RequeuingLimitExceeded",
                  "exceeding the maximum number of re-queuing retries")
    v = view(target)
    assert v.deactivated_by_kueue(suspended=False) == Condition(
        "True", "RequeuingLimitExceeded", "exceeding the maximum number of re-queuing retries")
    evicted = view(cond("Evicted", "True", "Deactivated",
                        "The workload is deactivated due to exceeding the maximum execution time"), active=False)
    got = evicted.deactivated_by_kueue(suspended=False)
    assert got is not None and "maximum execution time" in got.message
    assert evicted.deactivated_by_kueue(suspended=True) is None  # the user's suspend, mapped by the operator
    assert view(active=True).deactivated_by_kueue(suspended=False) is None


def test_a_workload_the_operator_deactivated_for_a_suspend_is_never_read_as_kueues_deactivation() -> None:
    """The CI failure of 2026-12-04: the job was resumed (its status no longer Suspended) but the write
    that activates its Workload again had not landed (a conflict with Kueue), and the inactive Workload
    was read as Kueue's own deactivation: the job failed. The operator's mark settles it."""
    body = {"metadata": {"name": "wl", "annotations": {kueue.ANNOTATION_SUSPENDED: "true"}},
            "spec": {"queueName": "q", "active": False},
            "status": {"conditions": [cond("Evicted", "True", "Deactivated", "The workload is deactivated")]}}
    marked = WorkloadView.from_storage(body)
    assert marked.suspended_by_job and marked.deactivated_by_kueue(suspended=False) is None
    unmarked = WorkloadView.from_storage({**body, "metadata": {"name": "wl"}})
    assert unmarked.deactivated_by_kueue(suspended=False) is not None  # Kueue's own: the job fails


# ------------------------------------------------------------------ admission into the pods

FLAVORS = {
    "default": {"nodeLabels": {"pool": "gpu"}},
    "gpu-a": {"nodeLabels": {"gpu": "a100"},
              "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
}


def admitted_view(**status: Any) -> WorkloadView:
    return view(cond("Admitted", "True", "Admitted"), admission=ADMISSION, **status)


def test_flavors_node_labels_and_tolerations() -> None:
    info = kueue_admission.pod_set_info(admitted_view(), FLAVORS)
    assert info.node_selector == {"pool": "gpu", "gpu": "a100"}
    assert info.tolerations == ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},)


def test_admission_check_pod_set_updates_are_merged() -> None:
    checks = [{"name": "prov", "state": "Ready", "message": "", "podSetUpdates": [
        {"name": "workers", "labels": {"l": "1"}, "annotations": {"a": "2"}, "nodeSelector": {"zone": "z1"},
         "tolerations": [{"key": "spot", "operator": "Exists"},
                         {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        {"name": "other", "labels": {"ignored": "x"}}]}]
    info = kueue_admission.pod_set_info(admitted_view(admissionChecks=checks), FLAVORS)
    assert info.node_selector == {"pool": "gpu", "gpu": "a100", "zone": "z1"}
    assert info.labels == {"l": "1"} and info.annotations == {"a": "2"}
    assert [t["key"] for t in info.tolerations] == ["nvidia.com/gpu", "spot"]  # no duplicate


def test_admission_check_contradicting_a_flavor_is_an_error() -> None:
    checks = [{"name": "prov", "state": "Ready", "message": "",
               "podSetUpdates": [{"name": "workers", "nodeSelector": {"pool": "cpu"}}]}]
    with pytest.raises(KueueError, match=r"nodeSelector\[pool\]"):
        kueue_admission.pod_set_info(admitted_view(admissionChecks=checks), FLAVORS)


def test_missing_flavor_or_podset_is_an_error() -> None:
    with pytest.raises(KueueError, match="gpu-a"):
        kueue_admission.pod_set_info(admitted_view(), {"default": {}})
    other = view(cond("Admitted", "True", "Admitted"),
                 admission={"clusterQueue": "cq", "podSetAssignments": [{"name": "main", "flavors": {}}]})
    with pytest.raises(KueueError, match="workers"):
        kueue_admission.pod_set_info(other, FLAVORS)


def test_merge_into_the_operators_pod() -> None:
    job, _ = make_job()
    pod = builders.get_pod(job=job, attempt=1, rank=2)
    info = kueue_admission.pod_set_info(admitted_view(), FLAVORS)
    merged = kueue_admission.merge_into_pod(pod, info)
    assert merged["spec"]["nodeSelector"] == {"pool": "gpu", "gpu": "a100"}
    assert merged["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert merged["metadata"]["name"] == "gpt-small-a1-n2"
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu"}  # the input is not changed
    # Everything else is the operator's pod.
    assert {k: v for k, v in merged["spec"].items() if k not in ("nodeSelector", "tolerations")} == \
        {k: v for k, v in pod["spec"].items() if k not in ("nodeSelector", "tolerations")}


def test_merge_conflicting_with_the_pods_node_selector_is_an_error() -> None:
    job, _ = make_job()
    pod = builders.get_pod(job=job, attempt=1, rank=0)
    with pytest.raises(KueueError, match=r"pod.nodeSelector\[pool\]"):
        kueue_admission.merge_into_pod(pod, PodSetInfo(node_selector={"pool": "cpu"}))
    unchanged = kueue_admission.merge_into_pod(pod, PodSetInfo())
    assert unchanged == pod


# ------------------------------------------------------------------ PodsReady

WFS = Condition("False", "WaitForStart", "Not all pods are ready or succeeded")
WFR = Condition("False", "WaitForRecovery", "At least one pod has failed, waiting for recovery")
STARTED = Condition("True", "Started", "All pods reached readiness and the workload is running")
RECOVERED = Condition("True", "Recovered", "All pods reached readiness and the workload is running")


@pytest.mark.parametrize("admitted, all_ready, current, want", [
    (False, False, None, WFS),                # queued
    (False, True, STARTED, WFS),              # evicted: not admitted any more
    (True, False, None, WFS),                 # admitted, pods starting
    (True, False, WFS, WFS),
    (True, True, None, STARTED),              # all Ready the first time
    (True, True, WFS, STARTED),
    (True, True, STARTED, STARTED),
    (True, False, STARTED, WFR),              # the gang is being recreated
    (True, False, WFR, WFR),
    (True, True, WFR, RECOVERED),             # ... and is Ready again
    (True, True, RECOVERED, RECOVERED),
    (True, False, RECOVERED, WFR),            # a second recovery
    (True, False, Condition("False", "PodsReady", "old"), WFS),  # Kueue's old reason
])
def test_pods_ready_condition(admitted: bool, all_ready: bool, current: Condition | None, want: Condition) -> None:
    assert kueue.pods_ready_condition(admitted=admitted, all_ready=all_ready, current=current) == want


def test_framework_name_is_what_kueue_is_configured_with() -> None:
    assert kueue.FRAMEWORK == "TrainingJob.v1alpha1.kubetrain.io"
