"""The restore's outcome, handed from the launcher to workers that started before it was known.

A worker spends seconds before it can train: process start, `import torch`, the model, the
process group. The launcher therefore starts the built-in trainer while it restores the
checkpoint, and hands the outcome over once it is decided (docs/contract.md, "Command"):

- the launcher opens one pipe per worker and passes the read end's number in
  `KUBETRAIN_RESTORE_OUTCOME_FD` (the write end stays in the launcher only);
- after the restore (and the checkpoint session's start), it writes one JSON line,
  `{"resume_from": "<folder>"}` or `{"resume_from": null}` (start fresh), and closes its end;
- when the restore failed or SIGTERM came first, it closes its end without a line and stops the
  workers: the launcher alone reports that failure, exactly as when no worker had started;
- the worker reads the line right before `train()`. End of file without a line (the launcher
  gave up, or is gone: nothing else holds the write end) is `HandoffError`, never a fresh start.

A pipe rather than a file: nothing stale can be read from an earlier launch, the worker wakes
the moment the line is written, and the launcher's end of life is seen at once. The worker's
wait needs no deadline of its own: the restore is bounded by the launcher's deadlines
(KUBETRAIN_RESTORE_TIMEOUT_SECONDS), and `receive` takes one for callers that want it.
"""

from __future__ import annotations

import json
import os
import select
from pathlib import Path

KEY = "resume_from"


class HandoffError(RuntimeError):
    """No restore outcome came from the launcher (its restore failed, it stopped or it is gone)."""


def open_pipe() -> tuple[int, int]:
    """(read end for the worker, write end for the launcher). Neither is inherited by default:
    the launcher passes the read end to its worker only (`subprocess.Popen(pass_fds=...)`)."""
    return os.pipe()


def encode(resume_from: Path | None) -> bytes:
    """The one line the launcher writes: the folder to resume from, or null for a fresh start."""
    return (json.dumps({KEY: str(resume_from) if resume_from is not None else None}) + "\n").encode()


def decode(line: bytes) -> Path | None:
    """The folder a line names (None: start fresh); HandoffError for anything else."""
    try:
        message = json.loads(line)
        value = message[KEY]
    except (ValueError, TypeError, KeyError):
        raise HandoffError(f"unreadable restore outcome from the launcher: {line[:200]!r}") from None
    if value is not None and (not isinstance(value, str) or not value):
        raise HandoffError(f"unreadable restore outcome from the launcher: {line[:200]!r}")
    return Path(value) if value else None


def send(write_fd: int, resume_from: Path | None) -> bool:
    """Launcher: hand `resume_from` to one waiting worker and close the pipe. False when that worker
    has already exited (its exit code tells the launcher why)."""
    try:
        os.write(write_fd, encode(resume_from))  # far below PIPE_BUF: one atomic write
        return True
    except BrokenPipeError:
        return False
    finally:
        os.close(write_fd)


def withhold(write_fd: int) -> None:
    """Launcher: close the pipe without an outcome (the restore failed, or SIGTERM came first)."""
    os.close(write_fd)


def receive(read_fd: int, *, timeout_s: float | None = None) -> Path | None:
    """Worker: wait for the launcher's line and return the folder to resume from (None: start fresh).

    HandoffError when the pipe closes without a line, or no line comes within `timeout_s`."""
    with os.fdopen(read_fd, "rb") as pipe:
        ready, _, _ = select.select([pipe], [], [], timeout_s)
        if not ready:
            raise HandoffError(f"no restore outcome from the launcher within {timeout_s:.0f}s "
                               f"(KUBETRAIN_RESTORE_OUTCOME_FD={read_fd})")
        line = pipe.readline()
    if not line:
        raise HandoffError("the launcher closed the restore hand-off without an outcome (its restore failed, "
                           "it was stopped, or it exited): not training; see the launcher's log")
    return decode(line)
