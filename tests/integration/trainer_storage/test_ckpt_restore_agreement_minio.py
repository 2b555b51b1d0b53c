"""Restore agreement and attempt claims against a real MinIO: every rank of an attempt restores the
step node rank 0 decided, and a newer attempt's claim fences an older writer before it commits."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kubetrain_trainer.decisions import RetentionPolicy
from kubetrain_trainer.restore import RestoreAgreementError, restore_agreed

from test_ckpt_storage_minio import _checkpoint, _same_tree, _store, _uploader

pytestmark = pytest.mark.integration


def _commit(store, tmp_path: Path, steps, **kw) -> None:
    up = _uploader(store, tmp_path, **kw)
    for step in steps:
        assert up.submit(_checkpoint(tmp_path / "out", step), step)
    assert up.close(120), up.status_line()


def test_every_rank_restores_the_step_node_0_decided(ckpt_env, minio, tmp_path: Path):
    store = _store(ckpt_env)
    _commit(store, tmp_path, [10, 20])
    follower: dict = {}

    def rank1():
        try:
            follower["restored"] = restore_agreed(store, tmp_path / "r1", node_rank=1, incarnation=7, attempt=2,
                                                  deadline=time.monotonic() + 120)
        except Exception as e:  # noqa: BLE001 - reported below
            follower["error"] = e

    t = threading.Thread(target=rank1)
    t.start()  # rank 1 comes up first and waits for the decision
    time.sleep(1.0)
    assert t.is_alive(), "rank 1 must not restore before node rank 0 decided"
    leader = restore_agreed(store, tmp_path / "r0", node_rank=0, incarnation=7, attempt=2,
                            deadline=time.monotonic() + 120)
    t.join(120)
    assert "error" not in follower, follower
    assert leader.committed.step == follower["restored"].committed.step == 20
    claim = store.read_claim(7, 2)
    assert claim.decided and claim.restore_step == 20 and (7, 2) in store.list_claims()


def test_a_decided_step_that_vanished_fails_the_rank_instead_of_resuming_elsewhere(ckpt_env, minio, tmp_path: Path):
    store = _store(ckpt_env)
    _commit(store, tmp_path, [10, 20])
    restore_agreed(store, tmp_path / "r0", node_rank=0, incarnation=5, attempt=2, deadline=time.monotonic() + 120)
    store.delete_checkpoint(20)  # lost between rank 0's restore and rank 1's
    with pytest.raises(RestoreAgreementError, match="checkpoint-20"):
        restore_agreed(store, tmp_path / "r1", node_rank=1, incarnation=5, attempt=2, deadline=time.monotonic() + 60)
    assert not (tmp_path / "r1" / "checkpoint-10").exists(), "never a step of its own choosing"


def test_no_decision_in_time_is_a_clear_failure(ckpt_env, minio, tmp_path: Path):
    store = _store(ckpt_env)
    with pytest.raises(RestoreAgreementError, match="no restore decision"):
        restore_agreed(store, tmp_path / "r1", node_rank=1, incarnation=5, attempt=3,
                       deadline=time.monotonic() + 2)


def test_an_older_attempt_commits_and_deletes_nothing_once_a_newer_one_claimed(ckpt_env, minio, tmp_path: Path):
    """A zombie of attempt 1 (its node force-deleted, the process still running) against attempt 2,
    which is restoring: no commit over it, and its retention never removes what attempt 2 restores."""
    store = _store(ckpt_env)
    zombie = _uploader(store, tmp_path / "z", attempt=1, incarnation=5, retention=RetentionPolicy(save_total_limit=1))
    assert zombie.submit(_checkpoint(tmp_path / "z" / "out", 10), 10)
    assert zombie.wait(60)
    restored = restore_agreed(store, tmp_path / "a2", node_rank=0, incarnation=5, attempt=2,
                              deadline=time.monotonic() + 120)
    assert restored.committed.step == 10
    zombie.submit(_checkpoint(tmp_path / "z" / "out", 20), 20)
    zombie.close(60)
    assert zombie.fenced and "attempt 2 > 1 has started" in zombie.fenced, zombie.fenced
    steps = {c.step: c.complete for c in store.list_checkpoints()}
    assert steps.get(10) is True and not steps.get(20), steps


class _ClaimAfterFirstFile:
    """The real store, with a newer attempt starting and committing the same step right after the
    zombie's first file went up (the window a check-once-per-checkpoint fence left open)."""

    def __init__(self, store, newer) -> None:
        self._store, self._newer, self.uploads_after = store, newer, []
        self._lock = threading.Lock()  # the zombie may upload several files at once

    def upload_file(self, step, local, rel, **kw):
        with self._lock:
            if self._newer is None:
                self.uploads_after.append(rel)
        self._store.upload_file(step, local, rel, **kw)
        with self._lock:
            newer, self._newer = self._newer, None
        if newer is not None:
            newer()

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.mark.parametrize("files_in_flight", [1, 4])
def test_a_zombie_stops_at_its_next_file_and_never_overwrites_a_newer_commit(ckpt_env, minio, tmp_path: Path,
                                                                            files_in_flight: int):
    store = _store(ckpt_env, upload_file_concurrency=files_in_flight)
    _commit(store, tmp_path / "a1", [10], incarnation=5)

    def attempt_2_commits_step_20():
        restore_agreed(store, tmp_path / "a2", node_rank=0, incarnation=5, attempt=2,
                       deadline=time.monotonic() + 120)
        up = _uploader(store, tmp_path / "a2", attempt=2, incarnation=5)
        assert up.submit(_checkpoint(tmp_path / "a2" / "out", 20), 20)
        assert up.close(120), up.status_line()

    seam = _ClaimAfterFirstFile(store, attempt_2_commits_step_20)
    zombie = _uploader(seam, tmp_path / "z", attempt=1, incarnation=5, fence_check_interval_s=0)
    zombie.submit(_checkpoint(tmp_path / "z" / "out", 20), 20)
    zombie.close(60)
    assert zombie.fenced and "attempt 2 > 1 has started" in zombie.fenced, zombie.fenced
    # No file starts after the claim, except those whose fence check had passed just before it: at most
    # one per other upload thread (none when files go one at a time).
    assert len(seam.uploads_after) <= files_in_flight - 1, \
        f"the zombie wrote {seam.uploads_after} after attempt 2 claimed"
    manifest = store.read_manifest(20)
    assert manifest is not None and manifest.attempt == 2
    # Attempt 2's checkpoint-20 is whole: every byte matches its manifest.
    restored = store.download_checkpoint(manifest, tmp_path / "check")
    _same_tree(tmp_path / "a2" / "out" / "checkpoint-20", restored)


class _ClaimMidFile:
    """The real store, with a newer attempt claiming while the zombie's big file is going out."""

    def __init__(self, store, newer) -> None:
        self._store, self._newer = store, newer

    def upload_file(self, step, local, rel, *, still_allowed=None, **kw):
        def check():
            if self._newer is not None and rel == "big.bin":
                newer, self._newer = self._newer, None
                newer()
            if still_allowed is not None:
                still_allowed()

        self._store.upload_file(step, local, rel, still_allowed=check, **kw)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_zombie_stops_inside_a_multipart_upload_and_leaves_no_object_nor_parts(ckpt_env, minio, tmp_path: Path):
    store = _store(ckpt_env)
    _commit(store, tmp_path / "a1", [10], incarnation=5)
    seam = _ClaimMidFile(store, lambda: restore_agreed(store, tmp_path / "a2", node_rank=0, incarnation=5, attempt=2,
                                                       deadline=time.monotonic() + 120))
    zombie = _uploader(seam, tmp_path / "z", attempt=1, incarnation=5, fence_check_interval_s=0)
    zombie.submit(_checkpoint(tmp_path / "z" / "out", 20, big=12 * 1024 * 1024), 20)  # 3 parts of 5 MiB
    zombie.close(60)
    assert zombie.fenced and "attempt 2 > 1 has started" in zombie.fenced, zombie.fenced
    key = store.location.key("checkpoint-20", "big.bin")
    assert store._list(key) == [], "the zombie's big file was stored after attempt 2 claimed"
    assert [u for u in store.list_multipart_uploads() if u.key == key] == [], "its parts were left behind"
