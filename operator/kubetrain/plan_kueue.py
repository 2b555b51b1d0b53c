"""The reconcile logic of a job queued by Kueue (issue 14), pure: (job, observed, Kueue, now) -> Plan.

A TrainingJob labelled `kueue.x-k8s.io/queue-name` is planned here instead of
by `plan.plan` alone. Kueue decides *whether* the gang may exist; `plan.plan`
still decides everything about a gang that may (start, supervise, restart,
finish), and this module wraps it:

- no Workload yet: create it (`CreateWorkload`), the job waits in phase
  `Queued` with condition `Queued=True` and Kueue's reason and message;
- Admitted: `plan.plan` starts or supervises the gang, its pods get the
  admission merged in (`CreatePod.admission`), and the operator writes the
  Workload's `PodsReady` condition (Kueue's waitForPodsReady evicts a gang that
  never becomes ready: the partial-gang protection);
- evicted (preempted, pods-ready timeout, deactivated) or no longer admitted:
  the pods are deleted gracefully (their grace is the emergency checkpoint's
  window), the attempt counts as a preemption (never a failure), and once no
  pod is left the admission is cleared as Kueue's own integrations do; the
  next admission starts a new attempt that resumes from the newest checkpoint;
- `spec.runPolicy.suspend` is the Workload's `spec.active`; a deactivation by
  Kueue itself fails the job with Kueue's message;
- the gang changed (`spec.nodes`, the pods' resources) while admitted: a running
  gang is left alone, but no next attempt starts under an admission for another
  gang (that would bypass the quota); once it is due and no pod is left, the
  operator deactivates the Workload (Kueue evicts it, the admission is cleared)
  and activates it again with the new podSets in one write: Kueue admits the new
  size, as its own integrations do with a job that no longer matches its Workload
  (phase `Queued`, reason `WorkloadOutdated`; no backoff or preemption counted);
- a finished job marks its Workload `Finished=True` (the quota is released)
  and lets go of the Workload's finalizer once no pod is left.

The Workload is written with merge patches guarded by its resourceVersion
that carry its whole conditions list, so Kueue's own conditions are kept.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from kubetrain import kueue, kueue_admission
from kubetrain.actions import CreatePod, CreateWorkload, Event, PatchStatus, PatchWorkload, Plan
from kubetrain.api import Job
from kubetrain.draft import Draft, delete_pods, excerpt, fail
from kubetrain.observe import Observed
from kubetrain.plan import plan
from kubetrain.resources import quantity_value
from kubetrain.status import STARTED_PHASES, Status
from kubetrain.supervise import message_shape
from kubetrain.values import format_time, parse_time

QUEUED = "Queued"
"""The phase and the condition of a job that waits for Kueue."""
WAIT_POLL_SECONDS = 30.0
"""How often a waiting job looks again even without a Workload event (the watch is the fast path)."""
OUTDATED = "WorkloadOutdated"
"""The job's reason while its Workload is queued again because the gang changed since its admission."""


@dataclass(frozen=True)
class KueueObserved:
    """What the reconciler read from Kueue's API for one job."""

    installed: bool = True
    """Kueue's Workload API is served."""
    workload: Mapping[str, Any] | None = None
    """The job's Workload as stored, None when it does not exist."""
    priority: int | None = None
    """The value of the PriorityClass or WorkloadPriorityClass the job names (read when one is needed)."""
    priority_error: str = ""
    """Why that value could not be read (the class does not exist)."""
    flavors: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """The admitted ResourceFlavors' specs, by name."""


LABEL_REMOVED = "QueueLabelRemoved"
"""The Queued condition's reason once the queue label is removed from a job that was queued."""


def is_queued(job: Job) -> bool:
    """The job asks for Kueue (its queue label is set, valid or not)."""
    return kueue.LABEL_QUEUE_NAME in job.labels


def reads_workload(job: Job) -> bool:
    """The job's reconcile reads its Workload (`plan_queued`): it asks for Kueue, or it is being deleted after it did
    (its Queued condition): the Workload of a job whose queue label was removed is deactivated but keeps our
    finalizer, and a foreground deletion waits for that Workload, so its finalizer must go (`plan_queued`)."""
    return is_queued(job) or (job.deleting and job.status.condition(QUEUED) is not None)


def plan_unqueued(job: Job, observed: Observed, now: dt.datetime) -> Plan:
    """A job without the queue label: `plan.plan`. One that had the label before (its Queued condition is set)
    runs without Kueue from now on (the chart's admission policy refuses the removal only while Kueue admits
    the job), so its Workload is let go once: deactivated, marked as the operator's doing (Kueue evicts it and
    never admits it while inactive: it holds no quota for a gang that runs outside the queue; the label put
    back activates it again), and the condition says so instead of a stale `Queued=True`."""
    result = plan(job, observed, now)
    status = result.status or job.status
    cond = status.condition(QUEUED)
    if job.deleting or job.status.terminal or cond is None or cond.reason == LABEL_REMOVED:
        return result
    name = kueue.workload_name(job.name, job.uid)
    message = (f"the {kueue.LABEL_QUEUE_NAME} label was removed: the job runs without Kueue; its Workload "
               f"{name} is deactivated")
    status = status.with_condition(QUEUED, "False", reason=LABEL_REMOVED, message=message, now=now)
    result = _set_status(result, job, status)
    result = replace(result, events=result.events + (Event("Normal", LABEL_REMOVED, message),))
    # First: the status says it is done, so a write that failed after it would never be tried again (it is
    # idempotent: no resourceVersion, NotFound is nothing left to do).
    patch = PatchWorkload(name=name, resource_version="", spec={"active": False},
                          annotations={kueue.ANNOTATION_SUSPENDED: "true"})
    return replace(result, actions=(patch,) + result.actions)


def plan_queued(job: Job, observed: Observed, kq: KueueObserved, now: dt.datetime) -> Plan:
    """Decide what to do about one TrainingJob queued by Kueue. Pure and deterministic."""
    body = kq.workload
    view = kueue.WorkloadView.from_storage(body) if body is not None else None
    if job.deleting:  # dependents first (foreground): the job waits for its Workload, the Workload for our finalizer
        if view is not None and view.deleting and not observed.pods and kueue.FINALIZER in _finalizers(body or {}):
            return Plan(actions=(_release(body or {}),))
        return Plan()
    if job.status.terminal or job.spec is None:
        return _finish(plan(job, observed, now), job, observed, body, view, now)
    d = Draft(job, now)
    try:
        queue = kueue.queue_name(job.labels)
    except kueue.KueueError as exc:
        fail(d, observed, reason="InvalidQueueName", message=str(exc))  # its one Warning: Failed, as any failure's
        return d.build()
    suspended = job.spec.run_policy.suspend
    if not kq.installed:
        _wait(d, observed, "KueueNotInstalled",
              f"the job is labelled {kueue.LABEL_QUEUE_NAME}={queue}, but Kueue's Workload API "
              f"({kueue.API_VERSION}) is not served: no pod starts until Kueue is installed")
        d.requeue = WAIT_POLL_SECONDS
        return d.build()
    if body is None or view is None:
        if kq.priority_error:
            _wait(d, observed, "PriorityClassNotFound", kq.priority_error)
            d.requeue = WAIT_POLL_SECONDS
            return d.build()
        if suspended:
            result = plan(job, observed, now)
            return replace(result, actions=(CreateWorkload(kq.priority),) + result.actions)
        _wait(d, observed, "WorkloadCreated", f"waiting for Kueue to admit the job in LocalQueue {queue}")
        d.before.append(CreateWorkload(kq.priority))
        return d.build()
    if view.deleting:  # deleted by hand: stop the gang, let the Workload go, then a new one is created
        _wait(d, observed, "WorkloadDeleted", f"Workload {view.name} was deleted: stopping the pods, "
                                              "then queueing again")
        if not observed.pods and kueue.FINALIZER in _finalizers(body):
            d.after.append(_release(body))
        return d.build()
    # An inactive Workload of a job that is (or was just) suspended is the operator's own doing.
    deactivated = view.deactivated_by_kueue(suspended=suspended or job.status.phase == "Suspended")
    if deactivated is not None:
        message = f"Kueue deactivated Workload {view.name}: {deactivated.reason}: {deactivated.message}"
        fail(d, observed, reason="DeactivatedByKueue", message=excerpt(message))
        return d.build()
    if suspended:
        result = plan(job, observed, now)  # inactive: not in the queue
        result = _set_status(result, job, _left_queue(result.status or job.status, "Suspended",
                                                      "suspended: the Workload is inactive", now))
        return _with(result, _spec_patch(job, body, view, active=False) or _evicted_patch(body, view, observed, now))
    patch = _spec_patch(job, body, view, active=True)
    changed = _podsets(job, body) is not None
    if view.evicted is not None or not view.admitted or (not view.active and changed):
        if not view.active and changed:  # queued again for a changed gang (below), or resumed after a resize
            reason, message = OUTDATED, _outdated(job, body)
        elif view.evicted is not None and (view.quota_reserved or observed.pods or view.pending is None):
            reason, message = view.evicted.reason or kueue.EVICTED, view.evicted.message
        elif view.pending is not None:
            reason, message = view.pending.reason or kueue.PENDING, view.pending.message
        elif view.quota_reserved:
            reason, message = kueue.QUOTA_RESERVED, "quota reserved, waiting for the admission checks"
        else:
            reason, message = kueue.PENDING, f"waiting for Kueue to admit the job in LocalQueue {queue}"
        _wait(d, observed, reason, message)
        return _with(d.build(), patch or _evicted_patch(body, view, observed, now))
    if changed and _next_attempt_due(job, now):
        # Admitted for another gang: the next attempt must not start under it. Deactivated once no pod is left
        # (the quota stays held while pods exist); the branch above then clears the admission and activates it
        # again with the new podSets in one write, which Kueue's webhook accepts once nothing is reserved.
        _wait(d, observed, OUTDATED, _outdated(job, body))
        return _with(d.build(), None if observed.pods else _deactivate(body))
    if view.topology_assigned:
        _wait(d, observed, "TopologyUnsupported", "Kueue assigned a topology (topology-aware scheduling), "
                                                  "which kubetrain does not support: no pod starts")
        return d.build()
    try:
        info = kueue_admission.pod_set_info(view, kq.flavors)
    except kueue.KueueError as exc:
        _wait(d, observed, "AdmissionUnusable", str(exc))
        d.requeue = WAIT_POLL_SECONDS
        return d.build()
    result = plan(job, observed, now)
    status = _left_queue(result.status or job.status, kueue.ADMITTED, f"admitted by ClusterQueue {view.cluster_queue}",
                         now)
    actions = tuple(replace(a, admission=info) if isinstance(a, CreatePod) else a for a in result.actions)
    result = _set_status(replace(result, actions=actions), job, status)
    all_ready = status.phase == "Running" and status.nodes_total > 0 and status.nodes_ready >= status.nodes_total
    ready = kueue.pods_ready_condition(admitted=True, all_ready=all_ready, current=view.pods_ready)
    if patch is None and not _same(view.pods_ready, ready):
        patch = _status_patch(body, now, {kueue.PODS_READY: ready})
    return _with(result, patch)


def rejected_plan(job: Job, now: dt.datetime, *, reason: str, message: str, create: bool, first: bool) -> Plan:
    """A write of the job's Workload refused for a reason that can pass (an admission webhook on Workloads that the
    API server cannot call, Kueue's own when it is down): shown on the job while the operator waits with backoff,
    as for a refused pod. A job waiting for its Workload's create waits in phase Queued with Queued=True and the
    API server's message, and a Warning event when they change. A refused patch comes after the job's status (or
    is the whole plan) and changes nothing on the job: a Warning event on the first refusal in a row (`first`)."""
    d = Draft(job, now)
    text = excerpt(message)
    said = f"the API server refused the Workload's {'create' if create else 'update'}: {text}; retrying with backoff"
    if create and job.status.phase in ("", QUEUED) and job.spec is not None and not job.spec.run_policy.suspend:
        current = d.status.condition(QUEUED)
        if current is None or current.status != "True" or current.reason != reason \
                or message_shape(current.message) != message_shape(text):
            d.event("Warning", reason, said)
            d.cond(QUEUED, "True", reason, text)
            d.update(phase=QUEUED, message=f"queued: {reason}: {text}")
        return d.build()
    # Events only: the job as read may be older than the status its plan wrote before the refused patch.
    return Plan(events=(Event("Warning", reason, said),) if first else ())


# ------------------------------------------------------------------ the job's side

def _left_queue(status: Status, reason: str, message: str, now: dt.datetime) -> Status:
    """`status` with Queued=False for `reason` if it said True (admitted, suspended)."""
    cond = status.condition(QUEUED)
    if cond is None or cond.status != "True":
        return status
    return status.with_condition(QUEUED, "False", reason=reason, message=message, now=now)


def _wait(d: Draft, observed: Observed, reason: str, message: str) -> None:
    """The job waits for Kueue: phase Queued with Kueue's reason and message; a gang that exists
    (admission lost, evicted, Workload deleted) is stopped gracefully and counts as a preemption."""
    text = excerpt(message)
    if d.status.phase in STARTED_PHASES and d.status.attempt >= 1:
        d.update(preemptions=d.status.preemptions + 1, nodes_ready=0)
        d.event("Warning", "Preempted", f"attempt {d.status.attempt}: {reason}: {text}; its pods are deleted and "
                                        "the job waits in its queue (no backoff spent)", cause=reason)
        if d.status.condition("Running"):
            d.cond("Running", "False", reason, text)
    if d.status.phase == "Suspended":
        d.cond("Suspended", "False", "Resumed", "the job was resumed")
        d.event("Normal", "Resumed", "resumed: queued in Kueue")
        d.update(start_time=None)
    current = d.status.condition(QUEUED)
    if current is None or current.status != "True" or current.reason != reason:
        d.event("Normal", QUEUED, f"{reason}: {text}")
    d.cond(QUEUED, "True", reason, text)
    if (restarting := d.status.condition("Restarting")) is not None and restarting.status == "True":
        d.cond("Restarting", "False", reason, f"waiting in the queue: {text}")
    # A backoff still to run (after a failure) is kept: the next admission waits for it, as without Kueue.
    backoff = parse_time(d.status.next_attempt_time)
    d.update(phase=QUEUED, message=f"queued: {reason}: {text}", nodes_ready=0,
             next_attempt_time=d.status.next_attempt_time if backoff is not None and backoff > d.now else None)
    delete_pods(d, observed, observed.pods)


def _next_attempt_due(job: Job, now: dt.datetime) -> bool:
    """No attempt is under way (between attempts, or none yet) and the next one may start now (its backoff,
    if any, has passed): the point at which `plan.plan` would create pods from the current spec."""
    status = job.status
    if status.attempt >= 1 and status.phase in STARTED_PHASES:
        return False
    ready_at = parse_time(status.next_attempt_time)
    return ready_at is None or now >= ready_at


def _outdated(job: Job, body: Mapping[str, Any]) -> str:
    assert job.spec is not None
    stored = [ps.get("count") for ps in (body.get("spec") or {}).get("podSets") or ()]
    what = (f"spec.nodes {stored[0]} -> {job.spec.nodes}" if stored and stored[0] != job.spec.nodes
            else "the pods' resources")
    return (f"the gang changed since Kueue admitted it ({what}): no attempt starts under the old admission; "
            "the Workload is queued again for the new gang")


def _set_status(result: Plan, job: Job, status: Status) -> Plan:
    if status == (result.status or job.status):
        return result
    patch = PatchStatus(status)
    if result.status is not None:
        return replace(result, actions=tuple(patch if isinstance(a, PatchStatus) else a for a in result.actions))
    return replace(result, actions=(patch,) + result.actions)


def _with(result: Plan, patch: PatchWorkload | None) -> Plan:
    """Append a Workload write (after the job's status: the intent is recorded first)."""
    return result if patch is None else replace(result, actions=result.actions + (patch,))


def _finish(result: Plan, job: Job, observed: Observed, body: Mapping[str, Any] | None,
            view: kueue.WorkloadView | None, now: dt.datetime) -> Plan:
    """A finished job: Finished=True on the Workload (Kueue releases the quota), then, once no pod
    is left, the finalizer goes (the Workload is deleted with the job)."""
    if body is None or view is None:
        return result
    status = result.status or job.status
    if view.finished is None:
        succeeded = status.phase == "Succeeded"
        cond = kueue.Condition("True", kueue.FINISHED_SUCCEEDED if succeeded else kueue.FINISHED_FAILED,
                               excerpt(status.message) or f"the job {status.phase.lower()}")
        return _with(result, _status_patch(body, now, {kueue.FINISHED: cond}))
    if not any(p.active for p in observed.pods) and kueue.FINALIZER in _finalizers(body):
        return _with(result, _release(body))
    return result


# ------------------------------------------------------------------ the Workload's side

def _evicted_patch(body: Mapping[str, Any], view: kueue.WorkloadView, observed: Observed,
                   now: dt.datetime) -> PatchWorkload | None:
    """Once no pod of an evicted (or no longer admitted) job is left, clear its admission as Kueue's
    integrations do: QuotaReserved=False/Pending, Admitted=False/NoReservation, Requeued; Kueue then
    queues it again. Nothing while pods remain or nothing is reserved."""
    if observed.pods or not (view.quota_reserved or view.admitted or view.assignments):
        return None
    evicted = view.evicted
    message = evicted.message if evicted is not None else "The workload has no reservation"
    conds = {kueue.QUOTA_RESERVED: kueue.Condition("False", kueue.PENDING, message),
             kueue.ADMITTED: kueue.Condition("False", "NoReservation", "The workload has no reservation")}
    if evicted is not None:
        conds[kueue.REQUEUED] = kueue.Condition("True", evicted.reason or kueue.EVICTED, message)
    return _status_patch(body, now, conds, clear_admission=True)


def _status_patch(body: Mapping[str, Any], now: dt.datetime, conds: Mapping[str, kueue.Condition], *,
                  clear_admission: bool = False) -> PatchWorkload:
    """The whole conditions list with `conds` set (lastTransitionTime moves only with the status)."""
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    out: list[dict[str, Any]] = []
    for raw in status.get("conditions") or ():
        new = conds.get(str(raw.get("type")))
        out.append(dict(raw) if new is None else _condition(raw.get("type"), new, raw, now))
    have = {str(raw.get("type")) for raw in status.get("conditions") or ()}
    out += [_condition(kind, cond, None, now) for kind, cond in conds.items() if kind not in have]
    patch: dict[str, Any] = {"conditions": out}
    if clear_admission:
        patch["admission"] = None
    return PatchWorkload(name=str(meta.get("name") or ""), resource_version=str(meta.get("resourceVersion") or ""),
                         status=patch)


def _condition(kind: Any, cond: kueue.Condition, old: Mapping[str, Any] | None, now: dt.datetime) -> dict[str, Any]:
    moved = old is None or old.get("status") != cond.status
    return {"type": str(kind), "status": cond.status, "reason": cond.reason, "message": cond.message,
            "lastTransitionTime": format_time(now) if moved else old.get("lastTransitionTime") or format_time(now)}


def _spec_patch(job: Job, body: Mapping[str, Any], view: kueue.WorkloadView, *, active: bool) -> PatchWorkload | None:
    """spec.active as the job's suspend asks and, while nothing is reserved (suspended, queued), the podSets
    when the gang changed meanwhile (its size or its pods' resources: what the quota counts); None when
    the Workload agrees. A changed gang's Workload is not activated while it still holds a reservation
    (for the old gang): it is, with the new podSets in the same write, once that reservation is cleared."""
    changes: dict[str, Any] = {"active": active} if view.active != active else {}
    podsets = _podsets(job, body)
    if not view.quota_reserved and not view.admitted:
        if podsets is not None:
            changes["podSets"] = podsets
    elif active and podsets is not None:
        changes = {}  # reactivated with the new podSets once the reservation for the old gang is gone
    if not changes:
        return None
    meta = body.get("metadata") or {}
    # The mark that tells the operator's own deactivation from Kueue's goes in the same write.
    marks = {kueue.ANNOTATION_SUSPENDED: None if active else "true"} if "active" in changes else None
    return PatchWorkload(name=str(meta.get("name") or ""), resource_version=str(meta.get("resourceVersion") or ""),
                         spec=changes, annotations=marks)


def _deactivate(body: Mapping[str, Any]) -> PatchWorkload:
    """spec.active=false, marked as the operator's own doing (as for a suspend): Kueue evicts the Workload and
    never admits it while inactive, so it cannot be admitted again for the old gang meanwhile."""
    meta = body.get("metadata") or {}
    return PatchWorkload(name=str(meta.get("name") or ""), resource_version=str(meta.get("resourceVersion") or ""),
                         spec={"active": False}, annotations={kueue.ANNOTATION_SUSPENDED: "true"})


def _podsets(job: Job, body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The job's podSets when they differ from the Workload's in what Kueue counts, else None."""
    assert job.spec is not None
    wanted = [{"name": kueue.PODSET_NAME, "count": job.spec.nodes, "template": kueue.podset_template(job)}]
    stored = (body.get("spec") or {}).get("podSets") or []
    return None if _counted(stored) == _counted(wanted) else wanted


def _counted(podsets: Any) -> list[tuple[Any, ...]]:
    """What Kueue counts of podSets, with quantities as numbers: Kueue's webhook stores a created Workload in
    canonical form (cpu: 4 as "4", 16384Mi as "16Gi"), which must not read as a changed gang."""
    return [(ps.get("name"), ps.get("count"),
             [_numbers(c.get("resources") or {})
              for c in ((ps.get("template") or {}).get("spec") or {}).get("containers") or ()])
            for ps in podsets]


def _numbers(resources: Mapping[str, Any]) -> dict[str, Any]:
    """Quantities as numbers; an empty requests/limits map is left out (Kueue stores none: omitempty)."""
    return {which: {name: quantity_value(v) for name, v in amounts.items()} if isinstance(amounts, Mapping)
            else amounts for which, amounts in resources.items() if amounts}


def _release(body: Mapping[str, Any]) -> PatchWorkload:
    meta = body.get("metadata") or {}
    return PatchWorkload(name=str(meta.get("name") or ""), resource_version=str(meta.get("resourceVersion") or ""),
                         remove_finalizer=True)


def _finalizers(body: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple((body.get("metadata") or {}).get("finalizers") or ())


def _same(current: kueue.Condition | None, new: kueue.Condition) -> bool:
    return current is not None and current.status == new.status and current.reason == new.reason
