"""What the planner decides: frozen actions, events and the `Plan` that holds them.

`plan.py` (pure) returns a `Plan`; `k8s.apply` carries it out in order (creations,
the status write and then at once its events, deletions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from kubetrain.status import Status


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
    admission: Any = None
    """Kueue's admission merged into the pod (a `kueue_admission.PodSetInfo`), for a job queued by Kueue."""


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


@dataclass(frozen=True)
class CreateWorkload:
    """Create the job's Kueue Workload (`kueue.build_workload`; AlreadyExists is success)."""

    priority: int | None = None
    """The value of the PriorityClass or WorkloadPriorityClass the job names, if any."""


@dataclass(frozen=True)
class PatchWorkload:
    """A merge patch of the Workload guarded by its resourceVersion (a conflict: plan again)."""

    name: str
    resource_version: str
    spec: Mapping[str, Any] | None = None
    """e.g. {"active": False} while the job is suspended."""
    annotations: Mapping[str, str | None] | None = None
    """Merged into metadata.annotations in the same patch as `spec` (None: remove that annotation)."""
    status: Mapping[str, Any] | None = None
    """The whole conditions list (Kueue's own kept) and, after an eviction, `admission: None`."""
    remove_finalizer: bool = False


Action = (CreateService | EnsureDeepSpeedConfigMap | CreatePod | DeletePod | PatchStatus | DeleteJob | CreateWorkload
          | PatchWorkload)


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
