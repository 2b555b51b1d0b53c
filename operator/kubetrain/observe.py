"""What the planner observes besides the job: its pods, their nodes, rank 0's progress.

`PodView.from_storage` reads one pod dict (as the informer delivers it) into a
frozen view, including the records it carries (`records.py`); `NodeView` is a
node's health; `Observed` bundles them for one `plan()` call; `PodIndex` keeps
the views by job and by node for the reconciler. Pure: no I/O.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from kubetrain.api import (
    ANNOTATION_CHECKPOINT_SYNC, ANNOTATION_LAST_CHECKPOINT, ANNOTATION_SPEC_FINGERPRINT, ANNOTATION_SPEC_GENERATION,
    CONTAINER_NAME, LABEL_ATTEMPT, LABEL_RANK, METRICS_PORT_NAME,
)
from kubetrain.status import LastCheckpoint
from kubetrain.values import parse_time_or_none
from kubetrain.progress import ProgressObservation
from kubetrain.records import TrainerFailure, parse_checkpoint_record, parse_failure_record


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
    exit_reason: str = ""
    """The kubelet's reason for the trainer container's termination (OOMKilled, Error, ContainerCannotRun...)."""
    termination_message: str = ""
    waiting_reason: str | None = None
    waiting_message: str = ""
    node_name: str | None = None
    ready: bool = False
    ready_changed: dt.datetime | None = None
    checkpoint: LastCheckpoint | None = None
    generation: int | None = None
    """The job generation the pod was built from (`ANNOTATION_SPEC_GENERATION`); None before it was stamped."""
    spec_fingerprint: str = ""
    """`spec.pod_fingerprint` of the spec it was built from (`ANNOTATION_SPEC_FINGERPRINT`); "" before it was stamped."""
    failure: TrainerFailure | None = None
    """Why the trainer exited 82, from the failure record in its termination message, if any."""
    checkpoint_sync: str = ""
    """Why checkpoint uploads lag behind (annotation kubetrain.io/checkpoint-sync), if they do."""
    pod_ip: str | None = None
    metrics_port: int | None = None
    """The trainer container's port named `metrics` (its /progress endpoint), if it has one."""
    unschedulable: str = ""
    """The scheduler's message while it cannot place the pod (PodScheduled False, reason Unschedulable)."""

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
        ready, unschedulable = False, ""
        for cond in status.get("conditions") or ():
            if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
                disruption = cond.get("reason") or "DisruptionTarget"
            elif cond.get("type") == "PodScheduled" and cond.get("status") == "True":
                starting_since = parse_time_or_none(cond.get("lastTransitionTime")) or starting_since
            elif cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
                unschedulable = str(cond.get("message") or "no node fits it")
            elif cond.get("type") == "Ready":
                ready = cond.get("status") == "True"
                ready_changed = parse_time_or_none(cond.get("lastTransitionTime"))
        exit_code, exit_reason, message, waiting, waiting_message = None, "", "", None, ""
        statuses = status.get("containerStatuses") or ()
        trainer = next((c for c in statuses if c.get("name") == CONTAINER_NAME), statuses[0] if statuses else {})
        state = trainer.get("state") or {}
        if state.get("terminated"):
            exit_code = state["terminated"].get("exitCode")
            message = state["terminated"].get("message") or ""
            exit_reason = str(state["terminated"].get("reason") or "")
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
            exit_reason=exit_reason[:64], termination_message="" if message_ckpt or failure else str(message),
            waiting_reason=waiting, waiting_message=waiting_message,
            node_name=(body.get("spec") or {}).get("nodeName") or None,
            ready=ready, ready_changed=ready_changed, checkpoint=checkpoint, failure=failure,
            checkpoint_sync=str((meta.get("annotations") or {}).get(ANNOTATION_CHECKPOINT_SYNC) or ""),
            generation=_generation((meta.get("annotations") or {}).get(ANNOTATION_SPEC_GENERATION)),
            spec_fingerprint=str((meta.get("annotations") or {}).get(ANNOTATION_SPEC_FINGERPRINT) or "")[:64],
            pod_ip=status.get("podIP") or None, metrics_port=_metrics_port(body), unschedulable=unschedulable,
        )


def _generation(text: Any) -> int | None:
    # ASCII digits only: str.isdigit() is also true of "²", which int() refuses.
    return int(text) if isinstance(text, str) and text.isascii() and text.isdigit() and len(text) <= 19 else None


def _metrics_port(body: Mapping[str, Any]) -> int | None:
    containers = (body.get("spec") or {}).get("containers") or ()
    trainer = next((c for c in containers if c.get("name") == CONTAINER_NAME), {})
    port = next((p.get("containerPort") for p in trainer.get("ports") or () if p.get("name") == METRICS_PORT_NAME), None)
    return port if isinstance(port, int) and not isinstance(port, bool) else None


@dataclass(frozen=True)
class NodeView:
    """A node's health as far as a gang cares."""

    name: str
    ready: bool = True
    exists: bool = True
    since: dt.datetime | None = None
    """When it stopped being Ready (or was first seen missing)."""


def node_view(name: str, conditions: Any, not_ready_seen: dict[str, dt.datetime], now: dt.datetime) -> NodeView:
    """A node's view from its status conditions. A node that is not Ready counts from its Ready condition's
    lastTransitionTime; without a usable one (no Ready condition yet, or a writer that leaves the time out),
    from when this operator first saw it not Ready (`not_ready_seen`, by node name; kept here until the node is
    Ready again), so that it still counts as lost after the grace period instead of never."""
    ready = next((c for c in conditions or () if isinstance(c, Mapping) and c.get("type") == "Ready"), None)
    if ready is not None and ready.get("status") == "True":
        not_ready_seen.pop(name, None)
        return NodeView(name=name, ready=True)
    first = not_ready_seen.setdefault(name, now)
    changed = parse_time_or_none(ready.get("lastTransitionTime")) if ready is not None else None
    return NodeView(name=name, ready=False, since=changed or first)


GONE_SUCCEEDED = "Succeeded"
"""`Observed.gone`'s word for a pod deleted after it succeeded (PodGC, a user tidying up, a node scaled
down): its rank is done, not taken away."""


@dataclass(frozen=True)
class Observed:
    """Everything observed about one job besides the job itself."""

    pods: tuple[PodView, ...] = ()
    nodes: Mapping[str, NodeView] = field(default_factory=dict)
    """Nodes the pods are bound to; a pod's node absent here is assumed healthy."""
    gone: Mapping[str, str] = field(default_factory=dict)
    """Why pods that no longer exist went away (their last DisruptionTarget reason, or `GONE_SUCCEEDED`
    for one deleted after it succeeded), by name."""
    progress: ProgressObservation | None = None
    """The newest poll of node rank 0's /progress endpoint (poller.py), if any."""


Key = tuple[str, str]


class PodIndex:
    """Our pods by (namespace, job): pod name -> (controller uid, view); and by node, the jobs with
    a pod there, so a node event finds its jobs without walking every job's pods (every event's
    cost stays independent of how many jobs the operator manages)."""

    def __init__(self) -> None:
        self._by_job: dict[Key, dict[str, tuple[str, PodView]]] = {}
        self._on_node: dict[str, dict[Key, set[str]]] = {}

    def put(self, key: Key, name: str, entry: tuple[str, PodView]) -> None:
        pods = self._by_job.setdefault(key, {})
        old = pods.get(name)
        pods[name] = entry
        before = old[1].node_name if old is not None else None
        if before != entry[1].node_name:
            self._unplace(before, key, name)
            if entry[1].node_name:
                self._on_node.setdefault(entry[1].node_name, {}).setdefault(key, set()).add(name)

    def discard(self, key: Key, name: str) -> tuple[str, PodView] | None:
        """Forget the pod; returns its last entry, if it had one."""
        pods = self._by_job.get(key)
        if pods is None:
            return None
        old = pods.pop(name, None)
        if old is not None:
            self._unplace(old[1].node_name, key, name)
        if not pods:
            del self._by_job[key]
        return old

    def _unplace(self, node: str | None, key: Key, name: str) -> None:
        jobs = self._on_node.get(node or "")
        if not node or jobs is None or key not in jobs:
            return
        jobs[key].discard(name)
        if not jobs[key]:
            del jobs[key]
            if not jobs:
                del self._on_node[node]

    def jobs_on(self, node: str) -> list[Key]:
        """The jobs with a pod (of any attempt or owner) bound to `node`."""
        return list(self._on_node.get(node, ()))

    def __contains__(self, key: object) -> bool:
        return key in self._by_job

    def __getitem__(self, key: Key) -> list[tuple[str, PodView]]:
        return list(self._by_job.get(key, {}).values())


EXPECTATION_TTL = dt.timedelta(seconds=60)


@dataclass
class Expectations:
    """Writes we made whose watch events have not arrived yet (as in kube-controller-manager):
    a pod we just created is not 'missing', a pod we just deleted is not 'still running'."""

    created: dict[str, tuple[dt.datetime, PodView]] = field(default_factory=dict)
    deleted: dict[str, dt.datetime] = field(default_factory=dict)
    uid: str = ""
    """The job they were made for: a job re-created under the same name starts with none."""

    def overlay(self, pods: list[PodView], now: dt.datetime) -> list[PodView]:
        seen = {p.name for p in pods}
        for name in [n for n, (t, _) in self.created.items() if n in seen or now - t > EXPECTATION_TTL]:
            del self.created[name]
        out = [replace(p, deletion_timestamp=self.deleted[p.name])
               if p.name in self.deleted and p.deletion_timestamp is None else p for p in pods]
        for name in [n for n, t in self.deleted.items() if n not in seen or now - t > EXPECTATION_TTL]:
            del self.deleted[name]
        return out + [view for _, view in self.created.values()]
