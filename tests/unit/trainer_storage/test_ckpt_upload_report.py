"""What the uploader reports about each checkpoint (for metrics and the last-checkpoint record).

The record gains `sizeBytes`, `saveSeconds` and `uploadSeconds` (docs/contract.md,
"Reporting the last checkpoint") so that users can size the grace period; the
metrics count committed uploads and bytes. S3 is faked in memory as in
test_ckpt_sync.py (the same uploader against MinIO: tests/integration/trainer_storage).
"""

from __future__ import annotations

import json
from pathlib import Path

from test_ckpt_sync import MemoryStore, _local_checkpoint, _uploader

from kubetrain_trainer.manifest import Manifest


def test_a_commit_reports_size_upload_and_save_time(tmp_path: Path):
    store = MemoryStore()
    uploads, committed = [], []
    up = _uploader(tmp_path, store)
    up.on_upload, up.on_commit = (lambda *a: uploads.append(a)), committed.append
    up.save_seconds = {5: 1.25}.get
    store.fail_next = 2  # two failed tries first: the upload time covers them
    assert up.submit(_local_checkpoint(tmp_path / "out", 5), 5)
    assert up.submit(_local_checkpoint(tmp_path / "out", 7), 7)
    assert up.close(30)
    sizes = {s: Manifest.from_json(store.objects[f"checkpoint-{s}/manifest.json"]).total_bytes for s in (5, 7)}
    assert [(step, size) for step, size, _seconds in uploads] == [(5, sizes[5]), (7, sizes[7])]
    assert all(seconds >= 0 for _s, _b, seconds in uploads)
    assert up.bytes_uploaded == sizes[5] + sizes[7]
    first = committed[0]
    assert (first.step, first.size_bytes, first.save_seconds) == (5, sizes[5], 1.25)
    assert first.upload_seconds == uploads[0][2]
    assert committed[1].save_seconds is None  # the workers did not report that save
    record = json.loads(first.to_json())
    assert record["sizeBytes"] == sizes[5] and record["saveSeconds"] == 1.25
    assert record["uploadSeconds"] == first.upload_seconds
    assert up.last_committed == committed[1]


def test_other_nodes_report_their_part_and_commit_nothing(tmp_path: Path):
    store = MemoryStore()
    node1 = _uploader(tmp_path / "n1", store, nnodes=2, node_rank=1)
    uploads = []
    node1.on_upload = lambda *a: uploads.append(a)
    part = tmp_path / "o1" / "checkpoint-3"
    part.mkdir(parents=True)
    (part / "rng_state_1.pth").write_bytes(b"12345")
    node1.submit(part, 3)
    assert node1.close(10)
    assert [(step, size) for step, size, _seconds in uploads] == [(3, 5)] and node1.bytes_uploaded == 5
    assert node1.last_committed is None and "checkpoint-3/manifest.json" not in store.objects
