"""Restore at start: every rank of an attempt downloads the same newest complete checkpoint.

Node rank 0 decides which step the attempt resumes from and records it in the attempt's claim
(`manifest.AttemptClaim`); the other ranks restore exactly that step or fail, so the ranks
never resume from different steps (docs/contract.md, "Writers, fencing and restore agreement").
Every file is checked against its digest; a corrupt checkpoint falls back to an older one.
Then `fetch_best` also fetches the best checkpoint the restored one names, for `load_best_model_at_end`.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from kubetrain_trainer.commit import CommittedCheckpoint
from kubetrain_trainer.decisions import newest_complete
from kubetrain_trainer.layout import TRAINER_STATE, checkpoint_dirname, corrupt_marker_name, parse_checkpoint_dirname
from kubetrain_trainer.manifest import AttemptClaim, Manifest, rfc3339
from kubetrain_trainer.rank_files import NodeRanks
from kubetrain_trainer.retry import Backoff, retrying
from kubetrain_trainer.storage import CheckpointStore
from kubetrain_trainer.storage_errors import ChecksumError, DigestMismatchError, StorageError, TransferStopped

log = logging.getLogger("kubetrain_trainer.restore")

RESTORE_WAIT_FACTOR = 4
"""Ranks other than 0 wait for node rank 0's restore decision up to this many restore timeouts
while its claim shows it is restoring (its own download of a big checkpoint)."""

DECISION_POLL = Backoff(initial_s=0.05, maximum_s=1.0)
"""How often ranks other than 0 read node rank 0's claim while they wait for its decision:
0.05 s first, doubling (with jitter) up to 1 s, so a decision that comes at once is seen at
once, and a long download of rank 0's costs each waiting rank one read a second."""


@dataclass(frozen=True)
class Restored:
    path: Path | None
    """The restored local folder (None: no complete checkpoint, start from scratch)."""
    committed: CommittedCheckpoint | None
    """The last-checkpoint record of the restored one, or None."""
    history: frozenset[tuple[int, int, int]]
    """(step, incarnation, attempt) of every manifest in storage at start, for write fencing."""
    claims: frozenset[tuple[int, int]] = frozenset()
    """(incarnation, attempt) of every attempt claim in storage at start: only newer claims that
    appear later fence this writer (one already there is history, e.g. a clock that ran ahead)."""


class RestoreAgreementError(Exception):
    """This rank cannot restore the step node rank 0 decided for the attempt (or no decision came):
    the ranks never resume from different steps, so this pod fails and the gang restarts."""

    def __init__(self, message: str, *, corrupt: Manifest | None = None) -> None:
        super().__init__(message)
        self.corrupt = corrupt
        """The decided checkpoint's manifest, when one of its files here did not match it."""
def restore_agreed(store: CheckpointStore, dest: Path, *, node_rank: int, incarnation: int, attempt: int,
                   deadline: float, stop: threading.Event | None = None, access_deadline: float | None = None,
                   poll: Backoff = DECISION_POLL, node: NodeRanks | None = None) -> Restored:
    """Restore what every rank of this attempt restores, decided once by node rank 0.

    Node rank 0 first claims the attempt (`AttemptClaim`, undecided): from then on every older
    writer (a zombie of an earlier attempt, or of a deleted job of the same name) is fenced and
    deletes nothing, so the checkpoint about to be restored cannot vanish by retention. It then
    restores the newest complete checkpoint (falling back past corrupt ones) and records the step
    in the claim. The other ranks wait for that decision and restore exactly that step; if it is
    no longer there, or no decision comes before `deadline`, they fail (RestoreAgreementError).
    They read the claim after `poll.delay(1)`, `poll.delay(2)`... seconds (`DECISION_POLL`: fast
    first, since rank 0's decision of a small checkpoint comes within a second, then backing off).

    With `node`, each node fetches only the files its ranks load (`rank_files.py`). Node rank 0 then
    never reads the other nodes' own shards: a node that finds one of them corrupt marks the step
    (`layout.corrupt_marker_name`) before it fails, so the next attempt's decision passes over it."""
    cancelled = stop.is_set if stop is not None else (lambda: False)
    sleep = stop.wait if stop is not None else time.sleep
    if incarnation == 0:
        # Not started by the operator (no KUBETRAIN_JOB_INCARNATION): claim names would repeat from
        # run to run, so each rank restores the newest complete checkpoint on its own, as before.
        return restore_newest(store, dest, deadline=deadline, stop=stop, access_deadline=access_deadline)
    claims = frozenset(retrying(store.list_claims, deadline=deadline, access_deadline=access_deadline,
                                cancelled=cancelled, sleep=sleep, what="listing attempt claims"))
    budget = max(1.0, deadline - time.monotonic())
    if node_rank == 0:
        claim = AttemptClaim(incarnation=incarnation, attempt=attempt)
        retrying(lambda: store.write_claim(claim), deadline=deadline, access_deadline=access_deadline,
                 cancelled=cancelled, sleep=sleep, what="claiming the attempt")
        restored = restore_newest(store, dest, deadline=deadline, stop=stop, access_deadline=access_deadline,
                                  node=node, node_rank=0)
        step = restored.committed.step if restored.committed is not None else None
        decided = AttemptClaim(incarnation=incarnation, attempt=attempt, decided=True, restore_step=step)
        retrying(lambda: store.write_claim(decided), deadline=time.monotonic() + budget,
                 access_deadline=access_deadline, cancelled=cancelled, sleep=sleep,
                 what="recording the restore decision")
        return replace(restored, claims=claims)
    # Node rank 0 downloads before it decides: while its claim says it is at work, wait longer than
    # the restore timeout (a big checkpoint), up to WAIT_FACTOR times it; without any claim, the timeout.
    hard = time.monotonic() + RESTORE_WAIT_FACTOR * budget
    polls = 0
    while True:
        claim = retrying(lambda: store.read_claim(incarnation, attempt), deadline=time.monotonic() + budget,
                         access_deadline=access_deadline, cancelled=cancelled, sleep=sleep, what="restore decision")
        if claim is not None and claim.decided:
            break
        if cancelled():
            raise RestoreAgreementError("stopped while waiting for node rank 0's restore decision")
        now = time.monotonic()
        if (claim is None and now > deadline) or now > hard:
            raise RestoreAgreementError("node rank 0 recorded no restore decision for this attempt in time "
                                        "(KUBETRAIN_RESTORE_TIMEOUT_SECONDS)")
        polls += 1
        sleep(poll.delay(polls))
    try:
        restored = restore_newest(store, dest, deadline=time.monotonic() + budget, stop=stop,
                                  access_deadline=access_deadline, only_step=claim.restore_step, agreed=True,
                                  node=node)
    except RestoreAgreementError as e:
        if e.corrupt is not None:
            _mark_corrupt(store, e.corrupt, node_rank, str(e), deadline=time.monotonic() + budget,
                          cancelled=cancelled, sleep=sleep)
        raise
    return replace(restored, claims=claims)


def _mark_corrupt(store: CheckpointStore, manifest: Manifest, node_rank: int, why: str, *, deadline: float,
                  cancelled: Callable[[], bool], sleep: Callable[[float], Any]) -> None:
    """Mark the commit `manifest` records as corrupt, if it is still the one in storage. Without the
    mark, the next attempt decides the same step and fails here again, so the write is retried."""
    step = manifest.step
    try:
        current = retrying(lambda: store.read_manifest(step), deadline=deadline, cancelled=cancelled, sleep=sleep,
                           what="re-reading the manifest")
        if current is None or current.writer != manifest.writer or current.files != manifest.files:
            log.warning("checkpoint-%d was committed again or removed since it was verified here: not marked", step)
            return
        record = json.dumps({"node_rank": node_rank, "reason": why, "time": rfc3339()}).encode()
        retrying(lambda: store.put_bytes(step, corrupt_marker_name(node_rank, manifest.writer), record),
                 deadline=deadline, cancelled=cancelled, sleep=sleep, what="marking the checkpoint corrupt")
        log.error("checkpoint-%d marked corrupt: the next attempt restores an older one", step)
    except StorageError as e:
        log.error("could not mark checkpoint-%d corrupt: %s", step, e)


def restore_newest(store: CheckpointStore, dest: Path, *, deadline: float, stop: threading.Event | None = None,
                   access_deadline: float | None = None, only_step: int | None = None,
                   agreed: bool = False, node: NodeRanks | None = None, node_rank: int = 0) -> Restored:
    """Download the newest COMPLETE checkpoint into `dest`, every file verified; older ones if it is corrupt.

    Temporary storage errors are retried until `deadline`, refused access or a
    missing bucket until `access_deadline` (None: not retried); a checksum
    mismatch marks that checkpoint bad and falls back to the next older one; a file whose
    bytes differ from its digest also marks it corrupt in storage (as node `node_rank`), so
    later attempts pass over it instead of downloading it in full again.
    """
    cancelled = stop.is_set if stop is not None else (lambda: False)
    sleep = stop.wait if stop is not None else time.sleep  # a SIGTERM cuts a backoff wait short
    remote = retrying(store.list_checkpoints, deadline=deadline, access_deadline=access_deadline,
                      cancelled=cancelled, sleep=sleep, what="listing checkpoints")
    history = frozenset((c.step, *c.manifest.writer) for c in remote if c.manifest is not None)
    bad: set[int] = set()
    if agreed:
        # Exactly the step node rank 0 decided (None: from scratch), never a fallback of our own.
        if only_step is None:
            log.info("node rank 0 decided to start from scratch")
            return Restored(path=None, committed=None, history=history)
        remote = [c for c in remote if c.step == only_step]
        if newest_complete(remote) is None:
            raise RestoreAgreementError(f"checkpoint-{only_step}, which node rank 0 restored for this attempt, "
                                        "is no longer complete in storage")
    while (chosen := newest_complete(remote, exclude=bad)) is not None:
        if stop is not None and stop.is_set():
            # Not "nothing to restore": node rank 0 would record that decision, and the gang start from step 0.
            raise RestoreAgreementError(f"stopped (SIGTERM) before checkpoint-{chosen.step} was restored")
        manifest = chosen.manifest
        assert manifest is not None
        try:
            path = retrying(lambda: store.download_checkpoint(manifest, dest, node=node, cancelled=cancelled),
                            deadline=deadline, access_deadline=access_deadline, cancelled=cancelled, sleep=sleep,
                            what="restore")
        except TransferStopped:
            raise RestoreAgreementError(f"stopped (SIGTERM) while checkpoint-{chosen.step} was downloading") from None
        except ChecksumError as e:
            if agreed:
                raise RestoreAgreementError(
                    f"checkpoint-{chosen.step}, which node rank 0 restored for this attempt, failed verification "
                    f"here: {e}", corrupt=manifest if isinstance(e, DigestMismatchError) else None) from None
            log.error("checkpoint-%d is corrupt (%s); trying an older one", chosen.step, e)
            bad.add(chosen.step)
            if isinstance(e, DigestMismatchError):
                _mark_corrupt(store, manifest, node_rank, str(e), deadline=deadline, cancelled=cancelled, sleep=sleep)
            continue
        log.info("restored checkpoint-%d (attempt %d) into %s", chosen.step, manifest.attempt, path)
        committed = CommittedCheckpoint(step=chosen.step, uri=store.checkpoint_uri(chosen.step), time=manifest.created)
        return Restored(path=path, committed=committed, history=history)
    log.info("no complete checkpoint in %s: starting from scratch", store.location.uri)
    return Restored(path=None, committed=None, history=history)


def best_step_to_fetch(folder: Path) -> int | None:
    """The step of the best checkpoint the restored `folder`'s trainer_state.json names (`best_model_checkpoint`),
    when the run loads it at its end and it is another folder than `folder`; else None. Whether the run loads it:
    kubetrain's Trainer records `load_best_model_at_end` in training_args.json; other writers (HF) are assumed to."""
    try:
        state = json.loads((folder / TRAINER_STATE).read_text())
        best = state.get("best_model_checkpoint") if isinstance(state, dict) else None
        step = parse_checkpoint_dirname(PurePosixPath(best.rstrip("/")).name) if isinstance(best, str) else None
        args_file = folder / "training_args.json"
        if args_file.is_file() and json.loads(args_file.read_text()).get("load_best_model_at_end") is not True:
            return None
    except (OSError, ValueError, AttributeError):
        return None
    return step if step is not None and step != parse_checkpoint_dirname(folder.name) else None


def fetch_best(store: CheckpointStore, restored: Restored, dest: Path, *, deadline: float,
               stop: threading.Event | None = None, access_deadline: float | None = None,
               node: NodeRanks | None = None) -> Path | None:
    """After a restore: download the best checkpoint the restored one names (`best_step_to_fetch`) next to it,
    so `load_best_model_at_end` finds it on local disk (the restore itself fetches only the newest; remote
    retention keeps the best). With `node`, this node's files only, as the restore. Never fails the restore:
    a best checkpoint not (or no longer) complete in storage, or a failed download, is logged and None
    returned (the trainer then keeps its last model, as HF does)."""
    step = best_step_to_fetch(restored.path) if restored.path is not None else None
    if step is None:
        return None
    cancelled = stop.is_set if stop is not None else (lambda: False)
    sleep = stop.wait if stop is not None else time.sleep
    try:
        remote = retrying(store.list_checkpoints, deadline=deadline, access_deadline=access_deadline,
                          cancelled=cancelled, sleep=sleep, what="listing checkpoints")
        chosen = newest_complete([c for c in remote if c.step == step])
        if chosen is None or chosen.manifest is None:
            log.warning("the best checkpoint, %s, is not complete in %s: load_best_model_at_end will keep the "
                        "last model", checkpoint_dirname(step), store.location.uri)
            return None
        manifest = chosen.manifest
        path = retrying(lambda: store.download_checkpoint(manifest, dest, node=node, cancelled=cancelled),
                        deadline=deadline, access_deadline=access_deadline, cancelled=cancelled, sleep=sleep,
                        what="fetching the best checkpoint")
    except (StorageError, TransferStopped, OSError) as e:  # OSError: e.g. no room on this disk for it
        shutil.rmtree(dest / f".{checkpoint_dirname(step)}.restoring", ignore_errors=True)
        log.warning("the best checkpoint, %s, could not be fetched (%s): load_best_model_at_end will keep the "
                    "last model", checkpoint_dirname(step), e)
        return None
    log.info("fetched the best checkpoint, %s, into %s (for load_best_model_at_end)", checkpoint_dirname(step), path)
    return path
