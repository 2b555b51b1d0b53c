"""The typed status of a TrainingJob: conditions, the last checkpoint, progress, counters.

`Status.from_storage` reads `.status` leniently (a missing or malformed field is
its zero value: the operator wrote it, and planning must go on); `for_storage`
is the merge patch the operator writes back. `LastCheckpoint.from_storage` is
strict, because its input may come from a pod.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, replace
from typing import Any, Literal, Mapping

from kubetrain.values import Progress, format_time, parse_time, real_number, whole_number

Phase = Literal["Queued", "Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
TERMINAL_PHASES: frozenset[str] = frozenset({"Succeeded", "Failed"})
STARTED_PHASES: frozenset[str] = frozenset({"Pending", "Running"})
MAX_URI_LENGTH = 2048


# ------------------------------------------------------------------- status

@dataclass(frozen=True)
class Condition:
    """A standard Kubernetes condition."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str
    last_transition_time: str | None = None
    observed_generation: int | None = None
    """metav1.Condition's observedGeneration: the spec generation the condition was set from."""

    def for_storage(self) -> dict[str, Any]:
        out = {"type": self.type, "status": self.status, "reason": self.reason,
               "message": self.message, "lastTransitionTime": self.last_transition_time}
        if self.observed_generation is not None:
            out["observedGeneration"] = self.observed_generation
        return out


@dataclass(frozen=True)
class LastCheckpoint:
    """The newest checkpoint the trainer reported as committed."""

    step: int
    uri: str
    time: str | None = None
    size_bytes: int | None = None
    """Bytes of the checkpoint's files (all nodes)."""
    save_seconds: float | None = None
    """How long writing it locally took."""
    upload_seconds: float | None = None
    """How long uploading and committing it took: with save_seconds, what an emergency
    checkpoint needs of runPolicy.terminationGracePeriodSeconds."""

    @classmethod
    def from_storage(cls, raw: Any) -> "LastCheckpoint | None":
        """Parse a stored value or a pod's record; None unless every field is one the status
        schema accepts (a pod-provided value must never make status patches fail): an
        optional field that is present but invalid refuses the whole record."""
        if not isinstance(raw, Mapping):
            return None
        step, uri, time = raw.get("step"), raw.get("uri"), raw.get("time")
        if whole_number(step) is None:
            return None
        extra = {key: check(raw.get(name)) for key, name, check in _CHECKPOINT_EXTRAS}
        if any(extra[key] is None and raw.get(name) is not None for key, name, _ in _CHECKPOINT_EXTRAS):
            return None
        if not isinstance(uri, str) or not uri.startswith("s3://") or len(uri) > MAX_URI_LENGTH \
                or any(c.isspace() or not c.isprintable() for c in uri):
            return None
        try:
            when = format_time(parse_time(time)) if isinstance(time, str) else None
        except (ValueError, OverflowError):
            when = None
        return cls(step=step, uri=uri, time=when, **extra)

    def for_storage(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "uri": self.uri}
        if self.time:
            out["time"] = self.time
        out.update({name: getattr(self, key) for key, name, _ in _CHECKPOINT_EXTRAS
                    if getattr(self, key) is not None})
        return out


_CHECKPOINT_EXTRAS = (("size_bytes", "sizeBytes", whole_number), ("save_seconds", "saveSeconds", real_number),
                      ("upload_seconds", "uploadSeconds", real_number))


@dataclass(frozen=True)
class Status:
    """A TrainingJob's status. `attempt == 0` means no attempt has started yet."""

    phase: str = ""
    message: str = ""
    conditions: tuple[Condition, ...] = ()
    attempt: int = 0
    restarts: int = 0
    preemptions: int = 0
    failures: int = 0
    nodes_ready: int = 0
    nodes_total: int = 0
    start_time: str | None = None
    completion_time: str | None = None
    next_attempt_time: str | None = None
    last_checkpoint: LastCheckpoint | None = None
    observed_generation: int | None = None
    progress: Progress | None = None

    @classmethod
    def from_storage(cls, raw: Mapping[str, Any] | None) -> "Status":
        raw = dict(raw or {})

        def num(key: str) -> int:
            value = raw.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else 0

        return cls(
            phase=str(raw.get("phase") or ""),
            message=str(raw.get("message") or ""),
            conditions=tuple(
                Condition(type=str(c.get("type")), status=c.get("status") or "Unknown",
                          reason=str(c.get("reason") or ""), message=str(c.get("message") or ""),
                          last_transition_time=c.get("lastTransitionTime"),
                          observed_generation=whole_number(c.get("observedGeneration")))
                for c in raw.get("conditions") or () if isinstance(c, Mapping) and c.get("type")
            ),
            attempt=num("attempt"), restarts=num("restarts"), preemptions=num("preemptions"),
            failures=num("failures"), nodes_ready=num("nodesReady"), nodes_total=num("nodesTotal"),
            start_time=raw.get("startTime") or None,
            completion_time=raw.get("completionTime") or None,
            next_attempt_time=raw.get("nextAttemptTime") or None,
            last_checkpoint=LastCheckpoint.from_storage(raw.get("lastCheckpoint")),
            observed_generation=raw.get("observedGeneration"),
            progress=Progress.from_storage(raw.get("progress")),
        )

    def for_storage(self) -> dict[str, Any]:
        """The dict for a merge patch of `.status`: None values clear a field."""
        return {
            "phase": self.phase or None,
            "message": self.message,
            "conditions": [c.for_storage() for c in self.conditions],
            "attempt": self.attempt,
            "restarts": self.restarts,
            "preemptions": self.preemptions,
            "failures": self.failures,
            "nodesReady": self.nodes_ready,
            "nodesTotal": self.nodes_total,
            "startTime": self.start_time,
            "completionTime": self.completion_time,
            "nextAttemptTime": self.next_attempt_time,
            "lastCheckpoint": self.last_checkpoint.for_storage() if self.last_checkpoint else None,
            "observedGeneration": self.observed_generation,
            "progress": self.progress.for_storage() if self.progress else None,
        }

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)

    def with_condition(self, type_: str, status: Literal["True", "False", "Unknown"], *,
                       reason: str, message: str, now: dt.datetime) -> "Status":
        """Set one condition; lastTransitionTime moves only when its status changes."""
        old = self.condition(type_)
        when = old.last_transition_time if old is not None and old.status == status else format_time(now)
        new = Condition(type=type_, status=status, reason=reason, message=message, last_transition_time=when,
                        observed_generation=old.observed_generation if old is not None else None)
        others = tuple(c for c in self.conditions if c.type != type_)
        return replace(self, conditions=tuple(sorted(others + (new,), key=lambda c: _CONDITION_ORDER.get(c.type, 99))))

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES


_CONDITION_ORDER = {t: i for i, t in enumerate(
    ("Queued", "Created", "Ready", "Running", "Restarting", "Suspended", "Succeeded", "Failed", "CheckpointsLagging",
     "StartupDelayed", "StartupSlow", "Unschedulable", "SpecChangePending"))}

