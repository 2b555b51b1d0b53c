"""The records pods leave for the operator: the last-checkpoint and the failure record.

A pod writes them into its termination message (and the checkpoint record into
an annotation), docs/contract.md. Both are pod-provided text, read strictly: the
whole text must be one JSON object of the record's `kind`, short, with every
field in shape, or it is not a record at all. So a log line that merely looks
like JSON, or a value the status schema would refuse, never reaches a status
patch or an event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubetrain.api import FAILURE_CODE, FAILURE_REASONS, FAILURE_RECORD_KIND
from kubetrain.redact import redact
from kubetrain.status import MAX_URI_LENGTH, LastCheckpoint

CHECKPOINT_RECORD_KIND = "kubetrain.io/last-checkpoint"
"""The `kind` of the trainer's last-checkpoint record (docs/contract.md); anything else in a
termination message or annotation (a log tail, a user's JSON line) is never read as one."""

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
    except (ValueError, RecursionError):  # a pod's text: "[[[[..." nests past the parser's depth
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
