"""What this pod tells the operator when it exits: one record in its termination message.

The trainer has no Kubernetes client and training pods no API rights (docs/contract.md,
"Reporting the last checkpoint"), so the termination message is the launcher's only written
report: node rank 0's last-checkpoint record (`commit.CommittedCheckpoint.to_json`), or, on
every pod that checkpoint storage refused at start, the failure record of `failure.py`.
While the pod runs, the operator reads the same record from /progress (`metrics.py`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from kubetrain_trainer.failure import storage_failure

log = logging.getLogger("kubetrain_trainer.podreport")


def write_termination_message(path: Path, message: str) -> None:
    """Best effort: the pod's terminationMessagePath carries the last committed checkpoint (or why
    storage refused the pod: failure.py)."""
    try:
        tmp = path.with_name(path.name + ".tmp") if path.parent != Path("/dev") else path
        tmp.write_text(message + "\n")
        if tmp != path:
            tmp.replace(path)
    except OSError as e:
        log.debug("cannot write termination message to %s: %s", path, e)


def report_storage_refused(path: Path, error: BaseException, *, reason: str, where: str | None) -> None:
    """The failure record of exit 82 in the termination message (every rank: each pod failed).
    Storage refused this pod before its first commit, so no last-checkpoint record is displaced."""
    write_termination_message(path, storage_failure(error, reason=reason, where=where).to_json())
