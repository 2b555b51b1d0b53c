"""How often a rank other than 0 reads node rank 0's claim while it waits for the restore decision.

The claim is a dict here (pure logic: the S3 behaviour of `restore_agreed` is covered against MinIO
in tests/integration/trainer_storage/test_ckpt_restore_agreement_minio.py). A rank that polls every
second sees a decision made at once up to a second late, and the gang starts with its last rank.
"""

from __future__ import annotations

import threading
from pathlib import Path

from kubetrain_trainer.manifest import AttemptClaim
from kubetrain_trainer.restore import restore_agreed


class ClaimStore:
    """Node rank 0's claim, undecided for the first `undecided` reads, then "start from scratch"."""

    def __init__(self, undecided: int) -> None:
        self.undecided = undecided
        self.reads = 0

    def list_claims(self):
        return []

    def read_claim(self, incarnation: int, attempt: int):
        self.reads += 1
        decided = self.reads > self.undecided
        return AttemptClaim(incarnation=incarnation, attempt=attempt, decided=decided, restore_step=None)

    def list_checkpoints(self):
        return []


class RecordedWaits(threading.Event):
    """The SIGTERM event `restore_agreed` sleeps on: each wait is recorded and returns at once."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return False


def _waits(undecided: int, tmp_path: Path) -> list[float]:
    store, stop = ClaimStore(undecided), RecordedWaits()
    restored = restore_agreed(store, tmp_path, node_rank=1, incarnation=3, attempt=2, deadline=1e12, stop=stop)
    assert restored.path is None and store.reads == undecided + 1  # decided "from scratch": followed
    return stop.waits


def test_a_decision_made_at_once_is_seen_within_a_tenth_of_a_second(tmp_path: Path):
    waits = _waits(1, tmp_path)
    assert len(waits) == 1 and waits[0] <= 0.1, waits


def test_the_poll_backs_off_to_one_read_a_second(tmp_path: Path):
    waits = _waits(30, tmp_path)
    assert waits[0] <= 0.1 and all(w <= 1.0 for w in waits), waits
    # Doubling: within the first 2 s of waiting it read about 6 times, not 40 (a 0.05 s poll).
    assert sum(1 for total in _running_sums(waits) if total <= 2.0) <= 8, waits
    assert min(waits[-10:]) >= 0.5, "a long wait reads the claim about once a second, not faster"


def _running_sums(waits: list[float]) -> list[float]:
    out, total = [], 0.0
    for w in waits:
        total += w
        out.append(total)
    return out
