"""HashingFile: the file a restore downloads into, its sha256 following the bytes as they land."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest
from s3transfer.compat import seekable

from kubetrain_trainer.hashing import HashingFile

CHUNK = 1000


def _land(path: Path, data: bytes, chunks: list[tuple[int, int]]) -> tuple[HashingFile, str]:
    """Write `chunks` (start, end) of `data` as s3transfer's IO thread does (seek, then write)."""
    with open(path, "w+b") as fh:
        out = HashingFile(fh)
        _write(out, data, chunks)
        return out, out.hexdigest()


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


def test_the_hash_follows_the_writes_on_its_own_thread_and_close_stops_it(tmp_path):
    # The IO thread that s3transfer writes every chunk from only writes; the prefix is hashed beside it.
    # A download that fails (its file closed right after) must not leave that thread reading the file.
    import threading

    data = os.urandom(8 * CHUNK)
    chunks = _chunks(len(data))
    with open(tmp_path / "f", "w+b") as fh:
        out = HashingFile(fh)
        hashers = [t for t in threading.enumerate() if t.name == "sha256-download"]
        assert len(hashers) >= 1
        _write(out, data, chunks[:4])
        out.close()
        assert not out._thread.is_alive()
        assert out.hexdigest() == hashlib.sha256(data[:4 * CHUNK]).hexdigest()  # what the file holds
