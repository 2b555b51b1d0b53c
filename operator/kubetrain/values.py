"""Plain values of a TrainingJob's status that pods and the API server hand over: times, numbers
and `status.progress`.

Kept below `status.py` so that the progress record has a module of its own and `status.py`
stays about the status itself. Every parser here is
tolerant in the same way: a value the status schema would refuse becomes None, never an error.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Any, Mapping


def parse_time(value: Any) -> dt.datetime | None:
    """RFC3339 string (or datetime) to an aware UTC datetime; None stays None."""
    if value is None or value == "":
        return None
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    text = str(value).replace("Z", "+00:00")
    parsed = dt.datetime.fromisoformat(text)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


def parse_time_or_none(value: Any) -> dt.datetime | None:
    """`parse_time` for values others wrote (pods, nodes, metadata): None when it does not parse, or lies past
    the year 9000 (the API server takes 9999-12-31, and a grace period added to it overflowed the planner)."""
    try:
        parsed = parse_time(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return parsed if parsed is None or parsed.year < 9000 else None


def format_time(value: dt.datetime | None, *, micro: bool = False) -> str | None:
    """Aware datetime to the RFC3339 form Kubernetes stores: Time (second precision, Z), or with
    ``micro`` MicroTime (microseconds, Z: a Lease's times). The operator's only time formatter."""
    if value is None:
        return None
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def whole_number(value: Any) -> int | None:
    """A JSON integer in 0..2^63-1 (not a bool), else None: what an int64 status field accepts."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2 ** 63:
        return None
    return value


def real_number(value: Any, *, signed: bool = False) -> float | None:
    """A finite JSON number (not a bool; >= 0 unless signed), rounded to 6 significant digits,
    else None. NaN and infinities have no JSON form: the API server would refuse the patch."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if value < 0 and not signed:
        return None
    return float(f"{value:.6g}")


@dataclass(frozen=True)
class Progress:
    """status.progress: node rank 0's progress as the operator last read it from its
    /progress endpoint (docs/contract.md). When a read fails, `reachable` is False with
    the reason, and the last values read are kept."""

    reachable: bool = True
    reason: str = ""
    """Why the last read failed (CamelCase), empty while reachable."""
    message: str = ""
    step: int | None = None
    max_steps: int | None = None
    epoch: float | None = None
    loss: float | None = None
    learning_rate: float | None = None
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    eta_seconds: float | None = None
    attempt: int | None = None
    """The attempt whose rank 0 reported these values."""
    pending_uploads: int | None = None
    upload_lag_steps: int | None = None
    observed_at: str | None = None
    """When these values were read."""

    @property
    def steps(self) -> str | None:
        """`step/maxSteps` (or the step alone) for the Step column of `kubectl get tj`."""
        if self.step is None:
            return None
        return f"{self.step}/{self.max_steps}" if self.max_steps else str(self.step)

    @classmethod
    def from_storage(cls, raw: Any) -> "Progress | None":
        """Parse a stored status.progress (or the poller's record); fields that do not fit are None."""
        if not isinstance(raw, Mapping):
            return None
        values = {key: check(raw.get(name)) for key, name, check in _PROGRESS_FIELDS}
        return cls(reachable=raw.get("reachable") is not False, reason=str(raw.get("reason") or ""),
                   message=str(raw.get("message") or ""), observed_at=_time_or_none(raw.get("observedAt")),
                   **values)

    def for_storage(self) -> dict[str, Any]:
        """Every key, None for what is unknown: a merge patch then clears what no longer applies."""
        out: dict[str, Any] = {name: getattr(self, key) for key, name, _ in _PROGRESS_FIELDS}
        out.update(steps=self.steps, reachable=self.reachable, reason=self.reason or None,
                   message=self.message or None, observedAt=self.observed_at)
        return out


def _signed(value: Any) -> float | None:
    return real_number(value, signed=True)


def _time_or_none(value: Any) -> str | None:
    return format_time(parse_time_or_none(value)) if isinstance(value, str) else None


_PROGRESS_FIELDS = (
    ("step", "step", whole_number), ("max_steps", "maxSteps", whole_number), ("epoch", "epoch", real_number),
    ("loss", "loss", _signed), ("learning_rate", "learningRate", real_number),
    ("samples_per_second", "samplesPerSecond", real_number), ("tokens_per_second", "tokensPerSecond", real_number),
    ("eta_seconds", "etaSeconds", real_number), ("attempt", "attempt", whole_number),
    ("pending_uploads", "pendingUploads", whole_number), ("upload_lag_steps", "uploadLagSteps", whole_number),
)
