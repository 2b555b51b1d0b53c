"""The reconcile logic, as a pure function: (job, observed, now) -> Plan.

No I/O happens here: `k8s.py` carries out the actions, `handlers.py` feeds the
observations. Everything the operator decides (when a gang starts, which pod
failure is a preemption and which one spends `backoffLimit`, when a job is
done) is decided in this file and table-tested in tests/unit/operator.

State lives in the job's status only, and the status is written as an
*intent* before destructive actions: a restart first records `Restarting`
(with the counters already moved) and then deletes pods, so an operator
killed between the two resumes the deletion instead of counting again.
A new attempt is recorded after its pods were created: `status.attempt == N`
with phase Pending/Running means every pod of attempt N was created, so a
missing pod of a started attempt was deleted by someone else.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Mapping

from kubetrain.identity import describe
from kubetrain.api import (
    ANNOTATION_CHECKPOINT_SYNC, ANNOTATION_LAST_CHECKPOINT, CONTAINER_NAME, EXIT_INVALID_CONFIG, EXIT_PREEMPTED,
    FAILURE_CODE, FAILURE_REASONS, FAILURE_RECORD_KIND, LABEL_ATTEMPT, LABEL_RANK, MAX_URI_LENGTH, METRICS_PORT_NAME,
    STARTED_PHASES, Job, LastCheckpoint, Status, format_time, parse_time, parse_time_or_none, pod_name, redact,
)
from kubetrain.progress import ProgressObservation, lagging_message, next_progress, usable_checkpoint

FATAL_WAITING_REASONS = frozenset({"InvalidImageName", "ErrImageNeverPull"})
"""Container waiting reasons that can never resolve by themselves: fail at once."""

TRANSIENT_WAITING_REASONS = frozenset({
    "ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError", "CreateContainerError",
})
"""Container waiting reasons that may resolve by themselves (a registry rate limit while a
preempted gang pulls on new nodes, a Secret its controller writes moments after the job):
the kubelet retries, and the job fails only once one persists for runPolicy.startupGraceSeconds."""

SELF_INFLICTED_EVICTION = re.compile(
    r"exceeds the total limit of containers|Usage of EmptyDir volume .* exceeds the limit"
    r"|exceeded its local ephemeral storage limit|has larger consumption of")
"""Kubelet eviction messages that blame the pod itself (it overused ephemeral storage beyond
its limits, or memory/storage beyond its requests under node pressure): an application
failure that spends backoffLimit, not a preemption (restarting would only repeat it)."""

CHECKPOINT_RECORD_KIND = "kubetrain.io/last-checkpoint"
"""The `kind` of the trainer's last-checkpoint record (docs/contract.md); anything else in a
termination message or annotation (a log tail, a user's JSON line) is never read as one."""

DISRUPTION_POD_REASONS = frozenset({
    "Evicted", "Preempting", "Shutdown", "NodeShutdown", "Terminated", "NodeLost",
    "UnexpectedAdmissionError",
})
"""`pod.status.reason` values the node or the cluster set when it took the pod away."""

STUCK_DELETION_SLACK_SECONDS = 30
"""A pod still present this long after its deletionTimestamp is force-deleted."""


# --------------------------------------------------------------- observations

@dataclass(frozen=True)
class PodView:
    """What the planner reads from one pod of a job."""

    name: str
    attempt: int
    rank: int
    phase: str = "Pending"
    deletion_timestamp: dt.datetime | None = None
    disruption: str | None = None
    """Reason of a DisruptionTarget=True condition (PreemptionByScheduler, EvictionByEvictionAPI...)."""
    reason: str = ""
    """`pod.status.reason` (Evicted, NodeLost...)."""
    status_message: str = ""
    """`pod.status.message` (the kubelet's eviction message...)."""
    starting_since: dt.datetime | None = None
    """When the pod was bound to its node (else created): the start of its startup window."""
    exit_code: int | None = None
    termination_message: str = ""
    waiting_reason: str | None = None
    waiting_message: str = ""
    node_name: str | None = None
    ready: bool = False
    ready_changed: dt.datetime | None = None
    checkpoint: LastCheckpoint | None = None
    failure: TrainerFailure | None = None
    """Why the trainer exited 82, from the failure record in its termination message, if any."""
    checkpoint_sync: str = ""
    """Why checkpoint uploads lag behind (annotation kubetrain.io/checkpoint-sync), if they do."""
    pod_ip: str | None = None
    metrics_port: int | None = None
    """The trainer container's port named `metrics` (its /progress endpoint), if it has one."""

    @property
    def terminating(self) -> bool:
        return self.deletion_timestamp is not None

    @property
    def active(self) -> bool:
        """Still holding (or waiting for) resources: worth deleting."""
        return self.phase not in ("Succeeded", "Failed")

    @classmethod
    def from_storage(cls, body: Mapping[str, Any]) -> "PodView | None":
        """Parse a pod dict; None when it lacks the kubetrain labels."""
        meta = body.get("metadata") or {}
        labels = meta.get("labels") or {}
        try:
            attempt, rank = int(labels[LABEL_ATTEMPT]), int(labels[LABEL_RANK])
        except (KeyError, TypeError, ValueError):
            return None
        status = body.get("status") or {}
        disruption = ready_changed = None
        starting_since = parse_time_or_none(meta.get("creationTimestamp"))
        ready = False
        for cond in status.get("conditions") or ():
            if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
                disruption = cond.get("reason") or "DisruptionTarget"
            elif cond.get("type") == "PodScheduled" and cond.get("status") == "True":
                starting_since = parse_time_or_none(cond.get("lastTransitionTime")) or starting_since
            elif cond.get("type") == "Ready":
                ready = cond.get("status") == "True"
                ready_changed = parse_time_or_none(cond.get("lastTransitionTime"))
        exit_code, message, waiting, waiting_message = None, "", None, ""
        statuses = status.get("containerStatuses") or ()
        trainer = next((c for c in statuses if c.get("name") == CONTAINER_NAME), statuses[0] if statuses else {})
        state = trainer.get("state") or {}
        if state.get("terminated"):
            exit_code = state["terminated"].get("exitCode")
            message = state["terminated"].get("message") or ""
        if state.get("waiting"):
            waiting = state["waiting"].get("reason")
            waiting_message = state["waiting"].get("message") or ""
        checkpoint = parse_checkpoint_record((meta.get("annotations") or {}).get(ANNOTATION_LAST_CHECKPOINT))
        message_ckpt = parse_checkpoint_record(message)
        if message_ckpt and (checkpoint is None or message_ckpt.step > checkpoint.step):
            checkpoint = message_ckpt
        failure = parse_failure_record(message)
        return cls(
            name=meta.get("name") or "", attempt=attempt, rank=rank,
            phase=status.get("phase") or "Pending",
            deletion_timestamp=parse_time_or_none(meta.get("deletionTimestamp")),
            disruption=disruption, reason=str(status.get("reason") or ""),
            status_message=str(status.get("message") or ""), starting_since=starting_since,
            exit_code=exit_code if isinstance(exit_code, int) and not isinstance(exit_code, bool) else None,
            termination_message="" if message_ckpt or failure else str(message),
            waiting_reason=waiting, waiting_message=waiting_message,
            node_name=(body.get("spec") or {}).get("nodeName") or None,
            ready=ready, ready_changed=ready_changed, checkpoint=checkpoint, failure=failure,
            checkpoint_sync=str((meta.get("annotations") or {}).get(ANNOTATION_CHECKPOINT_SYNC) or ""),
            pod_ip=status.get("podIP") or None, metrics_port=_metrics_port(body),
        )


def _metrics_port(body: Mapping[str, Any]) -> int | None:
    containers = (body.get("spec") or {}).get("containers") or ()
    trainer = next((c for c in containers if c.get("name") == CONTAINER_NAME), {})
    port = next((p.get("containerPort") for p in trainer.get("ports") or () if p.get("name") == METRICS_PORT_NAME), None)
    return port if isinstance(port, int) and not isinstance(port, bool) else None


MAX_RECORD_BYTES = 4096
"""A last-checkpoint record is one short JSON line; anything longer is not one."""


def parse_checkpoint_record(text: Any) -> LastCheckpoint | None:
    """The trainer's last-checkpoint record, or None. The whole text must be one JSON object
    of kind CHECKPOINT_RECORD_KIND with a valid step, an s3:// uri and an RFC 3339 time: pods
    write this text, so a value the status schema would refuse (and a log line that merely
    looks like JSON) never reaches a status patch."""
    raw = _record_of_kind(text, CHECKPOINT_RECORD_KIND)
    return None if raw is None else LastCheckpoint.from_storage(raw)


def _record_of_kind(text: Any, kind: str) -> dict[str, Any] | None:
    """A pod's record: the whole text one JSON object of `kind`, at most MAX_RECORD_BYTES; else None."""
    if not text or not isinstance(text, str) or len(text) > MAX_RECORD_BYTES:
        return None
    try:
        raw = json.loads(text.strip())
    except ValueError:
        return None
    return raw if isinstance(raw, dict) and raw.get("kind") == kind else None


@dataclass(frozen=True)
class TrainerFailure:
    """A pod's failure record (docs/contract.md, "Reporting a failure"), every field validated."""

    reason: str
    """One of api.FAILURE_REASONS: the Failed condition's reason."""
    code: str | None = None
    """The store's error code (AccessDenied...), matching api.FAILURE_CODE."""
    where: str | None = None
    """The checkpoint location the store refused: an s3:// URI with nothing secret-shaped in it."""


def parse_failure_record(text: Any) -> TrainerFailure | None:
    """The trainer's failure record, or None. Like the last-checkpoint record, the whole text must
    be one JSON object of kind FAILURE_RECORD_KIND, and it may hold nothing but `reason` (from the
    fixed set), `code` and `where`: any other key or any value out of shape refuses all of it, so
    only words the operator chose, a short code and a location reach status and events."""
    raw = _record_of_kind(text, FAILURE_RECORD_KIND)
    if raw is None or not set(raw) <= {"kind", "reason", "code", "where"}:
        return None
    reason, code, where = raw.get("reason"), raw.get("code"), raw.get("where")
    if not isinstance(reason, str) or reason not in FAILURE_REASONS:
        return None
    if code is not None and not (isinstance(code, str) and FAILURE_CODE.match(code)):
        return None
    if where is not None and not (isinstance(where, str) and where.startswith("s3://") and len(where) <= MAX_URI_LENGTH
                                  and all(c.isprintable() and not c.isspace() for c in where)
                                  and redact(where) == where):
        return None
    return TrainerFailure(reason=reason, code=code, where=where)


@dataclass(frozen=True)
class NodeView:
    """A node's health as far as a gang cares."""

    name: str
    ready: bool = True
    exists: bool = True
    since: dt.datetime | None = None
    """When it stopped being Ready (or was first seen missing)."""


@dataclass(frozen=True)
class Observed:
    """Everything observed about one job besides the job itself."""

    pods: tuple[PodView, ...] = ()
    nodes: Mapping[str, NodeView] = field(default_factory=dict)
    """Nodes the pods are bound to; a pod's node absent here is assumed healthy."""
    gone: Mapping[str, str] = field(default_factory=dict)
    """Why pods that no longer exist went away (their last DisruptionTarget reason), by name."""
    progress: ProgressObservation | None = None
    """The newest poll of node rank 0's /progress endpoint (poller.py), if any."""


# -------------------------------------------------------------------- actions

@dataclass(frozen=True)
class CreateService:
    """Create the headless Service `<job>` (AlreadyExists is success)."""


@dataclass(frozen=True)
class EnsureDeepSpeedConfigMap:
    """Create or update ConfigMap `<job>-deepspeed` from the inline DeepSpeed config."""


@dataclass(frozen=True)
class CreatePod:
    attempt: int
    rank: int


@dataclass(frozen=True)
class DeletePod:
    name: str
    force: bool = False
    """Grace period 0: the pod's node is gone and will never confirm the deletion."""


@dataclass(frozen=True)
class PatchStatus:
    status: Status


@dataclass(frozen=True)
class DeleteJob:
    """ttlSecondsAfterFinished has passed."""


Action = CreateService | EnsureDeepSpeedConfigMap | CreatePod | DeletePod | PatchStatus | DeleteJob


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str
    cause: str = ""
    """Machine-readable why, for metrics (a Preempted event's cause: PreemptionByScheduler...)."""


@dataclass(frozen=True)
class Plan:
    """Actions to apply in order, events to post once the status is written, and
    when to look again even if nothing changes (backoff, deadlines, grace periods)."""

    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None

    @property
    def status(self) -> Status | None:
        return next((a.status for a in self.actions if isinstance(a, PatchStatus)), None)


# ----------------------------------------------------------------- the planner

class _Draft:
    """Accumulates one plan. Local to `plan()`; only frozen values leave it."""

    def __init__(self, job: Job, now: dt.datetime) -> None:
        self.job, self.now = job, now
        self.status = job.status
        self.before: list[Action] = []
        self.after: list[Action] = []
        self.events: list[Event] = []
        self.requeue: float | None = None

    def event(self, type_: Literal["Normal", "Warning"], reason: str, message: str, cause: str = "") -> None:
        self.events.append(Event(type_, reason, message, cause))

    def wake_at(self, when: dt.datetime) -> None:
        delay = max(0.0, (when - self.now).total_seconds())
        self.requeue = delay if self.requeue is None else min(self.requeue, delay)

    def cond(self, type_: str, status: Literal["True", "False"], reason: str, message: str = "") -> None:
        self.status = self.status.with_condition(type_, status, reason=reason, message=message, now=self.now)

    def update(self, **changes: Any) -> None:
        self.status = replace(self.status, **changes)

    def delete(self, pod: PodView, *, force: bool = False) -> None:
        if any(isinstance(a, DeletePod) and a.name == pod.name for a in self.after):
            return
        self.after.append(DeletePod(pod.name, force=force))

    def build(self) -> Plan:
        status = self.status
        if status != self.job.status:  # Ready follows what changed (and costs no write of its own)
            status = ready_condition(status, self.now)
        if status != self.job.status or (status.phase and status.observed_generation != self.job.generation):
            status = replace(status, observed_generation=self.job.generation, conditions=tuple(
                replace(c, observed_generation=self.job.generation) for c in status.conditions))
        patch = (PatchStatus(status),) if status != self.job.status else ()
        return Plan(actions=tuple(self.before) + patch + tuple(self.after),
                    events=tuple(self.events), requeue_after=self.requeue)


def ready_condition(status: Status, now: dt.datetime) -> Status:
    """Condition Ready, derived from the phase: True while every pod of the attempt runs and is
    ready, False otherwise with the phase as the reason (what `kubectl wait --for=condition=Ready`
    and dashboards read)."""
    if not status.phase:
        return status
    ready = status.phase == "Running" and status.nodes_total > 0 and status.nodes_ready >= status.nodes_total
    reason = "AllPodsReady" if ready else "PodsNotReady" if status.phase == "Running" else status.phase
    message = (f"{status.nodes_ready} of {status.nodes_total} pod(s) ready" if status.phase in ("Running", "Pending")
               else f"the job is {status.phase}")
    return status.with_condition("Ready", "True" if ready else "False", reason=reason, message=message, now=now)


def plan(job: Job, observed: Observed, now: dt.datetime) -> Plan:
    """Decide what to do about one TrainingJob. Pure and deterministic."""
    if job.deleting:
        return Plan()
    d = _Draft(job, now)
    newest = _newest_checkpoint(job, observed)
    if newest != job.status.last_checkpoint:
        d.update(last_checkpoint=newest)
    if observed.progress is not None and observed.progress.attempt == job.status.attempt and not job.status.terminal:
        d.update(progress=next_progress(job.status.progress, observed.progress))
    if job.status.terminal:
        _finished(d, observed)
        return d.build()
    if job.spec is None:
        _fail(d, observed, reason="InvalidSpec", message=job.spec_error or "invalid spec")
        return d.build()
    policy = job.spec.run_policy
    deadline = _deadline(job)
    if deadline is not None and not policy.suspend and job.status.phase != "Suspended":
        if now >= deadline:
            msg = f"activeDeadlineSeconds={policy.active_deadline_seconds} exceeded"
            d.event("Warning", "DeadlineExceeded", msg)
            _fail(d, observed, reason="DeadlineExceeded", message=msg)
            return d.build()
        d.wake_at(deadline)
    if policy.suspend:
        _suspend(d, observed)
        return d.build()
    if job.status.phase == "Suspended":
        d.update(phase="Restarting", next_attempt_time=format_time(now), start_time=None,
                 message=f"resumed: starting attempt {job.status.attempt + 1}")
        d.cond("Suspended", "False", "Resumed", "the job was resumed")
        d.cond("Restarting", "True", "Resumed", "starting a new attempt after suspension")
        d.event("Normal", "Resumed", f"resumed: starting attempt {job.status.attempt + 1}")
    started = d.status.attempt >= 1 and d.status.phase in STARTED_PHASES
    if started:
        _supervise(d, observed)
    else:
        _start_next_attempt(d, observed)
    return d.build()


def _deadline(job: Job) -> dt.datetime | None:
    seconds = job.spec.run_policy.active_deadline_seconds if job.spec else None
    start = parse_time(job.status.start_time)
    if seconds is None or start is None:
        return None
    return start + dt.timedelta(seconds=seconds)


def _newest_checkpoint(job: Job, observed: Observed) -> LastCheckpoint | None:
    """The highest reported step, from records that point into this job's own storage prefix
    (a record elsewhere is not this job's checkpoint, whoever wrote it): the pods' termination
    messages and annotations, and rank 0's /progress."""
    best = job.status.last_checkpoint
    prefix = job.checkpoint_uri
    current = observed.progress if (observed.progress and observed.progress.attempt == job.status.attempt
                                    and not job.status.terminal) else None
    polled = usable_checkpoint(current.report if current else None, prefix)
    for ckpt in [pod.checkpoint for pod in observed.pods] + [polled]:
        if ckpt and prefix and ckpt.uri.startswith(prefix + "/") and (best is None or ckpt.step > best.step):
            best = ckpt
    return best


def _node_lost(pod: PodView, d: _Draft, observed: Observed) -> str | None:
    """Why the pod's node (or the pod itself) counts as lost; schedules a wake-up
    for the end of the grace period when it is not lost *yet*."""
    grace = dt.timedelta(seconds=d.job.spec.run_policy.node_lost_grace_seconds if d.job.spec else 60)
    node = observed.nodes.get(pod.node_name) if pod.node_name else None
    if node is not None and not (node.ready and node.exists):
        since = node.since or d.now
        if d.now >= since + grace:
            state = "was deleted" if not node.exists else "is NotReady"
            return f"node {node.name} {state} for more than {int(grace.total_seconds())}s"
        d.wake_at(since + grace)
    if pod.phase == "Unknown":
        since = pod.ready_changed or d.now
        if d.now >= since + grace:
            return f"pod {pod.name} is in phase Unknown for more than {int(grace.total_seconds())}s"
        d.wake_at(since + grace)
    return None


def _delete_pods(d: _Draft, observed: Observed, pods: list[PodView] | tuple[PodView, ...]) -> None:
    """Delete pods (finished ones too: a gang is gone only when all its pods are);
    force-delete terminating pods that are stuck (their node is gone)."""
    for pod in pods:
        if not pod.terminating:
            d.delete(pod, force=_node_lost_quiet(pod, d, observed))
        elif d.now >= pod.deletion_timestamp + dt.timedelta(seconds=STUCK_DELETION_SLACK_SECONDS) \
                or _node_lost_quiet(pod, d, observed):
            d.delete(pod, force=True)
        else:
            d.wake_at(pod.deletion_timestamp + dt.timedelta(seconds=STUCK_DELETION_SLACK_SECONDS))


def _node_lost_quiet(pod: PodView, d: _Draft, observed: Observed) -> bool:
    """The pod's node is deleted, or NotReady beyond the grace period: nobody will
    confirm a graceful deletion, so only a forced one makes the pod go away."""
    node = observed.nodes.get(pod.node_name) if pod.node_name else None
    if node is None or (node.ready and node.exists):
        return False
    if not node.exists:
        return True
    grace = d.job.spec.run_policy.node_lost_grace_seconds if d.job.spec else 60
    return d.now >= (node.since or d.now) + dt.timedelta(seconds=grace)


def _fail(d: _Draft, observed: Observed, *, reason: str, message: str) -> None:
    d.update(phase="Failed", message=message, completion_time=format_time(d.now),
             next_attempt_time=None, nodes_ready=0)
    d.cond("Failed", "True", reason, message)
    if d.status.condition("Running"):
        d.cond("Running", "False", reason, message)
    if d.status.condition("Restarting"):
        d.cond("Restarting", "False", reason, message)
    d.event("Warning", "Failed", message)
    for pod in observed.pods:
        if pod.active and not pod.terminating:
            d.delete(pod)
    _ttl(d)


def _ttl(d: _Draft) -> None:
    ttl = d.job.spec.run_policy.ttl_seconds_after_finished if d.job.spec else None
    finished = parse_time(d.status.completion_time)
    if ttl is None or finished is None:
        return
    expiry = finished + dt.timedelta(seconds=ttl)
    if d.now >= expiry:
        d.after.append(DeleteJob())
    else:
        d.wake_at(expiry)


def _finished(d: _Draft, observed: Observed) -> None:
    for pod in observed.pods:
        if pod.active and not pod.terminating:
            d.delete(pod)
    _ttl(d)


def _suspend(d: _Draft, observed: Observed) -> None:
    if d.status.phase != "Suspended":
        d.update(phase="Suspended", message="suspended: pods deleted, the job is kept",
                 nodes_ready=0, next_attempt_time=None)
        d.cond("Suspended", "True", "Suspended", "spec.runPolicy.suspend is true")
        if d.status.condition("Running"):
            d.cond("Running", "False", "Suspended", "suspended")
        d.event("Normal", "Suspended", f"suspended at attempt {d.status.attempt}: deleting its pods")
    _delete_pods(d, observed, observed.pods)


def _start_next_attempt(d: _Draft, observed: Observed) -> None:
    spec = d.job.spec
    assert spec is not None
    attempt = d.status.attempt + 1
    blocking = [p for p in observed.pods if p.attempt != attempt or p.terminating]
    if blocking:
        # Attempts never overlap: the old gang must be gone before the new one starts.
        _delete_pods(d, observed, blocking)
        if d.status.phase != "Restarting":
            d.update(phase="Restarting")
        d.update(message=f"waiting for {len(blocking)} pod(s) of the previous attempt to be gone")
        return
    ready_at = parse_time(d.status.next_attempt_time)
    if ready_at is not None and d.now < ready_at:
        d.wake_at(ready_at)
        return
    existing = {p.rank for p in observed.pods if p.attempt == attempt}
    d.before.append(CreateService())
    if spec.strategy.type == "zero3" and spec.strategy.deepspeed_config is not None:
        d.before.append(EnsureDeepSpeedConfigMap())
    for rank in range(spec.nodes):
        if rank not in existing:
            d.before.append(CreatePod(attempt=attempt, rank=rank))
    d.update(
        phase="Pending", attempt=attempt, restarts=d.status.restarts + (1 if attempt > 1 else 0),
        start_time=d.status.start_time or format_time(d.now), completion_time=None,
        next_attempt_time=None, nodes_total=spec.nodes, nodes_ready=0,
        message=f"attempt {attempt}: {spec.nodes} pod(s) created, waiting for them to run",
    )
    # Which identity the pods present to checkpoint storage (never a credential: names only).
    identity = f"; checkpoint identity: {describe(spec.checkpoint.identity)}" if spec.checkpoint else ""
    d.cond("Created", "True", "PodsCreated", f"attempt {attempt}: {spec.nodes} pod(s) created{identity}")
    d.cond("Running", "False", "PodsPending", f"attempt {attempt}: waiting for pods to run")
    if attempt > 1 or d.status.condition("Restarting"):
        d.cond("Restarting", "False", "AttemptStarted", f"attempt {attempt} started")
    d.event("Normal", "Created", f"attempt {attempt}: created {spec.nodes} pod(s) "
                                 f"{pod_name(d.job.name, attempt, 0)}..{pod_name(d.job.name, attempt, spec.nodes - 1)}"
                                 + identity)


def _disruption(pod: PodView, d: _Draft, observed: Observed) -> tuple[str, str] | None:
    """(cause, why) when this pod was taken away by the cluster (not by the user's code). The
    cause is a CamelCase word for metrics: the DisruptionTarget reason, the pod's reason,
    Deleted, TrainerPreempted, NoExitCode or NodeLost."""
    if pod.phase == "Succeeded" or _evicted_for_own_usage(pod):
        return None
    if pod.disruption:
        return pod.disruption, f"pod {pod.name}: {pod.disruption}"
    if pod.terminating:
        return "Deleted", f"pod {pod.name} was deleted by someone else"
    if pod.phase == "Failed":
        if pod.exit_code == EXIT_PREEMPTED:
            return "TrainerPreempted", f"pod {pod.name} exited with code {EXIT_PREEMPTED} (preempted)"
        if pod.reason in DISRUPTION_POD_REASONS:
            return pod.reason, f"pod {pod.name}: {pod.reason}"
        if pod.exit_code is None:
            return "NoExitCode", f"pod {pod.name} failed without an exit code ({pod.reason or 'no reason'})"
    lost = _node_lost(pod, d, observed)
    return ("NodeLost", lost) if lost else None


def _evicted_for_own_usage(pod: PodView) -> bool:
    return pod.phase == "Failed" and pod.reason == "Evicted" and bool(SELF_INFLICTED_EVICTION.search(pod.status_message))


def _startup_problem(d: _Draft, pod: PodView) -> tuple[str, str, dt.datetime] | None:
    """(reason, message, deadline) when the pod fails to start for a possibly transient reason."""
    if pod.waiting_reason not in TRANSIENT_WAITING_REASONS:
        return None
    grace = d.job.spec.run_policy.startup_grace_seconds if d.job.spec else 0
    since = pod.starting_since or parse_time(d.status.start_time) or d.now
    detail = _excerpt(pod.waiting_message)
    message = f"pod {pod.name}: {pod.waiting_reason}" + (f": {detail}" if detail else "")
    return pod.waiting_reason or "", message, since + dt.timedelta(seconds=grace)


def _supervise(d: _Draft, observed: Observed) -> None:
    """Watch a started attempt: classify failures, detect success and readiness."""
    spec = d.job.spec
    assert spec is not None
    attempt = d.status.attempt
    total = d.status.nodes_total or spec.nodes
    current = {p.rank: p for p in observed.pods if p.attempt == attempt and p.rank < total}
    stale = [p for p in observed.pods if p.attempt != attempt or p.rank >= total]

    fatal: tuple[str, str] | None = None
    disruptions: list[tuple[str, str]] = []
    failed: list[PodView] = []
    blocked: tuple[str, str, dt.datetime] | None = None
    for rank in range(total):
        pod = current.get(rank)
        if pod is None:
            name = pod_name(d.job.name, attempt, rank)
            why = observed.gone.get(name)
            disruptions.append((why, f"pod {name}: {why} (deleted)") if why else
                               ("Deleted", f"pod {name} was deleted by someone else"))
            continue
        if pod.phase == "Failed" and pod.exit_code == EXIT_INVALID_CONFIG:
            fatal = fatal or _invalid_configuration(d, pod)
        elif pod.waiting_reason in FATAL_WAITING_REASONS:
            detail = _excerpt(pod.waiting_message)
            fatal = fatal or (pod.waiting_reason or "", f"pod {pod.name}: {pod.waiting_reason}"
                                                        + (f": {detail}" if detail else ""))
        elif (problem := _startup_problem(d, pod)) is not None:
            reason, message, deadline = problem
            if d.now >= deadline:
                grace = d.job.spec.run_policy.startup_grace_seconds if d.job.spec else 0
                fatal = fatal or (reason, f"{message} (still failing after runPolicy.startupGraceSeconds={grace}s)")
            elif blocked is None or deadline < blocked[2]:
                blocked = problem
        why = _disruption(pod, d, observed)
        if why:
            disruptions.append(why)
        elif pod.phase == "Failed":
            failed.append(pod)

    if fatal:
        _fail(d, observed, reason=fatal[0], message=fatal[1])
        return
    if disruptions:
        _restart_after_preemption(d, observed, disruptions)
        return
    if failed:
        _restart_after_failure(d, observed, failed[0])
        return
    _delete_pods(d, observed, stale)
    _startup_condition(d, blocked)
    pods = [current[r] for r in range(total)]
    lagging = next((p.checkpoint_sync for p in pods if p.checkpoint_sync and p.active), "")
    polled = lagging_message(d.status.progress)  # None: no reading to go by (unreachable, not polled)
    if lagging or polled:
        d.cond("CheckpointsLagging", "True", "UploadsLagging", lagging or polled or "")
    elif (c := d.status.condition("CheckpointsLagging")) is not None and c.status == "True" \
            and (polled is not None or d.status.progress is None):
        d.cond("CheckpointsLagging", "False", "UploadsCaughtUp", "checkpoint uploads caught up")
    if all(p.phase == "Succeeded" for p in pods):
        msg = f"attempt {attempt}: all {total} pod(s) succeeded"
        d.update(phase="Succeeded", message=msg, completion_time=format_time(d.now), nodes_ready=0)
        d.cond("Running", "False", "Succeeded", msg)
        d.cond("Succeeded", "True", "Succeeded", msg)
        d.event("Normal", "Succeeded", msg)
        _ttl(d)
        return
    running = sum(p.phase in ("Running", "Succeeded") for p in pods)
    ready = sum(p.phase == "Running" and p.ready for p in pods)
    if d.status.phase == "Running" or running == total or d.status != d.job.status:
        # While a gang starts, its pods come up in a burst: one status write when all
        # run, not one per pod (the API server is the bottleneck of big launches).
        d.update(nodes_ready=ready)
    if running == total and d.status.phase != "Running":
        msg = f"attempt {attempt}: all {total} pod(s) running"
        d.update(phase="Running", message=msg)
        d.cond("Running", "True", "AllPodsRunning", msg)
        d.event("Normal", "Running", msg)


MESSAGE_LIMIT = 400
"""Longest excerpt of a message from the kubelet or the API server copied into status/events."""


def _startup_condition(d: _Draft, blocked: tuple[str, str, dt.datetime] | None) -> None:
    """Condition StartupDelayed while a pod fails to start for a possibly transient reason
    (a Warning event when it begins or its reason changes); the wake-up at the deadline
    turns a persisting one into Failed."""
    current = d.status.condition("StartupDelayed")
    if blocked is None:
        if current is not None and current.status == "True":
            d.cond("StartupDelayed", "False", "PodsStarted", "no pod is failing to start")
        return
    reason, message, deadline = blocked
    text = (f"{message}; the kubelet retries, the job fails if this persists until "
            f"{format_time(deadline)} (runPolicy.startupGraceSeconds)")
    if current is None or current.status != "True" or _family(current.reason) != _family(reason):
        d.event("Warning", "StartupDelayed", text)  # not again when the kubelet flips ErrImagePull <-> BackOff
    if current is None or current.status != "True" or current.reason != reason or current.message != text:
        d.cond("StartupDelayed", "True", reason, text)
        d.update(message=f"attempt {d.status.attempt}: {message} (retrying)")
    d.wake_at(deadline)


def _excerpt(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """What the kubelet or the API server said, redacted and cut short, for status and events."""
    return redact(text.strip())[:limit]


def _family(reason: str) -> str:
    return "ImagePull" if reason in ("ErrImagePull", "ImagePullBackOff") else reason


def _invalid_configuration(d: _Draft, pod: PodView) -> tuple[str, str]:
    """(reason, message) of a pod that exited 82: InvalidConfiguration, or the reason of its
    failure record with the store's code and the location (only one inside this job's own
    checkpoint prefix: the operator publishes no other place a pod names)."""
    what = f"pod {pod.name} exited with code {EXIT_INVALID_CONFIG} (invalid configuration)"
    failure = pod.failure
    if failure is None:
        return "InvalidConfiguration", what + _tail(d, pod)
    prefix = d.job.checkpoint_uri
    where = failure.where if failure.where and prefix and (
        failure.where == prefix or failure.where.startswith(prefix + "/")) else None
    details = ", ".join([failure.reason] + ([f"code {failure.code}"] if failure.code else [])
                        + ([f"at {where}"] if where else []))
    return failure.reason, f"{what}: {FAILURE_REASONS[failure.reason]} ({details}){_tail(d, pod)}"


def _tail(d: _Draft, pod: PodView) -> str:
    """Where to read why a pod failed. Its output is never copied into status or events:
    logs can carry credentials, and a pod's text is not the operator's to publish."""
    return f"; its log says why: kubectl logs -n {d.job.namespace} {pod.name}"


def _restart(d: _Draft, observed: Observed, *, reason: str, message: str, delay: float) -> None:
    d.update(phase="Restarting", message=message, nodes_ready=0,
             next_attempt_time=format_time(d.now + dt.timedelta(seconds=delay)))
    d.cond("Running", "False", reason, message)
    d.cond("Restarting", "True", reason, message)
    _delete_pods(d, observed, observed.pods)
    if delay > 0:
        d.wake_at(d.now + dt.timedelta(seconds=delay))


def _restart_after_preemption(d: _Draft, observed: Observed, disruptions: list[tuple[str, str]]) -> None:
    attempt = d.status.attempt
    count = d.status.preemptions + 1
    first = disruptions[0][1] + (f" (and {len(disruptions) - 1} more)" if len(disruptions) > 1 else "")
    d.update(preemptions=count)
    d.event("Warning", "Preempted", f"attempt {attempt}: {first}", cause=disruptions[0][0])
    limit = d.job.spec.run_policy.max_preemptions if d.job.spec else None
    if limit is not None and count > limit:
        _fail(d, observed, reason="MaxPreemptionsExceeded",
              message=f"{count} preemptions exceed maxPreemptions {limit}; last: {first}")
        return
    msg = f"attempt {attempt} preempted ({first}); restarting the gang as attempt {attempt + 1}"
    _restart(d, observed, reason="Preempted", message=msg, delay=0)
    d.event("Normal", "Restarting", f"restarting the whole gang as attempt {attempt + 1} "
                                    f"(preemption {count}, backoffLimit untouched)")


def _restart_after_failure(d: _Draft, observed: Observed, pod: PodView) -> None:
    policy = d.job.spec.run_policy
    attempt = d.status.attempt
    failures = d.status.failures + 1
    d.update(failures=failures)
    if _evicted_for_own_usage(pod):
        what = (f"pod {pod.name} (node rank {pod.rank}) was evicted for its own resource usage: "
                f"{_excerpt(pod.status_message)}")
    else:
        what = f"pod {pod.name} (node rank {pod.rank}) exited with code {pod.exit_code}"
    if failures > policy.backoff_limit:
        _fail(d, observed, reason="BackoffLimitExceeded",
              message=f"{what}; {failures} application failure(s) exceed backoffLimit "
                      f"{policy.backoff_limit}{_tail(d, pod)}")
        return
    delay = policy.backoff_delay(failures)
    msg = (f"attempt {attempt} failed: {what}; restarting as attempt {attempt + 1} in {delay:g}s "
           f"(failure {failures} of backoffLimit {policy.backoff_limit})")
    _restart(d, observed, reason="BackoffRestart", message=msg, delay=delay)
    d.event("Warning", "BackoffRestart", msg)


def fail_plan(job: Job, observed: Observed, now: dt.datetime, *, reason: str, message: str) -> Plan:
    """The plan that fails a job outright (e.g. the API server rejected its pods)."""
    d = _Draft(job, now)
    _fail(d, observed, reason=reason, message=_excerpt(message, MESSAGE_LIMIT * 2))
    return d.build()


def rejected_plan(job: Job, now: dt.datetime, *, reason: str, message: str) -> Plan:
    """The API server refused to create the next attempt's pods for a reason that can pass
    (a full ResourceQuota, RBAC not yet granted): the job waits, showing why. Condition
    Created=False with the API server's (redacted) message, a Warning event when the reason or
    message changes, phase Pending (Restarting stays Restarting: `status.attempt` is not moved,
    so the pods already created are completed, never duplicated, on the next try)."""
    d = _Draft(job, now)
    text = _excerpt(message)
    current = d.status.condition("Created")
    if current is None or current.status != "False" or current.reason != reason or current.message != text:
        d.event("Warning", reason, f"attempt {job.status.attempt + 1}: the API server refused a pod: {text}; "
                                   "retrying with backoff")
        d.cond("Created", "False", reason, text)
    what = "waiting for quota" if reason == "QuotaExceeded" else "waiting for the API server to accept the pods"
    # Pending only before the first attempt: with attempt >= 1, Pending would mean "attempt N's pods all
    # exist" (a resumed or restarting job whose next pods are refused stays Restarting).
    d.update(phase="Pending" if job.status.attempt == 0 else "Restarting",
             message=f"attempt {job.status.attempt + 1}: {what}: {text}")
    return d.build()
