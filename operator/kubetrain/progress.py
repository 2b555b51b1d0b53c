"""Live progress of a running job: what node rank 0's /progress endpoint says, read strictly.

Training pods have no API rights, so the operator reads their progress instead
of letting them write it: `poller.py` fetches `http://<rank 0 pod IP>:<metrics
port>/progress` on a bounded schedule and hands the result over as an
observation; the planner turns observations into `status.progress`,
`status.lastCheckpoint` and the `CheckpointsLagging` condition with the pure
functions here. Everything in a record is pod-provided text: a value the status
schema would refuse (NaN, a negative count, a string step) refuses the record,
so a pod can never make a status patch fail. See docs/contract.md, "Metrics and
progress endpoint".
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, replace
from typing import Mapping

from kubetrain.redact import redacted_excerpt
from kubetrain.status import LastCheckpoint
from kubetrain.values import Progress, format_time, parse_time_or_none, real_number, whole_number

PROGRESS_KIND = "kubetrain.io/progress"
CHECKPOINT_KIND = "kubetrain.io/last-checkpoint"
MAX_PROGRESS_BYTES = 65536
"""A progress record is a few hundred bytes; a longer answer is not one (and is not read on)."""
LAGGING_PENDING_UPLOADS = 2
"""CheckpointsLagging turns True when this many checkpoints wait for upload (a saved one waits
behind another: uploads are slower than saves, or storage is unreachable), and False again when
at most one is in flight."""
MESSAGE_LIMIT = 200
FROM_PROGRESS = " (node rank 0's /progress)"
"""How a CheckpointsLagging message from /progress ends (one from the pods' annotation is their text)."""


class RecordError(ValueError):
    """A /progress answer that is not a valid record; names the field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


@dataclass(frozen=True)
class ProgressReport:
    """One valid /progress record."""

    progress: Progress
    checkpoint: LastCheckpoint | None = None


@dataclass(frozen=True)
class ProgressObservation:
    """What one poll of a job's rank 0 found: a report, or why there is none."""

    attempt: int
    """The attempt of the pod that was polled: an observation of another attempt is stale."""
    at: dt.datetime
    report: ProgressReport | None = None
    reason: str = ""
    """CamelCase why the read failed (Timeout, ConnectionFailed, HTTPError, InvalidRecord, ...)."""
    message: str = ""


_INTS = ("step", "attempt", "incarnation", "pendingUploads", "uploadLagSteps")
_OPTIONAL_INTS = ("maxSteps",)
_OPTIONAL_REALS = ("epoch", "learningRate", "samplesPerSecond", "tokensPerSecond", "etaSeconds")


def parse_progress_record(text: bytes | str, *, at: dt.datetime, attempt: int | None = None) -> ProgressReport:
    """Parse one /progress answer of a pod of `attempt`; raises RecordError naming the first
    field that is wrong (an answer of another attempt is one: an address reused by another pod)."""
    if len(text) > MAX_PROGRESS_BYTES:
        raise RecordError("(record)", f"longer than {MAX_PROGRESS_BYTES} bytes")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):  # "[[[[..." nests past the parser's depth
        raise RecordError("(record)", "not JSON") from None
    if not isinstance(raw, Mapping):
        raise RecordError("(record)", "not a JSON object")
    if raw.get("kind") != PROGRESS_KIND:
        raise RecordError("kind", f"must be {PROGRESS_KIND!r}")
    for name in _INTS:
        if whole_number(raw.get(name)) is None:
            raise RecordError(name, "must be an integer >= 0")
    for name in _OPTIONAL_INTS:
        if raw.get(name) is not None and whole_number(raw.get(name)) is None:
            raise RecordError(name, "must be an integer >= 0 or null")
    for name in _OPTIONAL_REALS:
        if raw.get(name) is not None and real_number(raw.get(name)) is None:
            raise RecordError(name, "must be a finite number >= 0 or null")
    if raw.get("loss") is not None and real_number(raw.get("loss"), signed=True) is None:
        raise RecordError("loss", "must be a finite number or null")
    if attempt is not None and raw["attempt"] != attempt:
        raise RecordError("attempt", f"is {raw['attempt']}, the pod polled runs attempt {attempt}")
    if parse_time_or_none(raw.get("updatedAt")) is None or not isinstance(raw.get("updatedAt"), str):
        raise RecordError("updatedAt", "must be an RFC 3339 time")
    checkpoint = None
    if raw.get("lastCheckpoint") is not None:
        record = raw["lastCheckpoint"]
        if not isinstance(record, Mapping) or record.get("kind") != CHECKPOINT_KIND:
            raise RecordError("lastCheckpoint", f"must be a {CHECKPOINT_KIND} record or null")
        checkpoint = LastCheckpoint.from_storage(record)
        if checkpoint is None:
            raise RecordError("lastCheckpoint", "has a field the status schema refuses")
    progress = Progress.from_storage(raw)
    assert progress is not None
    return ProgressReport(progress=replace(progress, observed_at=format_time(at)), checkpoint=checkpoint)


def next_progress(current: Progress | None, observation: ProgressObservation) -> Progress | None:
    """status.progress after an observation. A failed read keeps the last values and says why;
    a read whose values equal the current ones keeps the current observedAt, so a job that does
    not move (or a resync) costs no status write."""
    if observation.report is None:
        base = current or Progress()
        return replace(base, reachable=False, reason=observation.reason,
                       message=redacted_excerpt(observation.message, MESSAGE_LIMIT))
    new = observation.report.progress
    if current is not None and replace(current, observed_at=None) == replace(new, observed_at=None):
        return current
    if current is not None and current.step and current.attempt != new.attempt and not new.step \
            and new.max_steps is None and new.loss is None:
        return current  # a new attempt with no step yet (restoring, starting): not "0", the last attempt's values
    return new


def lagging_message(progress: Progress | None) -> str | None:
    """The CheckpointsLagging message while uploads fall behind, "" once they caught up, None when
    unknown (no reading): pendingUploads >= LAGGING_PENDING_UPLOADS turns it on, <= 1 off."""
    if progress is None or progress.pending_uploads is None or not progress.reachable:
        return None
    pending = progress.pending_uploads
    if pending >= LAGGING_PENDING_UPLOADS:
        return (f"{pending} checkpoint(s) wait for upload, the newest saved one {progress.upload_lag_steps or 0} "
                f"step(s) ahead of the newest committed one{FROM_PROGRESS}")
    return ""


def usable_checkpoint(report: ProgressReport | None, prefix: str) -> LastCheckpoint | None:
    """The record's last checkpoint if it lies under the job's own storage prefix."""
    ckpt = report.checkpoint if report is not None else None
    if ckpt is None or not prefix or not ckpt.uri.startswith(prefix + "/"):
        return None
    return ckpt


def progress_url(*, ip: str, port: int, template: str = "", namespace: str = "", job: str = "",
                 pod: str = "") -> str:
    """Where rank 0 answers: the pod IP and its `metrics` port; or, in tests only, a template
    (KUBETRAIN_TEST_PROGRESS_URL) with {namespace}, {job}, {pod}, {ip} and {port}."""
    if template:
        return template.format(namespace=namespace, job=job, pod=pod, ip=ip, port=port)
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/progress"

