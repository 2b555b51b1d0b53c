"""A checkpoint whose bytes in storage differ from its manifest, found by node rank 0 (or a single-node
job) at restore: it falls back to an older one AND marks the commit corrupt in storage, so no later
attempt downloads it in full again (the other nodes already marked it; rank 0 did not)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from kubetrain_trainer.commit import SyncSettings
from kubetrain_trainer.restore import restore_newest
from kubetrain_trainer.retry import Backoff
from kubetrain_trainer.sync import CheckpointUploader


def _commit(store, tmp_path: Path, steps) -> None:
    up = CheckpointUploader(store, SyncSettings(attempt=1, world_size=1, strategy="ddp",
                                                backoff=Backoff(0.01, 0.05)), staging_dir=tmp_path / "stage").start()
    for s in steps:
        d = tmp_path / "out" / f"checkpoint-{s}"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(bytes([s % 256]) * 4096)
        (d / "trainer_state.json").write_text(json.dumps({"global_step": s, "log_history": []}))
        up.submit(d, s)
        assert up.wait(10)
    assert up.close(10)


def test_a_corrupt_newest_found_by_node_rank_0_is_marked_and_never_downloaded_again(tmp_path, mem_s3, mem_store):
    store = mem_store()
    _commit(store, tmp_path, [100, 200])
    mem_s3.objects["ns/job/checkpoint-200/model.safetensors"] = b"\xff" * 4096  # same size, other bytes
    first = restore_newest(store, tmp_path / "r1", deadline=time.monotonic() + 30)
    assert first.committed is not None and first.committed.step == 100
    assert [k for k in mem_s3.objects if "/corrupt." in k] == ["ns/job/checkpoint-200/corrupt.node-0.0-1.json"]
    assert not next(c for c in store.list_checkpoints() if c.step == 200).complete

    gets = []
    download = mem_s3.download_fileobj
    mem_s3.download_fileobj = lambda Bucket, Key, *a, **kw: gets.append(Key) or download(Bucket, Key, *a, **kw)
    again = restore_newest(store, tmp_path / "r2", deadline=time.monotonic() + 30)
    assert again.committed is not None and again.committed.step == 100
    assert not [k for k in gets if "checkpoint-200" in k]
