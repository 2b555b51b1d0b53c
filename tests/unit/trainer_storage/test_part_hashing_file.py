"""PartHashingFile: the file a restore downloads into, its xxh128 computed part by part as the bytes land.

Chunks land as s3transfer writes them (seek, then write): in order within one ranged GET, the GETs
interleaved. Each case checks the digest against the format's definition (tests/kubetrain_digest.py)
and whether the file had to be read back, which is the cost this class exists to avoid.
"""

from __future__ import annotations

import os
import random

import pytest

from kubetrain_digest import PART, xxh128_of
from kubetrain_trainer import landing
from kubetrain_trainer.landing import HashingFile, PartHashingFile, landing_file

IO_CHUNK = 256 << 10  # s3transfer's io_chunksize


def _gets(size: int, get_size: int, chunk: int = IO_CHUNK) -> list[list[tuple[int, int]]]:
    """The chunks (start, end) of each ranged GET of `get_size` bytes, in order within each GET."""
    return [[(c, min(c + chunk, g + get_size, size)) for c in range(g, min(g + get_size, size), chunk)]
            for g in range(0, size, get_size)]


def _interleave(gets: list[list[tuple[int, int]]], seed: int = 5) -> list[tuple[int, int]]:
    """The GETs' chunks as they reach the IO thread: GETs in flight at once, each one's chunks in order."""
    rng, queues, out = random.Random(seed), [list(g) for g in gets], []
    while any(queues):
        q = rng.choice([q for q in queues if q])
        out.append(q.pop(0))
    return out


@pytest.fixture
def read_backs(monkeypatch) -> list[str]:
    """Names of the files `hexdigest` had to hash again from disk."""
    seen: list[str] = []
    real = landing.fd_digest

    def watched(fd, algorithm, **kw):
        seen.append(kw.get("name", "?"))
        return real(fd, algorithm, **kw)

    monkeypatch.setattr(landing, "fd_digest", watched)
    return seen


def _land(path, data: bytes | bytearray, chunks, out=None) -> tuple[PartHashingFile, str]:
    with open(path, "w+b") as fh:
        out = PartHashingFile(fh)
        _write(out, data, chunks)
        digest = out.hexdigest()
        out.close()
    return out, digest


def _write(out, data, chunks) -> None:
    for start, end in chunks:
        out.seek(start)
        out.write(bytes(data[start:end]))


@pytest.mark.parametrize("get_size, order", [
    (4 * PART, "in order"),          # one GET after another
    (4 * PART, "interleaved"),       # the restore's default: 32 MiB GETs, 16 in flight
    (PART, "interleaved"),
    (PART, "last GET first"),
    (1 << 40, "one GET"),            # a small object: one GET, chunks across part boundaries
])
def test_parts_landing_in_any_order_are_hashed_in_memory(tmp_path, read_backs, get_size, order):
    data = os.urandom(5 * PART + 12345)
    gets = _gets(len(data), min(get_size, len(data)), chunk=IO_CHUNK if order != "one GET" else 3 * IO_CHUNK + 1)
    chunks = {"interleaved": lambda: _interleave(gets), "last GET first": lambda: sum(gets[::-1], []),
              }.get(order, lambda: sum(gets, []))()
    out, digest = _land(tmp_path / "f", data, chunks)
    assert (tmp_path / "f").read_bytes() == data
    assert (out.size, digest) == (len(data), xxh128_of(data))
    assert read_backs == []


def test_a_retried_get_rewriting_its_range_from_the_start_is_hashed_as_finally_written(tmp_path, read_backs):
    data = bytearray(os.urandom(4 * PART))
    first, second = _gets(len(data), 2 * PART)
    path = tmp_path / "f"
    with open(path, "w+b") as fh:
        out = PartHashingFile(fh)
        _write(out, data, first[: len(first) * 3 // 4])  # the GET fails past its first part
        data[7] ^= 0xFF  # and its retry brings other bytes (the object changed under us): in the part
        data[PART + 7] ^= 0xFF  # the first try hashed whole, and in the one it hashed halfway
        _write(out, data, first + second)
        digest = out.hexdigest()
    assert digest == xxh128_of(path.read_bytes()) == xxh128_of(bytes(data))
    assert read_backs == []  # each part's hash began again at its start


@pytest.mark.parametrize("case", ["chunks shuffled", "GETs not on part boundaries", "rewrite mid-part"])
def test_bytes_landing_out_of_their_parts_order_are_hashed_again_from_the_file(tmp_path, read_backs, case):
    data = bytearray(os.urandom(3 * PART + 999))
    if case == "chunks shuffled":
        chunks = sum(_gets(len(data), PART), [])
        random.Random(2).shuffle(chunks)
    elif case == "GETs not on part boundaries":  # a download part size that is not a multiple of 8 MiB
        chunks = _interleave(_gets(len(data), 5 << 20))
    else:
        chunks = sum(_gets(len(data), PART), [])
        chunks = chunks + [(PART + IO_CHUNK, PART + 2 * IO_CHUNK)]  # one chunk written again, not from its part's start
        data_again = bytearray(data)
        data_again[PART + IO_CHUNK] ^= 0xFF
    path = tmp_path / "f"
    with open(path, "w+b") as fh:
        out = PartHashingFile(fh)
        if case == "rewrite mid-part":
            _write(out, data, chunks[:-1])
            _write(out, data_again, chunks[-1:])
            data = data_again
        else:
            _write(out, data, chunks)
        digest = out.hexdigest()
    assert digest == xxh128_of(path.read_bytes()) == xxh128_of(bytes(data))
    assert read_backs == ["download"]


def test_a_gap_that_never_closes_is_hashed_from_the_file_with_its_hole(tmp_path, read_backs):
    data = os.urandom(2 * PART)
    chunks = [c for c in sum(_gets(len(data), PART), []) if c[0] != PART + IO_CHUNK]  # one chunk never lands
    _, digest = _land(tmp_path / "f", data, chunks)
    on_disk = (tmp_path / "f").read_bytes()
    assert on_disk != data and digest == xxh128_of(on_disk) != xxh128_of(data)


def test_a_missing_last_part_is_not_taken_for_a_shorter_file(tmp_path, read_backs):
    data = os.urandom(2 * PART + 10)
    gets = _gets(len(data), PART)
    path = tmp_path / "f"
    with open(path, "w+b") as fh:
        out = PartHashingFile(fh)
        _write(out, data, gets[0] + gets[2])  # the middle part never lands; the file still has the size
        digest = out.hexdigest()
    assert out.size == len(data)
    assert digest == xxh128_of(path.read_bytes()) != xxh128_of(data)


def test_short_writes_are_completed_before_the_bytes_are_hashed(tmp_path, monkeypatch):
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: real(fd, bytes(data[:100_000]), offset))
    data = os.urandom(PART + 5)
    _, digest = _land(tmp_path / "f", data, _interleave(_gets(len(data), PART)))
    assert (tmp_path / "f").read_bytes() == data and digest == xxh128_of(data)


def test_an_empty_object_hashes_as_empty(tmp_path):
    with open(tmp_path / "f", "w+b") as fh:
        out = PartHashingFile(fh)
        out.seek(0)
        out.write(b"")
        assert (out.size, out.hexdigest()) == (0, xxh128_of(b""))


def test_each_record_digest_gets_its_file_and_an_unknown_one_is_refused(tmp_path):
    with open(tmp_path / "f", "w+b") as fh:
        assert isinstance(landing_file(fh, "xxh128"), PartHashingFile)
        legacy = landing_file(fh, "sha256")
        assert isinstance(legacy, HashingFile)
        legacy.close()
        with pytest.raises(ValueError, match="md5"):
            landing_file(fh, "md5")


class _Body:
    """A GET's streaming body that breaks once, `fail_after` bytes in (a connection reset mid-stream)."""

    def __init__(self, data: bytes, fail_after: int | None) -> None:
        self._data, self._pos, self._fail_after = data, 0, fail_after

    def read(self, n: int = -1) -> bytes:
        if self._fail_after is not None and self._pos >= self._fail_after:
            from botocore.exceptions import IncompleteReadError

            raise IncompleteReadError(actual_bytes=self._pos, expected_bytes=len(self._data))
        end = len(self._data) if n is None or n < 0 else min(len(self._data), self._pos + n)
        out, self._pos = self._data[self._pos:end], end
        return out

    def close(self) -> None:
        pass


class _FlakyS3:
    """The two calls s3transfer's download makes (HEAD, ranged GETs) over one object in memory; the GET of
    each range in `breaks` breaks once, partway, and its retry serves `retry_data` when given."""

    def __init__(self, data: bytes, breaks: set[int], retry_data: bytes | None = None) -> None:
        from types import SimpleNamespace

        self.data, self.retry_data, self.breaks, self.gets = data, retry_data, set(breaks), []
        events = SimpleNamespace(register_first=lambda *a, **k: None, register_last=lambda *a, **k: None,
                                 unregister=lambda *a, **k: None)
        self.meta = SimpleNamespace(events=events, config=SimpleNamespace(
            response_checksum_validation="when_supported", request_checksum_calculation="when_supported"))

    def head_object(self, **kw):
        return {"ContentLength": len(self.data), "ETag": '"e"'}

    def get_object(self, Bucket, Key, Range=None, **kw):
        first, last = Range[len("bytes="):].split("-")
        start, end = int(first), int(last) if last else len(self.data) - 1  # the last range is open-ended
        retried = start in {s for s, _ in self.gets}
        self.gets.append((start, retried))
        data = self.retry_data if retried and self.retry_data is not None else self.data
        body = data[start:end + 1]
        fail = len(body) * 3 // 4 if start in self.breaks and not retried else None
        return {"Body": _Body(body, fail), "ContentLength": len(body),
                "ContentRange": f"bytes {start}-{end}/{len(data)}", "ETag": '"e"'}


@pytest.mark.parametrize("changed", [False, True], ids=["same bytes again", "other bytes on the retry"])
def test_through_s3transfer_a_get_broken_mid_stream_is_retried_and_hashed_in_memory(tmp_path, read_backs, changed):
    # The real s3transfer (its request threads, its one IO thread, its retry from the range's start),
    # over a client that breaks two of the ranged GETs three quarters in: what landing.py assumes of it.
    from s3transfer.manager import TransferConfig, TransferManager

    data = os.urandom(6 * PART + 4321)
    again = bytearray(data)
    again[5] ^= 0xFF  # in part 0, which the first try of its GET had hashed whole
    again[4 * PART + PART + 9] ^= 0xFF  # in the other broken GET's second part, hashed halfway
    client = _FlakyS3(data, breaks={0, 4 * PART}, retry_data=bytes(again) if changed else None)
    config = TransferConfig(multipart_threshold=2 * PART, multipart_chunksize=2 * PART, max_request_concurrency=4)
    with open(tmp_path / "f", "w+b") as fh:
        out = PartHashingFile(fh)
        with TransferManager(client, config) as manager:
            manager.download("b", "k", out).result()
        digest = out.hexdigest()
    on_disk = (tmp_path / "f").read_bytes()
    expected = bytes(again) if changed else data
    assert on_disk == expected and digest == xxh128_of(expected)
    assert sorted(s for s, retried in client.gets if retried) == [0, 4 * PART]  # both broke, both retried
    assert read_backs == []
