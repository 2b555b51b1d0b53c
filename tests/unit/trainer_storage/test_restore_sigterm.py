"""A SIGTERM during the restore at start (`restore.restore_newest`, `CheckpointStore.download_checkpoint`):
the restore stops, promptly, as stopped, never as "nothing to restore". That answer would be recorded as
node rank 0's decision, and the gang's other nodes would start from step 0. The S3 client is a stand-in at
its boundary (its transfer calls back after every chunk, as s3transfer's does)."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from kubetrain_trainer.decisions import RemoteCheckpoint
from kubetrain_trainer.manifest import SHA256, XXH128, FileEntry, Manifest
from kubetrain_trainer.restore import RestoreAgreementError, restore_newest
from kubetrain_trainer.storage import CheckpointStore, StorageConfig
from kubetrain_trainer.storage_errors import TransferStopped

CHUNK = 1 << 10
MANIFEST = Manifest(step=40, attempt=1, world_size=1, strategy="ddp",
                    files=(FileEntry("model.safetensors", 64 * CHUNK, "0" * 32),), created="2026-12-05T00:00:00Z")


class Client:
    """`download_fileobj` writes the object chunk by chunk, calling the transfer's callback after each;
    `get_object`'s body (an object below the multipart threshold, read whole) gives it chunk by chunk."""

    def __init__(self, on_chunk=lambda n: None) -> None:
        self.chunks, self.on_chunk = 0, on_chunk

    def get_object(self, Bucket, Key, Range=None):
        client = self

        class Body:
            def iter_chunks(self, chunk_size):
                for _ in range(64):
                    client.chunks += 1
                    client.on_chunk(client.chunks)
                    yield b"x" * CHUNK

            def close(self):
                pass

        return {"Body": Body()}

    def download_fileobj(self, bucket, key, fileobj, Config=None, Callback=None):
        for _ in range(64):
            fileobj.seek(self.chunks % 64 * CHUNK)
            fileobj.write(b"x" * CHUNK)
            self.chunks += 1
            self.on_chunk(self.chunks)
            if Callback is not None:
                Callback(CHUNK)


@pytest.mark.parametrize("threshold, algorithm", [(CHUNK, XXH128), (CHUNK, SHA256), (64 << 20, XXH128)],
                         ids=["in ranges", "in parts by s3transfer (a sha256 record)", "read whole"])
def test_a_download_stops_at_the_next_chunk_once_cancelled_and_nothing_lands_under_the_final_name(tmp_path: Path,
                                                                                                   threshold,
                                                                                                   algorithm):
    stop = threading.Event()
    client = Client(on_chunk=lambda n: n == 3 and stop.set())
    store = CheckpointStore(StorageConfig(uri="s3://b/jobs/ml/j", multipart_threshold=threshold), client=client)
    (entry,) = MANIFEST.files
    manifest = dataclasses.replace(MANIFEST, files=(dataclasses.replace(entry, algorithm=algorithm),))
    with pytest.raises(TransferStopped):
        store.download_checkpoint(manifest, tmp_path, cancelled=stop.is_set)
    assert client.chunks == 3  # not the 64 of the whole object
    assert not (tmp_path / "checkpoint-40").exists()


class Store:
    """What restore_newest reads: one complete checkpoint; its download as the test says."""

    def __init__(self, download) -> None:
        self.download = download
        self.location = type("L", (), {"uri": "s3://b/jobs/ml/j"})()

    def list_checkpoints(self):
        return [RemoteCheckpoint(step=40, manifest=MANIFEST, listing={"model.safetensors": 64 * CHUNK,
                                                                      "manifest.json": 100})]

    def download_checkpoint(self, manifest, dest, *, node=None, cancelled=lambda: False):
        return self.download(cancelled)

    def checkpoint_uri(self, step):
        return f"s3://b/jobs/ml/j/checkpoint-{step}"


def test_a_sigterm_during_the_download_is_a_stopped_restore(tmp_path: Path):
    stop = threading.Event()

    def download(cancelled):
        stop.set()  # the SIGTERM lands mid-transfer
        assert cancelled()
        raise TransferStopped("model.safetensors: stopped (SIGTERM)")

    with pytest.raises(RestoreAgreementError, match="stopped .SIGTERM. while checkpoint-40 was downloading"):
        restore_newest(Store(download), tmp_path, deadline=1e12, stop=stop)


def test_a_sigterm_before_the_download_is_a_stopped_restore_not_a_fresh_start(tmp_path: Path):
    stop = threading.Event()
    stop.set()
    with pytest.raises(RestoreAgreementError, match="before checkpoint-40 was restored"):
        restore_newest(Store(lambda cancelled: pytest.fail("downloaded after the SIGTERM")), tmp_path,
                       deadline=1e12, stop=stop)
