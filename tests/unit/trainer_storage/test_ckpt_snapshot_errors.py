"""Errors while a local checkpoint is snapshotted for upload (`sync._snapshot`, `CheckpointUploader.submit`,
`WatchLoop.scan_once`): a folder rotated away mid-snapshot is never committed incomplete; any other error
(a full staging disk) leaves no partial copy, drops no folder for good, and never escapes the last scan."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from kubetrain_trainer import sync
from kubetrain_trainer.commit import SyncSettings
from kubetrain_trainer.retry import Backoff
from kubetrain_trainer.sync import CheckpointUploader
from kubetrain_trainer.watcher import FolderWatcher, WatchLoop


def _deepspeed_like(root: Path, step: int = 10) -> Path:
    src = root / f"checkpoint-{step}"
    (src / f"global_step{step}").mkdir(parents=True)
    (src / f"global_step{step}" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 100)
    (src / "trainer_state.json").write_text("{}")
    (src / "latest").write_text(f"global_step{step}")
    return src


def test_a_subfolder_rotated_away_mid_snapshot_fails_it(tmp_path, monkeypatch):
    src = _deepspeed_like(tmp_path / "out")
    link = os.link

    def link_then_rotation(a, b):
        link(a, b)
        shutil.rmtree(src / "global_step10", ignore_errors=True)  # the trainer's rotation deletes meanwhile

    monkeypatch.setattr(sync.os, "link", link_then_rotation)
    with pytest.raises(FileNotFoundError):
        sync._snapshot(src, tmp_path / "snap")


def test_a_folder_rotated_away_after_its_walk_fails_the_snapshot(tmp_path, monkeypatch):
    src = _deepspeed_like(tmp_path / "out")
    walk = os.walk

    def walk_then_rotation(top, **kw):
        yield from walk(top, **kw)
        shutil.rmtree(src)

    monkeypatch.setattr(sync.os, "walk", walk_then_rotation)
    with pytest.raises(FileNotFoundError):
        sync._snapshot(src, tmp_path / "snap")


def test_a_folder_rotated_away_mid_snapshot_is_not_queued(tmp_path, monkeypatch, mem_store):
    src = _deepspeed_like(tmp_path / "out")
    up = CheckpointUploader(mem_store(), SyncSettings(attempt=1, world_size=1, strategy="ddp"),
                            staging_dir=tmp_path / "staging")
    (tmp_path / "staging").mkdir()
    link = os.link
    monkeypatch.setattr(sync.os, "link", lambda a, b: (link(a, b), shutil.rmtree(src / "global_step10", True)))
    assert up.submit(src, 10) is False
    assert up.pending_steps() == []
    assert list((tmp_path / "staging").iterdir()) == []


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _full_disk_then_room(tmp_path, monkeypatch, mem_store, steps):
    out = tmp_path / "mnt" / "checkpoints"  # another file system than staging: every file is copied
    for step in steps:
        d = out / f"checkpoint-{step}"
        d.mkdir(parents=True)
        for i in range(3):
            (d / f"shard-{i}.bin").write_bytes(b"x" * 1000)
        (d / ".kubetrain-ready").write_text("")
    staging = tmp_path / ".checkpoints.upload-staging"
    up = CheckpointUploader(mem_store(), SyncSettings(attempt=1, world_size=1, strategy="ddp",
                                                      backoff=Backoff(0.01, 0.05)), staging_dir=staging).start()

    def no_link(a, b):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    copies: list[str] = []
    copy = shutil.copyfile

    def copy_until_full(a, b):
        copies.append(a)
        if len(copies) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return copy(a, b)

    monkeypatch.setattr(sync.os, "link", no_link)
    monkeypatch.setattr(sync.shutil, "copyfile", copy_until_full)
    clock = Clock()
    loop = WatchLoop(FolderWatcher(out, node_rank=0, clock=clock), up)
    loop.scan_once()  # checkpoint-10's copy hits the full disk: not raised
    assert not [p for p in staging.iterdir() if p.name.startswith("checkpoint-10.")]  # no partial copy
    monkeypatch.setattr(sync.shutil, "copyfile", copy)  # room again
    return out, staging, up, loop, clock


def test_a_full_staging_disk_leaves_no_partial_copy_and_the_folder_is_tried_again(tmp_path, monkeypatch, mem_s3,
                                                                                    mem_store):
    _, staging, up, loop, clock = _full_disk_then_room(tmp_path, monkeypatch, mem_store, (10,))
    loop.scan_once()
    assert up.wait(10)
    assert not any("checkpoint-10/" in k for k in mem_s3.objects)  # not at every poll: after a backoff
    clock.now += 60
    loop.scan_once()
    assert up.close(10)
    assert "ns/job/checkpoint-10/manifest.json" in mem_s3.objects
    assert list(staging.iterdir()) == []


def test_a_folder_tried_again_behind_a_newer_one_is_superseded_not_uploaded_after_it(tmp_path, monkeypatch, mem_s3,
                                                                                      mem_store):
    """checkpoint-10 hit the full disk; checkpoint-20 (say the emergency checkpoint) went out meanwhile. The
    retry must not queue 10 behind 20: on preemption `keep_only_newest` kept the last queued (10) and dropped
    20, the resume went back to the older step."""
    out, staging, up, loop, clock = _full_disk_then_room(tmp_path, monkeypatch, mem_store, (10, 20))
    loop.scan_once()
    clock.now += 60
    loop.writers_exited(clean=True)
    loop.scan_once()  # the last scan tries 10 again at once
    assert 10 in up.dropped and up.keep_only_newest() == []
    assert up.close(10)
    assert "ns/job/checkpoint-20/manifest.json" in mem_s3.objects
    assert not any("checkpoint-10/" in k for k in mem_s3.objects)
    assert list(staging.iterdir()) == []


def test_the_last_scan_after_the_workers_exit_never_raises(tmp_path, monkeypatch, mem_store):
    out = tmp_path / "out"
    d = out / "checkpoint-5"
    d.mkdir(parents=True)
    (d / "model.bin").write_bytes(b"w")
    (d / ".kubetrain-ready").write_text("")
    up = CheckpointUploader(mem_store(), SyncSettings(attempt=1, world_size=1, strategy="ddp"),
                            staging_dir=tmp_path / "staging").start()
    loop = WatchLoop(FolderWatcher(out, node_rank=0), up, interval_s=3600).start()

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sync, "_snapshot", full)
    loop.writers_exited(clean=False)
    loop.stop()  # logged as a storage problem; the launcher goes on to drain
    monkeypatch.setattr(loop.watcher, "poll", lambda: 1 / 0)
    loop.stop()
    assert up.close(1)


def test_a_folder_the_rotation_has_half_removed_is_never_snapshotted(tmp_path, monkeypatch):
    """`shutil.rmtree` removes file by file and the folder last: a snapshot starting while it is half done found
    the folder still there and committed what was left. The rotation renames the folder away first."""
    from kubetrain_trainer import checkpoint

    src = _deepspeed_like(tmp_path / "out")
    (src / "model.safetensors").write_bytes(b"m" * 10)

    def half_done(path, ignore_errors=False):  # the removal, caught after its first file
        next(p for p in sorted(Path(path).rglob("*")) if p.is_file()).unlink()

    monkeypatch.setattr(checkpoint.shutil, "rmtree", half_done)
    checkpoint.remove_checkpoint(src)
    with pytest.raises(FileNotFoundError):
        sync._snapshot(src, tmp_path / "snap")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["tmp-checkpoint-10-deleting"]  # cleared at next start


def test_save_total_limit_counts_a_node_s_share_of_a_checkpoint(tmp_path):
    """On nodes that share no disk with world rank 0, a committed folder holds this node's files and its ready
    marker, no trainer_state.json: it still counts for save_total_limit (else such a node's disk filled up)."""
    from kubetrain_trainer import checkpoint
    from kubetrain_trainer.readiness import READY_MARKER

    out = tmp_path / "out"
    for step in (2, 4, 6):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "rng_state_1.pth").write_bytes(b"r")
        (out / f"checkpoint-{step}" / READY_MARKER).write_text("")
    (out / "checkpoint-8").mkdir()  # not committed: neither counted nor deleted
    assert checkpoint.list_checkpoints(out) == []  # not a checkpoint to resume from on its own
    doomed = checkpoint.rotate_checkpoints(out, limit=2, keep=[str(out / "checkpoint-2")])
    assert [p.name for p in doomed] == ["checkpoint-4"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-6", "checkpoint-8"]
