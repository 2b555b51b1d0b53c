"""A large object fetched by ranged GETs in threads of its own, each range written and hashed where it lands.

s3transfer's download of a large object sends a HEAD for its size, then its ranged GETs hand every chunk
to one IO thread, which writes them all (and, with `landing.PartHashingFile`, hashes them all): every byte
of the object passes through that one thread. Here the size comes from the manifest and each range's
thread writes its own bytes at their offsets (`os.pwrite`) and hashes them into the `DIGEST_PART` parts
the range holds (its size is a multiple of a part), so writing and hashing run in as many threads as there
are ranges in flight. The `xxh128` of the file is the tree of those parts' digests, as `hashing.py` defines
it. A range whose read breaks off (s3transfer's retryable download errors) is read again from its start,
its parts hashed again, up to `attempts` times, as s3transfer retries a ranged GET. The first other error
stops every range at its next chunk and is raised. With no HEAD, the answers tell the object's size: one that
differs from the record's (`Content-Range: bytes a-b/<size>`, or InvalidRange for a range past its end) is a
`DigestMismatchError`, as the size check after s3transfer's download found it, never a read to retry.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, BinaryIO, Callable

from kubetrain_trainer.hashing import DIGEST_PART, tree_hexdigest
from kubetrain_trainer.landing import PartHashingFile, read_again_if_broken, stream_into
from kubetrain_trainer.storage_errors import DigestMismatchError, StorageTemporaryError, error_code


class _Abandoned(Exception):
    """Another range failed: this one stops at its next chunk (never retried, never raised to the caller)."""


def fetch_ranges(get_range: Callable[[str], Any], target: Path, size: int, *, range_size: int, workers: int,
                 check: Callable[[], None], attempts: int = 5, chunk: int = 1 << 20) -> tuple[int, str]:
    """(bytes, xxh128) of an object of `size` bytes fetched into `target` by ranged GETs of `range_size`
    bytes (a multiple of `DIGEST_PART`), up to `workers` at once. `get_range("bytes=a-b")` sends one GET and
    returns its answer (botocore's: `Body`, `ContentRange`); `check()` runs before each chunk is written (it
    raises to stop)."""
    if range_size <= 0 or range_size % DIGEST_PART:
        raise ValueError(f"range_size {range_size} is no multiple of the digest part ({DIGEST_PART})")
    failed = threading.Event()
    digests: dict[int, bytes] = {}

    def go_on() -> None:  # before each chunk of every range
        if failed.is_set():
            raise _Abandoned()
        check()

    with open(target, "w+b") as fh:

        def one(start: int) -> dict[int, bytes]:
            end = min(start + range_size, size)
            return read_again_if_broken(lambda: _read_range(get_range, fh, start, end, size, go_on, chunk),
                                        f"{target.name} bytes {start}-{end - 1}", attempts=attempts,
                                        given_up=failed.is_set)

        with ThreadPoolExecutor(max(1, min(workers, -(-size // range_size))),
                                thread_name_prefix="kubetrain-range") as pool:
            futures = [pool.submit(one, start) for start in range(0, size, range_size)]
            try:
                for future in as_completed(futures):
                    digests.update(future.result())
            except BaseException:
                failed.set()  # the others stop at their next chunk; the pool's exit waits for them
                for future in futures:
                    future.cancel()
                raise
    return size, tree_hexdigest(digests[i] for i in range(-(-size // DIGEST_PART)))


class _Range(PartHashingFile):
    """Bytes `start` to `end` (exclusive) of the file, written in order at their offsets and hashed per part."""

    def __init__(self, fh: BinaryIO, start: int, end: int) -> None:
        super().__init__(fh)
        self.start, self.end = start, end
        self.seek(start)

    def write(self, data: bytes) -> int:
        if self._pos + len(data) > self.end:  # a server that ignored the Range: never write over another range
            raise StorageTemporaryError(f"bytes {self.start}-{self.end - 1}: the answer is longer than the range")
        return super().write(data)


def _read_range(get_range: Callable[[str], Any], fh: BinaryIO, start: int, end: int, size: int,
                go_on: Callable[[], None], chunk: int) -> dict[int, bytes]:
    """Bytes `start` to `end` (exclusive) of an object of `size` written at their offsets; the digests of the
    parts they hold."""
    written = _Range(fh, start, end)
    stream_into(_answer(get_range, start, end, size)["Body"], written, go_on, chunk)
    if written.tell() != end:
        from botocore.exceptions import IncompleteReadError  # one of s3transfer's retryable download errors

        raise IncompleteReadError(actual_bytes=written.tell() - start, expected_bytes=end - start)
    return written.part_digests()


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def _answer(get_range: Callable[[str], Any], start: int, end: int, size: int) -> Any:
    """The answer to the GET of bytes `start` to `end` (exclusive) of an object whose record says `size` bytes:
    DigestMismatchError when storage holds another size, StorageTemporaryError when it answers another range.
    An answer without `Content-Range` (a server that ignored the Range) is left to the length check as it lands."""
    what = f"bytes {start}-{end - 1}"
    try:
        response = get_range(f"bytes={start}-{end - 1}")
    except Exception as e:
        if error_code(e) == "InvalidRange":  # 416: the object ends before `start`
            raise DigestMismatchError(f"{what}: the object in storage ends before them; its record has {size} "
                                      "bytes") from None
        raise
    match = _CONTENT_RANGE.fullmatch(str(response.get("ContentRange") or ""))
    if match is None:
        return response
    if match[3] != "*" and int(match[3]) != size:
        response["Body"].close()
        raise DigestMismatchError(f"{what}: the object in storage has {match[3]} bytes; its record {size}")
    if (int(match[1]), int(match[2])) != (start, end - 1):
        response["Body"].close()
        raise StorageTemporaryError(f"{what}: the answer is bytes {match[1]}-{match[2]}")
    return response
