"""Checkpoint storage against a real MinIO: commit, restore, torn uploads, retention, fencing, outages."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from kubetrain_testbed import free_port
from kubetrain_trainer.decisions import RetentionPolicy, newest_complete
from kubetrain_trainer.retry import Backoff
from kubetrain_trainer.storage import CheckpointStore, StorageConfig
from kubetrain_trainer.storage_errors import ChecksumError, StoragePermanentError, StorageTemporaryError
from kubetrain_trainer.restore import restore_newest
from kubetrain_trainer.commit import SyncSettings
from kubetrain_trainer.sync import CheckpointUploader

pytestmark = pytest.mark.integration
MiB = 1 << 20


def _store(env, **overrides) -> CheckpointStore:
    # A 5 MiB multipart threshold (S3's minimum part size) so a 12 MiB file goes multipart.
    cfg = StorageConfig.from_env(env, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, **overrides)
    return CheckpointStore(cfg)


def _uploader(store, tmp_path: Path, *, attempt=1, **kw) -> CheckpointUploader:
    settings = SyncSettings(attempt=attempt, world_size=2, strategy="ddp",
                            backoff=Backoff(initial_s=0.2, maximum_s=1.0), status_interval_s=0.5, **kw)
    return CheckpointUploader(store, settings, staging_dir=tmp_path / f"staging-a{attempt}").start()


def _checkpoint(root: Path, step: int, *, big: int = 0, eval_loss: float | None = None) -> Path:
    folder = root / f"checkpoint-{step}"
    (folder / "shards").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(os.urandom(1000 + step))
    (folder / "shards" / "optimizer.rank0.pt").write_bytes(os.urandom(300))
    (folder / "empty.bin").write_bytes(b"")
    if big:
        (folder / "big.bin").write_bytes(os.urandom(big))
    history = [{"step": step, "loss": 1.0}]
    if eval_loss is not None:
        history.append({"step": step, "eval_loss": eval_loss})
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))
    return folder


def _same_tree(a: Path, b: Path) -> None:
    files_a = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert files_a == files_b
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def test_commit_and_restore_round_trip_is_byte_exact_with_multipart(ckpt_env, minio, tmp_path: Path):
    store = _store(ckpt_env)
    src = _checkpoint(tmp_path / "out", 40, big=12 * MiB)
    up = _uploader(store, tmp_path)
    assert up.submit(src, 40)
    assert up.close(240), up.status_line()
    (c,) = store.list_checkpoints()
    assert c.complete and c.manifest.step == 40 and c.manifest.attempt == 1
    assert c.manifest.metrics == {"loss": 1.0}
    key = store.location.key("checkpoint-40", "big.bin")
    etag = minio.client().head_object(Bucket=store.location.bucket, Key=key)["ETag"]
    assert "-" in etag, "a 12 MiB file with a 5 MiB threshold must be a multipart upload"
    restored = restore_newest(store, tmp_path / "restore", deadline=time.monotonic() + 120)
    assert restored.path == tmp_path / "restore" / "checkpoint-40"
    assert restored.committed.step == 40 and restored.committed.uri.endswith("/ns/job/checkpoint-40")
    assert restored.history == {(40, 0, 1)}
    _same_tree(src, restored.path)


@pytest.mark.parametrize("chunk_mib", [8, 5], ids=["GETs of whole digest parts", "GETs across digest parts"])
def test_a_large_file_restores_byte_exact_with_its_parts_in_flight_and_a_changed_part_is_caught(
        ckpt_env, minio, tmp_path: Path, chunk_mib):
    # One 23 MiB file in ranged GETs, 8 in flight: parts land out of order, and the file and its xxh128
    # must still be the object's. 8 MiB GETs are hashed part by part in memory; 5 MiB ones straddle the
    # digest's 8 MiB parts, so the file is hashed again once it is whole.
    store = _store(ckpt_env, download_chunksize=chunk_mib * MiB, download_parts_in_flight=8)
    src = _checkpoint(tmp_path / "out", 40, big=23 * MiB + 12345)
    up = _uploader(store, tmp_path)
    assert up.submit(src, 40)
    assert up.close(240), up.status_line()
    (c,) = store.list_checkpoints()
    _same_tree(src, store.download_checkpoint(c.manifest, tmp_path / "restore"))
    # The same object with one byte changed inside its fourth part (same size): the download's hash catches it
    # and nothing lands under the final name.
    data = bytearray((src / "big.bin").read_bytes())
    data[3 * 5 * MiB + 7] ^= 0xFF
    minio.client().put_object(Bucket=store.location.bucket, Key=store.location.key("checkpoint-40", "big.bin"),
                              Body=bytes(data))
    with pytest.raises(ChecksumError, match="big.bin"):
        store.download_checkpoint(c.manifest, tmp_path / "again")
    assert not (tmp_path / "again" / "checkpoint-40").exists()


class _CutOnce(CheckpointStore):
    """MinIO, but the connection of one object's download drops once mid-transfer (a reset socket)."""

    def __init__(self, config, cut: str) -> None:
        super().__init__(config)
        self.cut, self.fetched = cut, []

    def _download(self, key, target, step, parts, algorithm, cancelled=lambda: False, size=None):
        self.fetched.append(key.rsplit("/", 1)[1])
        if not key.endswith(self.cut):
            return super()._download(key, target, step, parts, algorithm, cancelled, size)
        self.cut = "\0"  # once

        def drop() -> bool:
            raise StorageTemporaryError(f"{key}: connection reset by peer")
        return super()._download(key, target, step, parts, algorithm, drop, size)


def test_a_restore_retried_after_a_storage_error_fetches_only_what_it_had_not_verified(ckpt_env, tmp_path: Path):
    # A dropped connection mid-restore: the retry keeps the files that landed whole (each verified again
    # against the manifest), and fetches the cut one, not the whole checkpoint again.
    src = tmp_path / "out" / "checkpoint-9"
    (src / "shards").mkdir(parents=True)
    (src / "a.bin").write_bytes(os.urandom(2000))
    (src / "shards" / "b.bin").write_bytes(os.urandom(MiB))
    (src / "z-big.bin").write_bytes(os.urandom(12 * MiB))
    up = _uploader(_store(ckpt_env), tmp_path)
    assert up.submit(src, 9)
    assert up.close(240), up.status_line()
    flaky = _CutOnce(StorageConfig.from_env(ckpt_env, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB,
                                            file_concurrency=1), cut="z-big.bin")
    restored = restore_newest(flaky, tmp_path / "restore", deadline=time.monotonic() + 120)
    assert flaky.fetched == ["a.bin", "b.bin", "z-big.bin", "z-big.bin"]
    _same_tree(src, restored.path)


def test_a_checkpoint_committed_with_sha256_digests_by_an_earlier_image_restores_and_is_verified(
        ckpt_env, minio, tmp_path: Path):
    # Buckets hold checkpoints whose manifests carry "sha256" (written before xxh128): the upgraded
    # trainer must resume from them, checking those digests (whole-file, as they were written).
    store = _store(ckpt_env, download_chunksize=8 * MiB, download_parts_in_flight=8)
    src = _checkpoint(tmp_path / "out", 60, big=19 * MiB + 3)
    up = _uploader(store, tmp_path)
    assert up.submit(src, 60)
    assert up.close(240), up.status_line()
    s3, bucket = minio.client(), store.location.bucket
    key = store.location.key("checkpoint-60", "manifest.json")
    raw = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    for f in raw["files"]:
        del f["xxh128"]
        f["sha256"] = hashlib.sha256((src / f["path"]).read_bytes()).hexdigest()
    s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(raw).encode())
    restored = restore_newest(store, tmp_path / "restore", deadline=time.monotonic() + 120)
    assert restored.committed.step == 60
    _same_tree(src, restored.path)
    kept = json.loads((restored.path / "manifest.json").read_bytes())  # the restored folder's record
    assert kept["files"] == raw["files"]
    data = bytearray((src / "big.bin").read_bytes())
    data[11 * MiB] ^= 0xFF  # same size, one byte changed in the second GET
    s3.put_object(Bucket=bucket, Key=store.location.key("checkpoint-60", "big.bin"), Body=bytes(data))
    with pytest.raises(ChecksumError, match="big.bin"):
        store.download_checkpoint(store.read_manifest(60), tmp_path / "again")


def test_torn_and_mismatching_checkpoints_are_never_restored_and_torn_ones_are_cleaned(ckpt_env, minio, tmp_path):
    store = _store(ckpt_env)
    up = _uploader(store, tmp_path)
    for step in (10, 30):
        up.submit(_checkpoint(tmp_path / "out", step), step)
        assert up.wait(120)
    s3, bucket = minio.client(), store.location.bucket
    # torn: files without a manifest (an upload killed mid-way), below and above the newest commit
    for step in (20, 50):
        s3.put_object(Bucket=bucket, Key=store.location.key(f"checkpoint-{step}", "model.safetensors"), Body=b"x")
    # a committed folder whose file was later replaced by different bytes (same size): its digest catches it
    key30 = store.location.key("checkpoint-30", "model.safetensors")
    size30 = s3.head_object(Bucket=bucket, Key=key30)["ContentLength"]
    s3.put_object(Bucket=bucket, Key=key30, Body=b"\0" * size30)
    listed = {c.step: c for c in store.list_checkpoints()}
    assert sorted(listed) == [10, 20, 30, 50]
    assert not listed[20].complete and not listed[50].complete
    assert newest_complete(listed.values()).step == 30  # sizes match: only the download can tell
    restored = restore_newest(store, tmp_path / "restore", deadline=time.monotonic() + 120)
    assert restored.committed.step == 10, "the corrupted checkpoint-30 must be skipped"
    assert not (tmp_path / "restore" / "checkpoint-30").exists()
    # a size mismatch alone makes a folder incomplete
    key10 = store.location.key("checkpoint-10", "empty.bin")
    s3.put_object(Bucket=bucket, Key=key10, Body=b"now not empty")
    assert not {c.step: c for c in store.list_checkpoints()}[10].complete
    # the next commit cleans the torn folder below it; the one above may still be uploading
    up.submit(_checkpoint(tmp_path / "out", 40), 40)
    assert up.close(120)
    # (checkpoint-10 no longer matches its manifest: it counts as torn too; checkpoint-30, which the restore
    # marked corrupt, goes as well, so no later attempt downloads it again)
    assert sorted(c.step for c in store.list_checkpoints()) == [40, 50]


def test_remote_retention_keeps_the_best_and_the_newest(ckpt_env, tmp_path):
    store = _store(ckpt_env)
    up = _uploader(store, tmp_path, retention=RetentionPolicy(save_total_limit=2, metric_for_best_model="loss"))
    for step, loss in ((1, 0.9), (2, 0.2), (3, 0.5), (4, 0.6), (5, 0.7)):
        up.submit(_checkpoint(tmp_path / "out", step, eval_loss=loss), step)
        assert up.wait(120), up.status_line()
    assert up.close(120)
    assert sorted(c.step for c in store.list_checkpoints()) == [2, 5]
    assert all(c.complete for c in store.list_checkpoints())


def test_write_fencing_a_lower_attempt_never_overwrites_a_higher_one(ckpt_env, tmp_path):
    store = _store(ckpt_env)
    zombie = _uploader(store, tmp_path, attempt=1)  # attempt 1 still alive...
    newer = _uploader(store, tmp_path, attempt=2)  # ...while attempt 2 commits
    newer.submit(_checkpoint(tmp_path / "a2", 100), 100)
    assert newer.close(120)
    before = {c.step: c.manifest for c in store.list_checkpoints()}
    zombie.submit(_checkpoint(tmp_path / "a1", 100), 100)
    zombie.submit(_checkpoint(tmp_path / "a1", 200), 200)
    zombie.close(120)
    after = store.list_checkpoints()
    assert {c.step: c.manifest for c in after if c.manifest} == before
    assert zombie.fenced
    assert before[100].attempt == 2


def test_s3_outage_training_continues_uploads_retry_and_catch_up(ckpt_env, minio, tmp_path, caplog):
    store = _store(ckpt_env, connect_timeout_s=1.0, read_timeout_s=5.0)
    up = _uploader(store, tmp_path)
    minio.stop()
    try:
        start = time.monotonic()
        assert up.submit(_checkpoint(tmp_path / "out", 7), 7)
        # A submit that waited for S3 would hang until S3 is back (retries with backoff): any bound far
        # below that proves it did not; 10 s leaves room for snapshotting a few files on a loaded machine.
        assert time.monotonic() - start < 10, "submit must never wait for S3"
        deadline = time.monotonic() + 120
        while not up.lagging:
            assert time.monotonic() < deadline, up.status_line()
            time.sleep(0.2)
        line = up.status_line()
        assert "lagging" in line and "pending steps [7]" in line
        # "training" goes on: a newer checkpoint is accepted while S3 is down
        assert up.submit(_checkpoint(tmp_path / "out", 8), 8)
    finally:
        minio.start()
    assert up.close(240), up.status_line()
    assert [c.step for c in store.list_checkpoints() if c.complete] == [7, 8]
    assert "in sync" in up.status_line()


def test_bad_credentials_are_a_permanent_error_without_the_secret(ckpt_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value-123")
    store = _store(dict(ckpt_env, AWS_SECRET_ACCESS_KEY="wrong-secret-value-123"))
    with pytest.raises(StoragePermanentError) as info:
        store.list_checkpoints()
    assert "wrong-secret-value-123" not in str(info.value)


def test_unreachable_endpoint_is_a_temporary_error(ckpt_env):
    port = free_port()  # nothing listens there
    store = _store(dict(ckpt_env, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}"), connect_timeout_s=0.5)
    with pytest.raises(StorageTemporaryError):
        store.list_checkpoints()


def test_multipart_uploads_an_earlier_attempt_left_torn_are_aborted_after_a_commit(minio, ckpt_env, tmp_path):
    """A trainer killed with -9 mid-upload leaves an incomplete multipart upload (billed, invisible to listings);
    node rank 0 of the next attempt aborts it after its first commit."""
    store = _store(ckpt_env)
    client = minio.client()
    key = store.location.key("checkpoint-3", "big.bin")
    torn = client.create_multipart_upload(Bucket=minio.bucket, Key=key)["UploadId"]
    client.upload_part(Bucket=minio.bucket, Key=key, UploadId=torn, PartNumber=1, Body=os.urandom(5 * MiB))
    assert [u.upload_id for u in store.list_multipart_uploads()] == [torn]
    time.sleep(1.1)  # the server's Initiated time has a one-second resolution: the attempt starts after it
    up = _uploader(store, tmp_path, attempt=2, stale_upload_margin_s=0)
    assert up.submit(_checkpoint(tmp_path / "out", 4), 4)
    assert up.close(120), up.status_line()
    assert store.list_multipart_uploads() == []
    assert [c.step for c in store.list_checkpoints() if c.complete] == [4]
