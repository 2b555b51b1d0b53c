"""Pure commit rules of decisions.py: "already committed" on one and many nodes, stale multipart uploads."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from kubetrain_trainer.decisions import MultipartUpload, RemoteCheckpoint, is_already_committed, stale_multipart_uploads
from kubetrain_trainer.manifest import FileEntry, Manifest

A = FileEntry("rng_state_0.pth", 1, "a" * 32)
B = FileEntry("rng_state_1.pth", 1, "b" * 32)
A2 = FileEntry("rng_state_0.pth", 1, "c" * 32)  # same path, other content


def _remote(files, *, attempt=2, listed=None) -> RemoteCheckpoint:
    m = Manifest(step=7, attempt=attempt, world_size=2, strategy="ddp", files=tuple(files))
    listing = {f.path: f.size for f in (listed if listed is not None else files)} | {"manifest.json": 10}
    return RemoteCheckpoint(step=7, manifest=m, listing=listing)


@pytest.mark.parametrize(
    "existing, own, nnodes, committed",
    [
        (_remote([A]), [A], 1, True),
        (_remote([A, B]), [A], 1, False),  # one node: exactly its files
        (_remote([A, B]), [A], 2, True),  # node 0 of two: the merged manifest holds its files
        (_remote([A, B]), [A2], 2, False),  # different content at the same path
        (_remote([A, B], attempt=1), [A], 2, False),  # an older attempt's commit is not ours
        (_remote([A, B], listed=[A]), [A], 2, False),  # B missing from storage: not complete
        (None, [A], 1, False),
    ],
)
def test_is_already_committed(existing, own, nnodes, committed):
    assert is_already_committed(existing, attempt=2, files=own, nnodes=nnodes) is committed


def test_only_uploads_begun_before_this_attempt_are_stale():
    start = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
    old = MultipartUpload("p/checkpoint-5/model.safetensors", "u1", start - timedelta(hours=1))
    recent = MultipartUpload("p/checkpoint-6/model.safetensors", "u2", start - timedelta(seconds=60))
    ours = MultipartUpload("p/checkpoint-7/model.safetensors", "u3", start + timedelta(minutes=5))
    assert stale_multipart_uploads([old, recent, ours], attempt_started=start) == [old]
    assert stale_multipart_uploads([old, recent, ours], attempt_started=start, margin_s=0) == [old, recent]
