"""HashingFile: the file a restore of a sha256 record (written before xxh128) downloads into, its sha256
following the bytes as they land."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest
from s3transfer.compat import seekable

from kubetrain_trainer.landing import HashingFile

CHUNK = 1000


def _land(path: Path, data: bytes, chunks: list[tuple[int, int]]) -> tuple[HashingFile, str]:
    """Write `chunks` (start, end) of `data` as s3transfer's IO thread does (seek, then write)."""
    with open(path, "w+b") as fh:
        out = HashingFile(fh)
        try:
            _write(out, data, chunks)
            return out, out.hexdigest()
        finally:
            out.close()


def _write(out: HashingFile, data: bytes | bytearray, chunks: list[tuple[int, int]]) -> None:
    for start, end in chunks:
        out.seek(start)
        out.write(bytes(data[start:end]))


def _chunks(size: int) -> list[tuple[int, int]]:
    return [(start, min(start + CHUNK, size)) for start in range(0, size, CHUNK)]


def test_s3transfer_writes_it_at_offsets():
    # The property the restore relies on: seekable, so s3transfer writes parts where they belong (no
    # reordering buffer in memory).
    assert seekable(HashingFile.__new__(HashingFile))


@pytest.mark.parametrize("order", ["in order", "shuffled", "last first", "parts interleaved"])
def test_chunks_landing_in_any_order_give_the_file_and_its_sha256(tmp_path, order):
    data = os.urandom(37 * CHUNK + 123)
    chunks = _chunks(len(data))
    if order == "shuffled":
        random.Random(7).shuffle(chunks)
    elif order == "last first":
        chunks = chunks[::-1]
    elif order == "parts interleaved":  # 4 parts of 10 chunks in flight, one chunk of each in turn
        parts = [chunks[i:i + 10] for i in range(0, len(chunks), 10)]
        chunks = [part[i] for i in range(10) for part in parts if i < len(part)]
    out, digest = _land(tmp_path / "f", data, chunks)
    assert (tmp_path / "f").read_bytes() == data
    assert out.size == len(data)
    assert digest == hashlib.sha256(data).hexdigest()


def test_a_retried_part_that_rewrites_hashed_bytes_is_hashed_again_from_the_file(tmp_path):
    data = bytearray(os.urandom(10 * CHUNK))
    chunks = _chunks(len(data))
    path = tmp_path / "f"
    with open(path, "w+b") as fh:
        out = HashingFile(fh)
        _write(out, data, chunks[:5])
        data[2 * CHUNK] ^= 0xFF  # the retry brought other bytes (the object changed under us)
        _write(out, data, chunks[2:])
        digest = out.hexdigest()
    # The hash is the file's, not the first bytes seen: the manifest check sees what will be loaded.
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest() == hashlib.sha256(bytes(data)).hexdigest()


def test_a_gap_that_never_closes_is_hashed_from_the_file_with_its_hole(tmp_path):
    data = os.urandom(6 * CHUNK)
    chunks = [c for i, c in enumerate(_chunks(len(data))) if i != 2]  # chunk 2 never lands
    out, digest = _land(tmp_path / "f", data, chunks)
    on_disk = (tmp_path / "f").read_bytes()
    assert on_disk != data and digest == hashlib.sha256(on_disk).hexdigest()
    assert digest != hashlib.sha256(data).hexdigest()


def test_short_writes_are_completed_before_the_bytes_are_hashed(tmp_path, monkeypatch):
    # pwrite may write less than asked (a full disk, a file-size limit, FUSE): the file must get every byte
    # the hash saw, or the digest would vouch for bytes that are not on disk.
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: real(fd, bytes(data[:300]), offset))
    data = os.urandom(5 * CHUNK + 7)
    out, digest = _land(tmp_path / "f", data, _chunks(len(data))[::-1])
    assert (tmp_path / "f").read_bytes() == data
    assert digest == hashlib.sha256(data).hexdigest()


def test_a_region_rewritten_before_the_prefix_reaches_it_is_hashed_as_finally_written(tmp_path):
    data = bytearray(os.urandom(6 * CHUNK))
    chunks = _chunks(len(data))
    path = tmp_path / "f"
    with open(path, "w+b") as fh:
        out = HashingFile(fh)
        _write(out, data, chunks[3:])  # a later part lands first
        data[4 * CHUNK + 1] ^= 0xFF  # that part is retried and brings other bytes
        _write(out, data, chunks[3:] + chunks[:3])
        digest = out.hexdigest()
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest() == hashlib.sha256(bytes(data)).hexdigest()


def _watch_hash_reads(out: HashingFile) -> list[tuple[str, int, int]]:
    """Record (thread name, start, end) of every read-back the file hashes."""
    import threading

    seen: list[tuple[str, int, int]] = []
    real = out._hash_file

    def watched(start, end, **kw):
        seen.append((threading.current_thread().name, start, end))
        return real(start, end, **kw)

    out._hash_file = watched
    return seen


@pytest.mark.parametrize("order", ["in order", "shuffled", "parts interleaved"])
def test_the_hash_follows_the_prefix_on_its_own_thread_not_in_a_second_pass(tmp_path, order):
    # The writer (s3transfer's IO thread) only writes; the prefix is hashed beside it. A regression to
    # "hash the whole file at the end" would give the same digest: this checks who hashed what.
    data = os.urandom(40 * CHUNK)
    chunks = _chunks(len(data))
    if order == "shuffled":
        random.Random(3).shuffle(chunks)
    elif order == "parts interleaved":
        parts = [chunks[i:i + 10] for i in range(0, len(chunks), 10)]
        chunks = [part[i] for i in range(10) for part in parts if i < len(part)]
    with open(tmp_path / "f", "w+b") as fh:
        out = HashingFile(fh)
        seen = _watch_hash_reads(out)
        _write(out, data, chunks)
        digest = out.hexdigest()
        out.close()
    assert digest == hashlib.sha256(data).hexdigest()
    assert seen and {name for name, _, _ in seen} == {"sha256-download"}
    assert sum(end - start for _, start, end in seen) == len(data)  # every byte once, in prefix order
    assert [start for _, start, _ in seen] == sorted(start for _, start, _ in seen)


def test_a_rewrite_while_its_range_is_being_read_is_hashed_again_from_the_file(tmp_path):
    import threading

    data = bytearray(os.urandom(6 * CHUNK))
    chunks = _chunks(len(data))
    path = tmp_path / "f"
    reading, go = threading.Event(), threading.Event()
    with open(path, "w+b") as fh:
        out = HashingFile(fh)
        real = out._hash_file
        calls = []

        def held(start, end, **kw):  # the read of the first range waits: the rewrite lands meanwhile
            calls.append((threading.current_thread().name, start, end))
            if threading.current_thread().name == "sha256-download" and not reading.is_set():
                reading.set()
                assert go.wait(10)
            return real(start, end, **kw)

        out._hash_file = held
        _write(out, data, chunks[:4])
        assert reading.wait(10)  # the range from 0 is being read
        data[5] ^= 0xFF  # a retried part brings other bytes into it
        _write(out, data, chunks[0:1])
        go.set()
        _write(out, data, chunks[4:])
        digest = out.hexdigest()
        out.close()
    assert ("MainThread", 0, len(data)) in calls  # not trusted: hashed again from the file
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest() == hashlib.sha256(bytes(data)).hexdigest()


def test_an_empty_object_hashes_as_empty(tmp_path):
    with open(tmp_path / "f", "w+b") as fh:
        out = HashingFile(fh)
        out.seek(0)
        out.write(b"")
        assert (out.size, out.hexdigest()) == (0, hashlib.sha256(b"").hexdigest())
        out.close()


def test_close_stops_the_hash_within_a_block_when_the_download_failed(tmp_path):
    # A failed download: its file is closed at once, and whatever is left unhashed is of no use.
    import threading
    import time

    data = os.urandom(64 * CHUNK)
    with open(tmp_path / "f", "w+b") as fh:
        out = HashingFile(fh)
        first, go = threading.Event(), threading.Event()
        real = out._hash_file
        calls = []

        def slow(start, end, **kw):
            calls.append((start, end))
            first.set()
            assert go.wait(10)
            return real(start, end, **kw)

        out._hash_file = slow
        _write(out, data, _chunks(CHUNK))  # the first chunk: the thread starts reading it and waits
        assert first.wait(10)
        _write(out, data, [(c, min(c + CHUNK, len(data))) for c in range(CHUNK, len(data), CHUNK)])
        threading.Timer(0.2, go.set).start()
        t0 = time.monotonic()
        out.close()
        assert time.monotonic() - t0 < 5
        assert not out._thread.is_alive() and out._fd == -1
        assert len(calls) == 1  # no further range was read after close
