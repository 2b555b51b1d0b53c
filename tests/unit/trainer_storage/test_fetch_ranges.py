"""`ranged.fetch_ranges`: a large object fetched by ranged GETs in threads, each range written and hashed
where it lands; the file's xxh128 is the format's (tests/kubetrain_digest.py), whatever order the ranges end in.

The GET is the unit boundary (`_Source`: the ranged answers of an object in memory, as botocore's
`StreamingBody`); the real ranged GETs against MinIO run in the integration tier's restores.
"""

from __future__ import annotations

import io
import os
import re
import threading
import time

import pytest
from botocore.exceptions import IncompleteReadError, ResponseStreamingError
from botocore.response import StreamingBody

from kubetrain_digest import xxh128_of
from kubetrain_trainer.hashing import DIGEST_PART
from kubetrain_trainer.manifest import FileEntry, Manifest
from kubetrain_trainer.ranged import fetch_ranges
from kubetrain_trainer.storage import CheckpointStore, StorageConfig
from kubetrain_trainer.storage_errors import DigestMismatchError, StorageTemporaryError

CONTENT = os.urandom(3 * DIGEST_PART + DIGEST_PART // 2 + 777)  # 4 ranges of one part, the last one short


class _Body(StreamingBody):
    """botocore's body over bytes; `break_after` chunks, then the connection drops."""

    def __init__(self, data: bytes, break_after: int | None = None) -> None:
        super().__init__(io.BytesIO(data), len(data))
        self.break_after, self.chunks = break_after, 0

    def iter_chunks(self, chunk_size=1024):
        for data in super().iter_chunks(chunk_size):
            if self.break_after is not None and self.chunks == self.break_after:
                raise ResponseStreamingError(error="Connection broken: IncompleteRead")
            self.chunks += 1
            yield data


class _Source:
    """Answers `get_range("bytes=a-b")` from `CONTENT` as S3 does (`Body`, `ContentRange`); `faults[start]` lists
    what each GET of that range does."""

    def __init__(self, faults: dict[int, list] | None = None) -> None:
        self.faults, self.gets, self.lock = faults or {}, [], threading.Lock()

    def __call__(self, header: str):
        start, end = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", header).groups())
        with self.lock:
            self.gets.append(start)
            fault = self.faults.get(start, []).pop(0) if self.faults.get(start) else None
        if fault == "whole object":  # a server that ignored the Range: 200, no Content-Range
            return {"Body": _Body(CONTENT)}
        if isinstance(fault, Exception):
            raise fault
        answer = {"ContentRange": f"bytes {start}-{end}/{len(CONTENT)}"}
        if fault == "short":
            return {**answer, "Body": _Body(CONTENT[start:end])}  # one byte missing
        if fault == "other range":  # the bytes from the object's start, as such
            return {"ContentRange": f"bytes 0-{end - start}/{len(CONTENT)}", "Body": _Body(CONTENT[:end - start + 1])}
        return {**answer, "Body": _Body(CONTENT[start:end + 1], break_after=fault)}


def _fetch(tmp_path, source, **kw):
    kw = {"range_size": DIGEST_PART, "workers": 3, "check": lambda: None, **kw}
    return fetch_ranges(source, tmp_path / "f", len(CONTENT), **kw)


def test_the_ranges_land_whole_with_the_files_digest(tmp_path):
    source = _Source()
    assert _fetch(tmp_path, source) == (len(CONTENT), xxh128_of(CONTENT))
    assert (tmp_path / "f").read_bytes() == CONTENT
    assert sorted(source.gets) == [0, DIGEST_PART, 2 * DIGEST_PART, 3 * DIGEST_PART]  # no HEAD, one GET a range


def test_ranges_of_several_parts_each(tmp_path):
    assert _fetch(tmp_path, _Source(), range_size=2 * DIGEST_PART, workers=2) == (len(CONTENT), xxh128_of(CONTENT))


def test_a_range_broken_off_is_read_and_hashed_again_from_its_start(tmp_path):
    source = _Source({DIGEST_PART: [2, 5], 3 * DIGEST_PART: ["short"]})
    assert _fetch(tmp_path, source) == (len(CONTENT), xxh128_of(CONTENT))
    assert (tmp_path / "f").read_bytes() == CONTENT
    assert sorted(source.gets) == [0, DIGEST_PART, DIGEST_PART, DIGEST_PART, 2 * DIGEST_PART, 3 * DIGEST_PART,
                                   3 * DIGEST_PART]


def test_a_range_that_keeps_breaking_off_fails_after_its_attempts(tmp_path):
    with pytest.raises((ResponseStreamingError, IncompleteReadError)):
        _fetch(tmp_path, _Source({0: [1, 1, 1]}), attempts=3)


def test_the_first_other_error_stops_every_range_and_is_raised(tmp_path):
    class Denied(Exception):
        pass

    written = []

    def check() -> None:  # a slow link: each 1 MiB chunk takes 20 ms
        written.append(1)
        time.sleep(0.02)

    with pytest.raises(Denied):
        _fetch(tmp_path, _Source({2 * DIGEST_PART: [Denied("AccessDenied")]}), check=check, workers=4)
    # The other three ranges hold 8 + 8 + 5 chunks: they stopped at their next chunk, not at their ends.
    assert len(written) <= 9


def test_a_server_that_ignores_the_range_is_not_written_over_other_ranges(tmp_path):
    with pytest.raises(StorageTemporaryError, match="longer than the range"):
        _fetch(tmp_path, _Source({0: ["whole object"]}))


def test_an_answer_of_another_range_is_not_written_as_this_one(tmp_path):
    """s3transfer checked a ranged answer's Content-Range (S3ValidationError): without it these bytes landed at
    the wrong offset, and the digest mismatch that followed had the checkpoint marked corrupt in storage."""
    with pytest.raises(StorageTemporaryError, match=f"bytes {DIGEST_PART}-{2 * DIGEST_PART - 1}: the answer is bytes 0-"):
        _fetch(tmp_path, _Source({DIGEST_PART: ["other range"]}))


def test_a_range_size_that_cuts_digest_parts_is_refused(tmp_path):
    with pytest.raises(ValueError, match="multiple of the digest part"):
        _fetch(tmp_path, _Source(), range_size=DIGEST_PART + 1)


@pytest.mark.parametrize("stored", [CONTENT[:3 * DIGEST_PART], CONTENT[:-1], CONTENT + b"\0"],
                         ids=["it ends before the last range", "one byte short", "one byte longer"])
def test_an_object_of_another_size_than_its_record_is_a_digest_mismatch(tmp_path, mem_s3, stored):
    """No HEAD tells the object's size any more: the ranged answers must. A mismatch is the checkpoint's
    (the restore falls back to an older one and marks it), not a temporary error retried until the restore's
    deadline, on every attempt; and an object longer than its record is no more taken for it than before."""
    mem_s3.objects["j/checkpoint-7/model.safetensors"] = stored
    store = CheckpointStore(StorageConfig(uri="s3://b/j", multipart_threshold=DIGEST_PART,
                                          download_chunksize=DIGEST_PART), client=mem_s3)
    manifest = Manifest(step=7, attempt=1, world_size=1, strategy="ddp", created="2026-12-06T00:00:00Z",
                        files=(FileEntry("model.safetensors", len(CONTENT), xxh128_of(CONTENT)),))
    with pytest.raises(DigestMismatchError, match="checkpoint-7"):
        store.download_checkpoint(manifest, tmp_path)
    assert not (tmp_path / "checkpoint-7").exists() and not (tmp_path / ".checkpoint-7.restoring").exists()


def test_a_large_file_lands_through_the_store_by_ranges(tmp_path, mem_s3):
    mem_s3.objects["j/checkpoint-7/model.safetensors"] = CONTENT
    store = CheckpointStore(StorageConfig(uri="s3://b/j", multipart_threshold=DIGEST_PART,
                                          download_chunksize=DIGEST_PART), client=mem_s3)
    manifest = Manifest(step=7, attempt=1, world_size=1, strategy="ddp", created="2026-12-06T00:00:00Z",
                        files=(FileEntry("model.safetensors", len(CONTENT), xxh128_of(CONTENT)),))
    assert (store.download_checkpoint(manifest, tmp_path) / "model.safetensors").read_bytes() == CONTENT


def test_an_answer_of_another_range_through_the_store_names_the_object(tmp_path, mem_s3, monkeypatch):
    """A temporary error of a range (here: another range answered) says which object, as every storage error does."""
    mem_s3.objects["j/checkpoint-7/model.safetensors"] = CONTENT
    real = mem_s3.get_object

    def shifted(Bucket, Key, Range=None):
        answer = real(Bucket, Key, Range=Range)
        if Range and not Range.startswith("bytes=0-"):
            answer["ContentRange"] = f"bytes 0-{DIGEST_PART - 1}/{len(CONTENT)}"
        return answer

    monkeypatch.setattr(mem_s3, "get_object", shifted)
    store = CheckpointStore(StorageConfig(uri="s3://b/j", multipart_threshold=DIGEST_PART,
                                          download_chunksize=DIGEST_PART), client=mem_s3)
    manifest = Manifest(step=7, attempt=1, world_size=1, strategy="ddp", created="2026-12-06T00:00:00Z",
                        files=(FileEntry("model.safetensors", len(CONTENT), xxh128_of(CONTENT)),))
    with pytest.raises(StorageTemporaryError, match=r"checkpoint-7: s3://b/j/checkpoint-7/model.safetensors: bytes"):
        store.download_checkpoint(manifest, tmp_path)
