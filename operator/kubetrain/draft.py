"""The planner's scratchpad and the steps every branch of it shares (pure, no I/O).

A `Draft` accumulates one plan: status changes, actions before and after the
status write, events and the next wake-up; only frozen values leave it
(`Draft.build`). The steps here (fail a job, delete a gang, the TTL after the
end) are used by both `plan.py` and `supervise.py`.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from typing import Any, Literal

from kubetrain.actions import Action, DeleteJob, DeletePod, Event, PatchStatus, Plan
from kubetrain.api import Job
from kubetrain.redact import redacted_excerpt
from kubetrain.status import Status
from kubetrain.values import format_time, parse_time
from kubetrain.observe import Observed, PodView

STUCK_DELETION_SLACK_SECONDS = 30
"""A pod still present this long after its deletionTimestamp is force-deleted."""

MESSAGE_LIMIT = 400
"""Longest excerpt of a message from the kubelet or the API server copied into status/events."""


class Draft:
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
            status = attempt_conditions(ready_condition(status, self.now), self.now)
        if status != self.job.status or (status.phase and status.observed_generation != self.job.generation):
            status = replace(status, observed_generation=self.job.generation, conditions=tuple(
                replace(c, observed_generation=self.job.generation) for c in status.conditions))
        patch = (PatchStatus(status),) if status != self.job.status else ()
        return Plan(actions=tuple(self.before) + patch + tuple(self.after),
                    events=tuple(self.events), requeue_after=self.requeue)


ATTEMPT_CONDITIONS = ("StartupDelayed", "StartupSlow", "Unschedulable", "CheckpointsLagging", "SpecChangePending")
"""Conditions about the pods of the running attempt: False once it ends (Failed, Succeeded, Suspended,
Restarting, back in a queue), so a finished job does not say its pods cannot start, that uploads
lag that no pod makes any more, or that an edit waits for an attempt (`edits.py`)."""


ENDED = "AttemptEnded"


def attempt_conditions(status: Status, now: dt.datetime) -> Status:
    status = _attempt_progress(status)
    if status.phase in ("Pending", "Running"):
        return status
    for type_ in ATTEMPT_CONDITIONS:
        current = status.condition(type_)
        if current is not None and current.status == "True":
            status = status.with_condition(type_, "False", reason="AttemptEnded", message=f"the job is {status.phase}",
                                           now=now)
    return status


def _attempt_progress(status: Status) -> Status:
    """status.progress once the attempt it was read from is over (the job finished, restarts, waits in a queue,
    is suspended, or a new attempt started): its last values stay, marked as such; the rates and the ETA go
    (a Succeeded job showed "31 s left" forever, a restarting one the old attempt's ETA)."""
    progress = status.progress
    if progress is None or (status.phase in ("Pending", "Running") and progress.attempt in (None, status.attempt)) \
            or progress.reason == ENDED:
        return status
    return replace(status, progress=replace(
        progress, reachable=False, reason=ENDED, eta_seconds=None, samples_per_second=None, tokens_per_second=None,
        message=f"attempt {progress.attempt} ended; these are its last values read"))


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


def excerpt(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """What the kubelet or the API server said, redacted and cut short, for status and events (cut before
    it is redacted too, with a margin so that a secret across the cut is still recognised)."""
    return redacted_excerpt(text.strip(), limit)


def delete_pods(d: Draft, observed: Observed, pods: list[PodView] | tuple[PodView, ...]) -> None:
    """Delete pods (finished ones too: a gang is gone only when all its pods are);
    force-delete terminating pods that are stuck (their node is gone)."""
    for pod in pods:
        if not pod.terminating:
            d.delete(pod, force=node_lost_quiet(pod, d, observed))
        elif d.now >= pod.deletion_timestamp + dt.timedelta(seconds=STUCK_DELETION_SLACK_SECONDS) \
                or node_lost_quiet(pod, d, observed):
            d.delete(pod, force=True)
        else:
            d.wake_at(pod.deletion_timestamp + dt.timedelta(seconds=STUCK_DELETION_SLACK_SECONDS))


def node_lost_quiet(pod: PodView, d: Draft, observed: Observed) -> bool:
    """The pod's node is deleted, or NotReady beyond the grace period: nobody will
    confirm a graceful deletion, so only a forced one makes the pod go away."""
    node = observed.nodes.get(pod.node_name) if pod.node_name else None
    if node is None or (node.ready and node.exists):
        return False
    if not node.exists:
        return True
    grace = d.job.spec.run_policy.node_lost_grace_seconds if d.job.spec else 60
    return d.now >= (node.since or d.now) + dt.timedelta(seconds=grace)


def fail(d: Draft, observed: Observed, *, reason: str, message: str) -> None:
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
    ttl(d)


def ttl(d: Draft) -> None:
    ttl = d.job.spec.run_policy.ttl_seconds_after_finished if d.job.spec else None
    finished = parse_time(d.status.completion_time)
    if ttl is None or finished is None:
        return
    expiry = finished + dt.timedelta(seconds=ttl)
    if d.now >= expiry:
        d.after.append(DeleteJob())
    else:
        d.wake_at(expiry)
