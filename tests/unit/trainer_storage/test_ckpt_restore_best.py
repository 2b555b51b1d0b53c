"""After a resume the best checkpoint must be on local disk for `load_best_model_at_end` (`restore.fetch_best`):
the restore fetches the newest complete checkpoint, then the best one its trainer_state.json names (remote
retention kept it). A best that is not in storage, or a run that does not load it, fetches nothing and never
fails the restore. The S3 client is the in-memory stand-in (`conftest.MemS3`)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from kubetrain_trainer.commit import SyncSettings
from kubetrain_trainer.decisions import RetentionPolicy
from kubetrain_trainer.restore import best_step_to_fetch, fetch_best, restore_newest
from kubetrain_trainer.retry import Backoff
from kubetrain_trainer.sync import CheckpointUploader


def _commit(store, tmp_path: Path, *, load_best: bool = True, limit: int | None = 1) -> None:
    """checkpoint-2..6, best checkpoint-4 (as kubetrain's Trainer writes them: trainer_state, training_args)."""
    up = CheckpointUploader(store, SyncSettings(attempt=1, world_size=1, strategy="ddp", backoff=Backoff(0.01, 0.05),
                                                retention=RetentionPolicy(save_total_limit=limit,
                                                                          metric_for_best_model="score",
                                                                          greater_is_better=False)),
                            staging_dir=tmp_path / "stage").start()
    for step, score in ((2, 3.0), (4, 1.0), (6, 2.0)):
        d = tmp_path / "out" / f"checkpoint-{step}"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(bytes([step]) * 64)
        best = min(((s, v) for s, v in ((2, 3.0), (4, 1.0), (6, 2.0)) if s <= step), key=lambda x: x[1])
        (d / "trainer_state.json").write_text(json.dumps({
            "global_step": step, "best_metric": best[1], "best_global_step": best[0],
            "best_model_checkpoint": f"/old/pod/out/checkpoint-{best[0]}",
            "log_history": [{"step": step, "eval_score": score}]}))
        (d / "training_args.json").write_text(json.dumps({"load_best_model_at_end": load_best}))
        up.submit(d, step)
        assert up.wait(10)
    assert up.close(10)


def test_the_best_checkpoint_is_fetched_next_to_the_restored_one(tmp_path, mem_s3, mem_store):
    store = mem_store()
    _commit(store, tmp_path)
    assert sorted(c.step for c in store.list_checkpoints()) == [4, 6]  # retention kept the best
    dest = tmp_path / "pod2"
    restored = restore_newest(store, dest, deadline=time.monotonic() + 30)
    assert restored.path == dest / "checkpoint-6"
    assert fetch_best(store, restored, dest, deadline=time.monotonic() + 30) == dest / "checkpoint-4"
    assert (dest / "checkpoint-4" / "model.safetensors").read_bytes() == bytes([4]) * 64
    assert (dest / "checkpoint-4" / "manifest.json").is_file()  # the watcher takes it as restored, not new


def test_a_best_checkpoint_not_in_storage_fetches_nothing_and_never_fails(tmp_path, mem_s3, mem_store, caplog):
    store = mem_store()
    _commit(store, tmp_path)
    for key in [k for k in mem_s3.objects if "/checkpoint-4/" in k]:
        del mem_s3.objects[key]
    dest = tmp_path / "pod2"
    restored = restore_newest(store, dest, deadline=time.monotonic() + 30)
    with caplog.at_level(logging.WARNING):
        assert fetch_best(store, restored, dest, deadline=time.monotonic() + 30) is None
    assert "checkpoint-4, is not complete" in caplog.text
    assert not (dest / "checkpoint-4").exists()


def test_a_run_that_does_not_load_the_best_fetches_nothing(tmp_path, mem_store):
    store = mem_store()
    _commit(store, tmp_path, load_best=False)
    dest = tmp_path / "pod2"
    restored = restore_newest(store, dest, deadline=time.monotonic() + 30)
    assert fetch_best(store, restored, dest, deadline=time.monotonic() + 30) is None
    assert sorted(p.name for p in dest.iterdir()) == ["checkpoint-6"]


def test_which_best_step_to_fetch(tmp_path):
    folder = tmp_path / "checkpoint-6"
    folder.mkdir()
    assert best_step_to_fetch(folder) is None  # no trainer_state.json
    (folder / "trainer_state.json").write_text(json.dumps({"best_model_checkpoint": "/x/checkpoint-6"}))
    assert best_step_to_fetch(folder) is None  # the restored one itself
    (folder / "trainer_state.json").write_text(json.dumps({"best_model_checkpoint": "/x/checkpoint-4/"}))
    assert best_step_to_fetch(folder) == 4  # another writer (HF): assumed to load it
    (folder / "training_args.json").write_text(json.dumps({"load_best_model_at_end": False}))
    assert best_step_to_fetch(folder) is None
    (folder / "training_args.json").write_text(json.dumps({"load_best_model_at_end": True}))
    assert best_step_to_fetch(folder) == 4
    (folder / "trainer_state.json").write_text("not json")
    assert best_step_to_fetch(folder) is None


def test_the_launchers_restore_puts_the_best_checkpoint_on_local_disk_too(tmp_path, mem_store):
    import threading

    from kubetrain_trainer.metrics import Telemetry
    from kubetrain_trainer.session import CheckpointSession, SessionConfig

    store = mem_store()
    _commit(store, tmp_path)
    local = tmp_path / "pod2" / "checkpoints"
    config = SessionConfig(local_dir=local, node_rank=0, nnodes=1, world_size=1, attempt=2, incarnation=0,
                           strategy="ddp", retention=RetentionPolicy(save_total_limit=1), restore_timeout_s=30,
                           access_retry_s=0, settle_s=30, commit_mode="auto", termination_log=tmp_path / "term")
    session = CheckpointSession(store, config, stop=threading.Event(),
                                telemetry=Telemetry(progress_file=tmp_path / "progress.json", attempt=2, incarnation=0))
    restored = session.restore()
    assert restored.path == local / "checkpoint-6"  # what the workers resume from: still the newest
    assert sorted(p.name for p in local.iterdir()) == ["checkpoint-4", "checkpoint-6"]
