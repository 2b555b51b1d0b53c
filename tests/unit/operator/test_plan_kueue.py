"""Table tests of the planner of a job queued by Kueue (plan_kueue.py, issue 14): no pod before Kueue admits
the whole gang, Kueue's reason in status while the job waits, PodsReady as Kueue's own integrations write it,
an eviction that stops the gang without spending backoffLimit, suspend <-> spec.active, Finished at the end."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from kubetrain import kueue, kueue_admission
from kubetrain.actions import CreatePod, CreateWorkload, DeletePod, PatchStatus, PatchWorkload, Plan
from kubetrain.api import Job
from kubetrain.observe import Observed
from kubetrain.plan_kueue import LABEL_REMOVED, KueueObserved, is_queued, plan_queued, plan_unqueued
from kubetrain_factories import at, gang, iso, job, observed, pod, started

FLAVOR = "default-flavor"
NAME = "trainingjob-tj-abcde"


def queued(labels: dict[str, str] | None = None, **kw: Any) -> Job:
    return replace(job(**kw), labels={kueue.LABEL_QUEUE_NAME: "lq"} if labels is None else labels)


def cond(kind: str, status: str, reason: str, message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message, "lastTransitionTime": iso(0)}


def workload(*conds: dict[str, Any], active: bool = True, admitted: bool = False, deleting: bool = False,
             topology: bool = False, nodes: int = 2, marked: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": NAME, "namespace": "ns", "resourceVersion": "7", "finalizers": [kueue.FINALIZER]}
    if marked:  # deactivated by the operator for the job's suspend
        meta["annotations"] = {kueue.ANNOTATION_SUSPENDED: "true"}
    if deleting:
        meta["deletionTimestamp"] = iso(0)
    status: dict[str, Any] = {"conditions": list(conds)}
    if admitted:
        assignment: dict[str, Any] = {"name": "workers", "count": 2, "flavors": {"cpu": FLAVOR}}
        if topology:
            assignment["topologyAssignment"] = {"levels": ["rack"]}
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [assignment]}
    podsets = [{"name": "workers", "count": nodes, "template": kueue.podset_template(job(nodes=nodes))}]
    return {"metadata": meta, "spec": {"active": active, "podSets": podsets}, "status": status}


ADMITTED = (cond("QuotaReserved", "True", "QuotaReserved"), cond("Admitted", "True", "Admitted"))
FLAVORS = {FLAVOR: {"nodeLabels": {"pool": "a"}}}


def admitted(*extra: dict[str, Any], **kw: Any) -> KueueObserved:
    return KueueObserved(workload=workload(*ADMITTED, *extra, admitted=True, **kw), flavors=FLAVORS)


def pending(reason: str = "ExceedsMaxQuota", message: str = "couldn't assign flavors to pod set workers: "
            "insufficient quota for pods") -> KueueObserved:
    return KueueObserved(workload=workload(cond("QuotaReserved", "False", reason, message)))


PREEMPTED = cond("Evicted", "True", "Preempted", "Preempted to accommodate a workload (UID: u2) due to prioritization")
BIGGER = {"resources": {"requests": {"cpu": "8", "nvidia.com/gpu": "8"}, "limits": {"cpu": "8", "nvidia.com/gpu": "8"}}}
"""Pods' resources edited: more cpu and gpus per pod than the Workload (built from `job()`) counts."""
DUE = {"failures": 1, "nextAttemptTime": iso(1)}
"""Between attempts after a failure, the backoff passed (the plans run at 5 s)."""


@dataclass
class Case:
    id: str
    job: Job
    kq: KueueObserved
    obs: Observed = field(default_factory=observed)
    phase: str | None = None
    """Expected status.phase after the plan (None: no status write)."""
    queued: str | None = None
    """Expected reason of condition Queued=True."""
    creates: int | None = None
    deletes: int = 0
    workload: bool = False
    """A CreateWorkload is expected."""
    patch: dict[str, Any] | None = None
    """Expected Workload patch: its spec, the status conditions (type -> (status, reason)), or the finalizer."""
    counters: dict[str, int] = field(default_factory=dict)
    events: list[str] | None = None


CASES = [
    Case("no Workload yet: create it and wait, no pod", queued(), KueueObserved(), phase="Queued",
         queued="WorkloadCreated", creates=0, workload=True, events=["Queued"]),
    Case("Kueue's CRDs missing: a clear condition, never a start that bypasses the queue", queued(),
         KueueObserved(installed=False), phase="Queued", queued="KueueNotInstalled", creates=0),
    Case("a missing PriorityClass: Queued with a reason, no Workload", queued(),
         KueueObserved(priority_error="PriorityClass 'gold' does not exist"), phase="Queued",
         queued="PriorityClassNotFound", creates=0),
    Case("an invalid queue label fails the job naming the label", queued({kueue.LABEL_QUEUE_NAME: "Bad_Queue"}),
         KueueObserved(), phase="Failed", creates=0, events=["Failed"]),  # once: not InvalidQueueName too
    Case("over the quota: Queued with Kueue's reason and message, no pod", queued(), pending(), phase="Queued",
         queued="ExceedsMaxQuota", creates=0),
    Case("waiting behind another job: Kueue's WaitingForQuota", queued(), pending("WaitingForQuota"),
         phase="Queued", queued="WaitingForQuota", creates=0),
    Case("admitted: the whole gang starts with the flavor's node labels, PodsReady=False/WaitForStart",
         queued(status={"phase": "Queued", "conditions": [cond("Queued", "True", "WaitingForQuota")]}), admitted(),
         phase="Pending", creates=2, patch={"PodsReady": ("False", "WaitForStart")}, events=["Created"]),
    Case("all pods ready: PodsReady=True/Started", queued(status=started(phase="Running", nodesReady=2)), admitted(),
         obs=observed(*gang(2, ready=True)), patch={"PodsReady": ("True", "Started")}),
    Case("a gang being recreated after a crash: PodsReady=False/WaitForRecovery",
         queued(status=started(phase="Restarting")), admitted(cond("PodsReady", "True", "Started")),
         phase="Pending", patch={"PodsReady": ("False", "WaitForRecovery")}, creates=2),
    Case("a topology assignment is unsupported: reported, no start", queued(),
         KueueObserved(workload=workload(*ADMITTED, admitted=True, topology=True), flavors=FLAVORS),
         phase="Queued", queued="TopologyUnsupported", creates=0),
    Case("preempted while running: pods deleted, a preemption counted, no failure, Queued",
         queued(status=started(phase="Running", nodesReady=2)), admitted(PREEMPTED),
         obs=observed(*gang(2, ready=True)), phase="Queued", queued="Preempted", deletes=2,
         counters={"preemptions": 1, "failures": 0}, events=["Preempted", "Queued"]),
    Case("evicted and no pod left: the admission is cleared as Kueue's integrations do",
         queued(status={**started(phase="Queued", preemptions=1), "conditions": [cond("Queued", "True", "Preempted")]}),
         admitted(PREEMPTED), patch={"QuotaReserved": ("False", "Pending"), "Admitted": ("False", "NoReservation"),
                                     "Requeued": ("True", "Preempted"), "admission": None},
         counters={"preemptions": 1}),
    Case("re-admitted after a preemption: a new attempt, the preemption not counted twice",
         queued(status={**started(phase="Queued", preemptions=1), "conditions": [cond("Queued", "True", "Preempted")]}),
         admitted(), phase="Pending", creates=2, counters={"attempt": 2, "preemptions": 1, "failures": 0},
         patch={"PodsReady": ("False", "WaitForStart")}),
    Case("suspended: pods go and the Workload becomes inactive", queued(run_policy={"suspend": True},
         status=started(phase="Running")), admitted(), obs=observed(*gang(2)), phase="Suspended", deletes=2,
         patch={"spec": {"active": False}}),
    Case("resumed: the Workload is active again and the job waits in its queue",
         queued(status=started(phase="Suspended")),
         KueueObserved(workload=workload(cond("Evicted", "True", "Deactivated", "The workload is deactivated"),
                                         active=False)),
         phase="Queued", patch={"spec": {"active": True}}, creates=0),
    Case("resumed, but the reactivation lost a race (the status already says Queued): the marked inactive "
         "Workload is the operator's own doing, activated again, and the job does not fail",
         queued(status={**started(phase="Queued"), "conditions": [cond("Queued", "True", "Deactivated")]}),
         KueueObserved(workload=workload(cond("Evicted", "True", "Deactivated", "The workload is deactivated"),
                                         active=False, marked=True)),
         phase=None, patch={"spec": {"active": True}}, creates=0),
    Case("the gang resized while suspended: the waiting Workload asks for the new size",
         queued(nodes=3, status={**started(phase="Queued"), "conditions": [cond("Queued", "True", "Pending")]}),
         pending("Pending", "waiting"), phase=None, patch={"spec": {"podSets": 3}}),
    Case("resized while suspended, then resumed: one patch makes the Workload active with the new size",
         queued(nodes=3, status=started(phase="Suspended")),
         KueueObserved(workload=workload(cond("Evicted", "True", "Deactivated", "deactivated"), active=False)),
         phase="Queued", patch={"spec": {"active": True, "podSets": 3}}),
    Case("resized while suspended: the inactive Workload gets the new size", queued(
         nodes=3, run_policy={"suspend": True}, status=started(phase="Suspended")),
         KueueObserved(workload=workload(active=False)), patch={"spec": {"podSets": 3}}),
    Case("resized while admitted, between attempts: no pod starts under the old admission; the Workload is "
         "deactivated to queue it again, no backoff or preemption counted",
         queued(nodes=6, status=started(phase="Restarting", **DUE)), admitted(), phase="Queued",
         queued="WorkloadOutdated", creates=0, patch={"spec": {"active": False}}, events=["Queued"],
         counters={"attempt": 1, "failures": 1, "preemptions": 0, "restarts": 0}),
    Case("the pods' resources edited while admitted: queued again as well",
         queued(spec=BIGGER, status=started(phase="Restarting", **DUE)), admitted(), phase="Queued",
         queued="WorkloadOutdated", creates=0, patch={"spec": {"active": False}},
         counters={"failures": 1, "preemptions": 0}),
    Case("nothing changed: the next attempt starts under the admission it has",
         queued(status=started(phase="Restarting", **DUE)), admitted(), phase="Pending", creates=2,
         patch={"PodsReady": ("False", "WaitForStart")}, counters={"attempt": 2, "failures": 1, "preemptions": 0}),
    Case("resized while a gang runs: the gang is left alone (the edit takes effect at the next attempt)",
         queued(nodes=6, spec=BIGGER, status=started(phase="Running", nodesReady=2)), admitted(),
         obs=observed(*gang(2, ready=True)), creates=0, patch={"PodsReady": ("True", "Started")}),
    Case("resized, and the failed gang is still stopping: the Workload keeps its quota until no pod is left",
         queued(nodes=6, status=started(phase="Restarting", **DUE)), admitted(),
         obs=observed(*gang(2, deleting=True)), phase="Queued", queued="WorkloadOutdated", creates=0),
    Case("resized during the backoff after a failure: the backoff is honoured first",
         queued(nodes=6, status=started(phase="Restarting", failures=1, nextAttemptTime=iso(60))), admitted(),
         creates=0, patch={"PodsReady": ("False", "WaitForStart")}, counters={"failures": 1}),
    Case("queued again, Kueue has not evicted the inactive Workload yet: its admission is cleared, it is not "
         "reactivated for the old gang",
         queued(nodes=6, status={**started(phase="Queued", failures=1),
                                 "conditions": [cond("Queued", "True", "WorkloadOutdated")]}),
         KueueObserved(workload=workload(*ADMITTED, admitted=True, active=False, marked=True), flavors=FLAVORS),
         phase="Queued", queued="WorkloadOutdated", creates=0,
         patch={"QuotaReserved": ("False", "Pending"), "Admitted": ("False", "NoReservation"), "admission": None}),
    Case("queued again, nothing reserved any more: one write activates the Workload with the new size",
         queued(nodes=6, status={**started(phase="Queued", failures=1),
                                 "conditions": [cond("Queued", "True", "WorkloadOutdated")]}),
         KueueObserved(workload=workload(cond("QuotaReserved", "False", "Pending"), active=False, marked=True)),
         phase="Queued", queued="WorkloadOutdated", creates=0, patch={"spec": {"active": True, "podSets": 6}}),
    Case("admitted at the new size: the next attempt starts with it, no backoff or preemption counted",
         queued(nodes=6, status={**started(phase="Queued", failures=1),
                                 "conditions": [cond("Queued", "True", "WorkloadOutdated")]}), admitted(nodes=6),
         phase="Pending", creates=6, patch={"PodsReady": ("False", "WaitForStart")},
         counters={"attempt": 2, "failures": 1, "preemptions": 0, "nodes_total": 6}),
    Case("resized while suspended and resumed before Kueue evicted the inactive Workload: not reactivated for "
         "the old gang, queued again at the new size",
         queued(nodes=3, status=started(phase="Suspended")),
         KueueObserved(workload=workload(*ADMITTED, admitted=True, active=False, marked=True), flavors=FLAVORS),
         phase="Queued", queued="WorkloadOutdated", creates=0,
         patch={"QuotaReserved": ("False", "Pending"), "Admitted": ("False", "NoReservation"), "admission": None}),
    Case("preempted while running with an edited spec: still a preemption (Kueue's reason), the new size next",
         queued(nodes=6, status=started(phase="Running", nodesReady=2)), admitted(PREEMPTED),
         obs=observed(*gang(2, ready=True)), phase="Queued", queued="Preempted", deletes=2,
         counters={"preemptions": 1, "failures": 0}),
    Case("deactivated by Kueue itself: the job fails with Kueue's message", queued(status=started(phase="Running")),
         admitted(cond("DeactivationTarget", "True", "RequeuingLimitExceeded", "exceeded the requeuing limit")),
         obs=observed(*gang(2)), phase="Failed", deletes=2),
    Case("finished: Finished=True on the Workload releases the quota",
         queued(status=started(phase="Succeeded", completionTime=iso(1))), admitted(),
         patch={"Finished": ("True", "Succeeded")}),
    Case("finished and no pod left: the finalizer goes",
         queued(status=started(phase="Succeeded", completionTime=iso(1))),
         admitted(cond("Finished", "True", "Succeeded")), patch={"finalizer": True}),
    Case("Workload deleted by hand: the gang stops; once no pod is left its finalizer goes",
         queued(status=started(phase="Running")),
         KueueObserved(workload=workload(*ADMITTED, admitted=True, deleting=True)), obs=observed(*gang(2)),
         phase="Queued", queued="WorkloadDeleted", deletes=2, counters={"preemptions": 1}),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plan_queued(case: Case) -> None:
    result = plan_queued(case.job, case.obs, case.kq, at(5))
    status = result.status
    if case.phase is None:
        assert status is None or status.phase == case.job.status.phase, status
    else:
        assert status is not None and status.phase == case.phase, status
    if case.queued is not None:
        assert status is not None
        queued_cond = status.condition("Queued")
        assert queued_cond is not None and (queued_cond.status, queued_cond.reason) == ("True", case.queued)
        assert status.message.startswith(f"queued: {case.queued}: ")
    creates = [a for a in result.actions if isinstance(a, CreatePod)]
    if case.creates is not None:
        assert len(creates) == case.creates
    assert all(a.admission == kueue_admission.PodSetInfo(node_selector={"pool": "a"}) for a in creates)
    assert len([a for a in result.actions if isinstance(a, DeletePod)]) == case.deletes
    assert any(isinstance(a, CreateWorkload) for a in result.actions) == case.workload
    patches = [a for a in result.actions if isinstance(a, PatchWorkload)]
    if case.patch is None:
        assert patches == []
    else:
        [patch] = patches
        assert patch.name == NAME and patch.resource_version == "7"
        assert _patch_summary(patch) == case.patch
    for key, value in case.counters.items():
        assert getattr(status or case.job.status, key) == value, key
    if case.events is not None:
        assert [e.reason for e in result.events] == case.events


def _patch_summary(patch: PatchWorkload) -> dict[str, Any]:
    if patch.remove_finalizer:
        return {"finalizer": True}
    if patch.spec is not None:
        return {"spec": {k: v[0]["count"] if k == "podSets" else v for k, v in patch.spec.items()}}
    assert patch.status is not None
    out: dict[str, Any] = {c["type"]: (c["status"], c["reason"]) for c in patch.status["conditions"]
                           if c["type"] not in ("QuotaReserved", "Admitted", "Evicted", "DeactivationTarget")
                           or patch.status.get("admission", 1) is None}
    out.pop("Evicted", None)
    if "admission" in patch.status:
        out["admission"] = patch.status["admission"]
    return out


def test_a_status_patch_keeps_kueues_own_conditions_and_their_times() -> None:
    kq = admitted(cond("PodsReady", "False", "WaitForStart"))
    result = plan_queued(queued(status=started(phase="Running", nodesReady=2)), observed(*gang(2, ready=True)), kq,
                         at(5))
    [patch] = [a for a in result.actions if isinstance(a, PatchWorkload)]
    assert patch.status is not None
    conds = {c["type"]: c for c in patch.status["conditions"]}
    assert conds["QuotaReserved"] == ADMITTED[0] and conds["Admitted"] == ADMITTED[1]
    assert conds["PodsReady"]["status"] == "True" and conds["PodsReady"]["lastTransitionTime"] == iso(5)


def test_jobs_without_the_label_are_not_queued() -> None:
    assert not is_queued(job()) and is_queued(queued())
    assert plan_queued(queued(deleting=True), observed(), KueueObserved(), at(5)) == Plan()


def test_a_job_deleted_dependents_first_lets_its_workload_go_once_its_pods_are() -> None:
    """Foreground deletion (`kubectl delete --cascade=foreground`, Argo CD's prune): the job waits, with its
    deletionTimestamp, for its Workload (blockOwnerDeletion), and the Workload for our finalizer. Before: a deleting
    job planned nothing, so the finalizer never went and the job and its Workload stayed Terminating forever."""
    deleting = KueueObserved(workload=workload(*ADMITTED, admitted=True, deleting=True))
    assert plan_queued(queued(deleting=True), observed(*gang(2, deleting=True)), deleting, at(5)) == Plan()
    result = plan_queued(queued(deleting=True), observed(), deleting, at(5))
    assert result == Plan(actions=(PatchWorkload(name=NAME, resource_version="7", remove_finalizer=True),))
    live = KueueObserved(workload=workload(*ADMITTED, admitted=True))  # not being deleted: nothing to let go yet
    assert plan_queued(queued(deleting=True), observed(), live, at(5)) == Plan()


def test_the_suspend_mark_goes_in_the_same_write_as_spec_active() -> None:
    """Deactivating for a suspend marks the Workload, activating removes the mark, in one merge patch each
    (so no reader can see an inactive Workload of a suspend without the mark)."""
    suspend = plan_queued(queued(run_policy={"suspend": True}, status=started(phase="Running")), observed(*gang(2)),
                          admitted(), at(5))
    [off] = [a for a in suspend.actions if isinstance(a, PatchWorkload) and a.spec is not None]
    assert off.spec == {"active": False} and off.annotations == {kueue.ANNOTATION_SUSPENDED: "true"}
    resume = plan_queued(queued(status=started(phase="Suspended")), observed(), KueueObserved(
        workload=workload(cond("Evicted", "True", "Deactivated"), active=False, marked=True)), at(5))
    [on] = [a for a in resume.actions if isinstance(a, PatchWorkload) and a.spec is not None]
    assert on.spec == {"active": True} and on.annotations == {kueue.ANNOTATION_SUSPENDED: None}
    created_suspended = kueue.build_workload(job(run_policy={"suspend": True}), labels={kueue.LABEL_QUEUE_NAME: "q"},
                                             priority=None)
    assert created_suspended["metadata"]["annotations"] == {kueue.ANNOTATION_SUSPENDED: "true"}


def test_a_gang_resized_while_admitted_is_queued_again_and_then_starts_at_the_new_size() -> None:
    """The re-queue, step by step as Kueue answers: no pod until Kueue admits 6, then the attempt starts once
    (no loop), and the deactivation is marked as the operator's own (the job does not fail for it)."""
    current = queued(nodes=6, status=started(phase="Restarting", **DUE))
    reserved_inactive = workload(*ADMITTED, admitted=True, active=False, marked=True)
    evicted_inactive = workload(*ADMITTED, cond("Evicted", "True", "Deactivated", "The workload is deactivated"),
                                admitted=True, active=False, marked=True)
    steps = [(admitted(), "deactivate"), (KueueObserved(workload=reserved_inactive, flavors=FLAVORS), "clear"),
             (KueueObserved(workload=evicted_inactive, flavors=FLAVORS), "clear"),
             (KueueObserved(workload=workload(cond("QuotaReserved", "False", "Pending"), active=False, marked=True)),
              "activate"),
             (KueueObserved(workload=workload(cond("QuotaReserved", "False", "Pending"), nodes=6)), "wait"),
             (admitted(nodes=6), "start")]
    for kq, expected in steps:
        result = plan_queued(current, observed(), kq, at(5))
        creates = [a for a in result.actions if isinstance(a, CreatePod)]
        patches = [a for a in result.actions if isinstance(a, PatchWorkload)]
        if expected == "deactivate":
            [patch] = patches
            assert patch.spec == {"active": False} and patch.annotations == {kueue.ANNOTATION_SUSPENDED: "true"}
        elif expected == "clear":
            [patch] = patches
            assert patch.spec is None and patch.status is not None and patch.status["admission"] is None
        elif expected == "activate":
            [patch] = patches
            assert patch.spec is not None and patch.spec["active"] is True
            assert [ps["count"] for ps in patch.spec["podSets"]] == [6]
            assert patch.annotations == {kueue.ANNOTATION_SUSPENDED: None}
        elif expected == "wait":
            assert patches == []
        if expected == "start":
            assert [(a.attempt, a.rank) for a in creates] == [(2, r) for r in range(6)]
        else:
            assert creates == [], expected
        if result.status is not None:
            current = replace(current, status=result.status)
        assert current.status.phase == ("Pending" if expected == "start" else "Queued"), expected
    status = current.status
    assert (status.attempt, status.failures, status.preemptions, status.restarts) == (2, 1, 0, 1)
    queued_cond = status.condition("Queued")
    assert queued_cond is not None and (queued_cond.status, queued_cond.reason) == ("False", "Admitted")


def test_a_workload_stored_in_canonical_quantities_is_not_a_changed_gang():
    """Kueue's webhook stores a created Workload in canonical form (cpu: 4 as "4", 16384Mi as "16Gi"). Read
    as raw JSON that was a 'changed gang': an admitted job nobody edited was deactivated and queued again."""
    import copy

    from kubetrain.actions import CreatePod

    res = {"resources": {"limits": {"cpu": 4, "memory": "16384Mi", "nvidia.com/gpu": 8},
                         "requests": {"cpu": 4, "memory": "16384Mi", "nvidia.com/gpu": 8}}}
    j = queued(spec=res)
    wl = workload(*ADMITTED, admitted=True)
    podsets = [{"name": "workers", "count": 2, "template": copy.deepcopy(kueue.podset_template(j))}]
    for c in podsets[0]["template"]["spec"]["containers"]:
        c["resources"] = {"limits": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "8"},
                          "requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "8"}}
    wl["spec"]["podSets"] = podsets
    r = plan_queued(j, observed(), KueueObserved(workload=wl, flavors=FLAVORS), at(5))
    assert r.status.phase == "Pending" and sum(isinstance(a, CreatePod) for a in r.actions) == 2
    # A real change in the same canonical form still is one.
    for c in podsets[0]["template"]["spec"]["containers"]:
        c["resources"]["limits"]["nvidia.com/gpu"] = c["resources"]["requests"]["nvidia.com/gpu"] = "4"
    r = plan_queued(j, observed(), KueueObserved(workload=wl, flavors=FLAVORS), at(5))
    assert r.status.phase == "Queued" and not any(isinstance(a, CreatePod) for a in r.actions)



def test_an_empty_requests_map_the_workload_does_not_keep_is_not_a_changed_gang():
    from kubetrain.plan_kueue import _counted

    wanted = [{"name": "workers", "count": 2, "template": {"spec": {"containers": [
        {"resources": {"limits": {"nvidia.com/gpu": 1, "memory": "16384Mi"}, "requests": {}}}]}}}]
    stored = [{"name": "workers", "count": 2, "template": {"spec": {"containers": [
        {"resources": {"limits": {"nvidia.com/gpu": "1", "memory": "16Gi"}}}]}}}]
    assert _counted(wanted) == _counted(stored)


def test_a_queued_job_whose_label_is_removed_runs_without_kueue_and_lets_its_workload_go() -> None:
    """Before, the job started its pods with a stale `Queued=True` (the KUEUE column still said why it
    waited), and its Workload stayed in the queue: admitted later, it held quota for a gang that ran outside
    it until the job was deleted. The label put back activates the Workload again (the mark says the
    deactivation was the operator's, so the job does not fail as if Kueue had deactivated it)."""
    waiting = plan_queued(queued(), observed(), pending(), at(5))
    assert waiting.status is not None and waiting.status.phase == "Queued"
    unlabelled = replace(queued(labels={}), status=waiting.status)
    result = plan_unqueued(unlabelled, observed(), at(6))
    assert sorted(a.rank for a in result.actions if isinstance(a, CreatePod)) == [0, 1]
    cond_ = result.status.condition("Queued")
    assert (cond_.status, cond_.reason) == ("False", LABEL_REMOVED) and kueue.LABEL_QUEUE_NAME in cond_.message
    [patch] = [a for a in result.actions if isinstance(a, PatchWorkload)]
    assert patch.name == kueue.workload_name("tj", "uid-1") and patch.spec == {"active": False}
    assert patch.annotations == {kueue.ANNOTATION_SUSPENDED: "true"} and patch.resource_version == ""
    assert [e.reason for e in result.events].count(LABEL_REMOVED) == 1
    # Before the status that says it was done: a Workload write that failed after it was never tried again.
    assert result.actions.index(patch) < min(i for i, a in enumerate(result.actions) if isinstance(a, PatchStatus))
    again = plan_unqueued(replace(unlabelled, status=result.status), observed(*gang(2)), at(7))
    assert not [a for a in again.actions if isinstance(a, PatchWorkload)], "let go once"
    assert LABEL_REMOVED not in [e.reason for e in again.events]
    relabelled = replace(unlabelled, labels={kueue.LABEL_QUEUE_NAME: "lq"}, status=result.status)
    back = plan_queued(relabelled, observed(*gang(2)), KueueObserved(
        workload=workload(cond("QuotaReserved", "False", "Pending"), active=False, marked=True)), at(8))
    assert back.status is not None and back.status.phase == "Queued" and back.status.condition("Failed") is None
    [on] = [a for a in back.actions if isinstance(a, PatchWorkload) and a.spec is not None]
    assert on.spec == {"active": True}


def test_a_job_never_queued_is_planned_as_without_kueue() -> None:
    plain = job()
    from kubetrain.plan import plan
    assert plan_unqueued(plain, observed(), at(5)) == plan(plain, observed(), at(5))


def _fed(tj: Job, result: Plan) -> Job:
    return replace(tj, status=result.status) if result.status is not None else tj


def test_status_stays_consistent_through_suspend_backoff_and_refused_pods() -> None:
    """A reviewer's walk through plan_queued: a waiting job suspended kept Queued=True (its Workload is inactive:
    not queued); a job in backoff after a failure that lost its admission was Queued with Restarting=True left
    over, and its backoff was dropped; pods Kueue admitted but the API server refused left Queued=True."""
    from kubetrain.plan import rejected_plan

    tj = _fed(queued(status={}), plan_queued(queued(status={}), observed(), pending(), at(1)))
    paused = replace(tj, spec=replace(tj.spec, run_policy=replace(tj.spec.run_policy, suspend=True)))
    inactive = KueueObserved(workload=workload(cond("QuotaReserved", "False", "Pending", "x"), active=False,
                                               marked=True))
    for t in (2, 3):
        paused = _fed(paused, plan_queued(paused, observed(), inactive, at(t)))
    assert paused.status.phase == "Suspended"
    assert (paused.status.condition("Queued").status, paused.status.condition("Queued").reason) == ("False",
                                                                                                    "Suspended")

    running = queued(status=started(phase="Running", nodesReady=2))
    failed = _fed(running, plan_queued(running, observed(pod(rank=0, phase="Failed", exit_code=1), pod(rank=1)),
                                       admitted(), at(5)))
    assert failed.status.phase == "Restarting" and failed.status.next_attempt_time is not None
    evicted = _fed(failed, plan_queued(failed, observed(), KueueObserved(
        workload=workload(*ADMITTED, PREEMPTED, admitted=True), flavors=FLAVORS), at(6)))
    assert evicted.status.phase == "Queued" and evicted.status.condition("Restarting").status == "False"
    assert evicted.status.next_attempt_time == failed.status.next_attempt_time, "the backoff still runs"

    refused = rejected_plan(tj, at(2), reason="QuotaExceeded",
                            message='pods "tj-a1-n0" is forbidden: exceeded quota: q, used: pods=10, limited: pods=10')
    assert (refused.status.condition("Queued").status, refused.status.condition("Queued").reason) == ("False",
                                                                                                      "Admitted")
