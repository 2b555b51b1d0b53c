"""The file a restore downloads into, its digest computed as the bytes land, so a restore needs no second pass.

`landing_file(fh, algorithm)` wraps the open file for one writer at a time, which writes each chunk at its
offset (`seek` + `write`): `fetch_whole`, which reads an object below the multipart threshold by one GET,
in order; or s3transfer, for a large object of a `sha256` record (its one IO thread, chunks in the order
they arrive, in order within each ranged GET). A large object of an `xxh128` record is fetched by
`ranged.fetch_ranges`, which hashes each range in its own thread. Written bytes go straight to the file;
nothing is held in memory.

- `xxh128` (every record written now): `PartHashingFile` keeps one hash state per `DIGEST_PART` of the
  file and feeds each chunk to its part's state on the writing thread (XXH3 costs ~0.05 s a GiB).
- `sha256` (records written before it): `HashingFile` follows the contiguous prefix of the file in a
  thread of its own, reading the chunks back from the page cache, since sha256 cannot be cut in parts.

Anything irregular (a chunk landing where its part's hash does not stand, bytes already hashed written
again) is not trusted: `hexdigest` then hashes the whole file from disk.

`keep_verified` is what a retried restore keeps of the staging folder an earlier try filled; `link_or_copy`
places a file already verified under the final name into it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Protocol, TypeVar, cast

import xxhash

from kubetrain_trainer.hashing import DIGEST_PART, fd_digest, file_digest, tree_hexdigest
from kubetrain_trainer.manifest import SHA256, XXH128, FileEntry

logger = logging.getLogger(__name__)
T = TypeVar("T")


class LandingFile(Protocol):
    size: int

    def seekable(self) -> bool: ...
    def tell(self) -> int: ...
    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int: ...
    def write(self, data: bytes) -> int: ...
    def hexdigest(self) -> str: ...
    def close(self) -> None: ...


def landing_file(fh: BinaryIO, algorithm: str) -> LandingFile:
    """`fh` (opened "w+b"), wrapped to compute the `algorithm` digest of what a download writes into it."""
    if algorithm == XXH128:
        return PartHashingFile(fh)
    if algorithm == SHA256:
        return HashingFile(fh)
    raise ValueError(f"unknown digest {algorithm!r}")


def fetch_whole(get_body: Callable[[], Any], target: Path, algorithm: str, check: Callable[[], None], *,
                attempts: int = 5, chunk: int = 1 << 20) -> tuple[int, str]:
    """(bytes, `algorithm` digest) of an object read whole by one GET into `target`, hashed as it lands.

    For objects below the multipart threshold: s3transfer's download first sends a HEAD for the size, then
    runs the one GET through thread pools of its own, which cost more than the GET of a 16 MiB file on a
    fast link (`benchmarks/s3_throughput.py`, many files: 0.78-0.95x of a TransferManager before, 1.4-1.6x
    with this). `get_body()` sends the GET and returns its streaming body; `check()` runs before each chunk
    is written (it raises to stop). A read that breaks off mid-body starts again from the first byte
    (`read_again_if_broken`).
    """
    def read() -> tuple[int, str]:
        with open(target, "w+b") as fh:  # truncated: a retry starts the file and its digest again
            written = landing_file(fh, algorithm)
            try:
                stream_into(get_body(), written, check, chunk)
                return written.size, written.hexdigest()
            finally:
                written.close()

    return read_again_if_broken(read, target.name, attempts=attempts)


def stream_into(body: Any, written: Any, check: Callable[[], None], chunk: int) -> None:
    """A GET's streaming `body` written chunk by chunk into `written`, `check()` before each; the body closed."""
    try:
        for data in body.iter_chunks(chunk):
            check()
            written.write(data)
    finally:
        body.close()


def read_again_if_broken(read: Callable[[], T], what: str, *, attempts: int,
                         given_up: Callable[[], bool] = lambda: False) -> T:
    """`read()`, started again when it breaks off mid-body (s3transfer's retryable download errors), up to
    `attempts` times in all, as s3transfer retries a GET; not once `given_up()`."""
    from s3transfer.utils import S3_RETRYABLE_DOWNLOAD_ERRORS

    for attempt in range(1, attempts + 1):
        try:
            return read()
        except S3_RETRYABLE_DOWNLOAD_ERRORS as e:
            if attempt == attempts or given_up():
                raise
            logger.debug("%s: the read broke off (%s); reading it again (%d of %d)", what, e, attempt + 1, attempts)
    raise AssertionError("unreachable")  # the last attempt returns or raises


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(f"no byte written at offset {offset} of a downloaded file")
        view, offset = view[n:], offset + n


class _DownloadFile:
    """What s3transfer needs of the file it downloads into: seekable, written at absolute offsets."""

    _pos = 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_SET:
            raise OSError("a download's file seeks to absolute offsets only")
        self._pos = offset
        return offset


class PartHashingFile(_DownloadFile):
    """The `xxh128` of a download, each `DIGEST_PART` hashed in memory as its bytes land, in any part order.

    A part's bytes must land in order from its start: a ranged GET's chunks do, and the download's part
    size is a multiple of `DIGEST_PART` (else parts straddle GETs and `hexdigest` reads the file again).
    A write at a part's start begins that part's hash again: s3transfer retries a failed GET from its
    range's start, rewriting every part of it.
    """

    def __init__(self, fh: BinaryIO) -> None:
        self._fd = fh.fileno()
        self._parts: dict[int, list] = {}  # part index -> [xxh3_128 state, bytes hashed]
        self._pos = self.size = 0
        self._irregular = False

    def write(self, data: bytes) -> int:
        start = self._pos
        _write_all(self._fd, data, start)  # never hash bytes the file did not get
        self._pos = start + len(data)
        self.size = max(self.size, self._pos)
        view, offset = memoryview(data), start
        while view and not self._irregular:
            index, within = divmod(offset, DIGEST_PART)
            n = min(len(view), DIGEST_PART - within)
            state = self._parts.get(index)
            if within == 0:
                state = self._parts[index] = [xxhash.xxh3_128(), 0]
            elif state is None or state[1] != within:
                self._irregular = True
                break
            state[0].update(view[:n])
            state[1] += n
            view, offset = view[n:], offset + n
        return len(data)

    def hexdigest(self) -> str:
        """The `xxh128` of the bytes the file holds, once every write is done."""
        count = -(-self.size // DIGEST_PART)
        whole = not self._irregular and all(
            self._parts.get(i, (None, -1))[1] == min(DIGEST_PART, self.size - i * DIGEST_PART) for i in range(count))
        if whole:
            return tree_hexdigest(self._parts[i][0].digest() for i in range(count))
        logger.debug("a download's parts did not land in order; hashing the file again")
        return fd_digest(self._fd, XXH128, name="download")

    def part_digests(self) -> dict[int, bytes]:
        """Each hashed part's digest by its index: what a range written in order from a part's start
        (`ranged.fetch_ranges`) contributes to the file's tree digest."""
        return {index: state.digest() for index, (state, _) in self._parts.items()}

    def close(self) -> None:
        self._parts.clear()


class HashingFile(_DownloadFile):
    """The `sha256` of a download (a record written before `xxh128`), following the file's contiguous prefix.

    s3transfer writes each part's chunks at their offsets (`seek` + `write`), one writer at a time:
    its one IO thread for a ranged download with many parts in flight (chunks in the order they
    arrive), a request thread for a small object. The writer only writes and records each chunk; a
    thread of this file's own follows the contiguous prefix of recorded chunks, reading them back
    (from the page cache) and hashing them. So the IO thread, which every byte of the download passes
    through, is not also the hash's thread, and nothing is held in memory. Anything irregular (a
    retried part rewriting bytes already hashed or being hashed, chunks that never close the prefix)
    is not trusted: `hexdigest` then hashes the whole file again.

    It reads through its own duplicate of the file descriptor; `close` stops the thread within one
    4 MiB block (a failed download: nothing left to hash) and releases the descriptor.
    """

    def __init__(self, fh: BinaryIO) -> None:
        self._fd = os.dup(fh.fileno())  # opened for reading too ("w+b"): the chunks are read back
        self._sha = hashlib.sha256()
        self._pos = self.size = 0
        self._front = 0  # the hashed prefix ends here (the hashing thread moves it)
        self._reading = 0  # and the range being hashed ends here
        self._ahead: dict[int, int] = {}  # start -> end of chunks written past the prefix
        self._irregular = False
        self._draining = self._aborted = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._follow, name="sha256-download", daemon=True)
        self._thread.start()

    def write(self, data: bytes) -> int:
        start = self._pos
        _write_all(self._fd, data, start)  # never hash bytes the file did not get
        self._pos = end = start + len(data)
        with self._cond:
            self.size = max(self.size, end)
            if start < max(self._front, self._reading):
                self._irregular = True  # bytes already hashed, or being read for the hash, written again
            else:
                self._ahead[start] = max(end, self._ahead.get(start, end))
                if start == self._front:
                    self._cond.notify()
        return len(data)

    def hexdigest(self) -> str:
        """The sha256 of the bytes the file holds, once every write is done."""
        self._stop(abort=False)  # the thread hashes what is contiguous, then ends
        if self._irregular or self._ahead or self._front != self.size:
            self._sha = hashlib.sha256()
            self._hash_file(0, self.size)
            self._front, self._ahead, self._irregular = self.size, {}, False
        return self._sha.hexdigest()

    def close(self) -> None:
        """Stop the hashing thread within one block and release the descriptor (idempotent)."""
        self._stop(abort=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _stop(self, *, abort: bool) -> None:
        with self._cond:
            self._draining = True
            self._aborted = self._aborted or abort
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _follow(self) -> None:
        try:
            while True:
                with self._cond:
                    while self._front not in self._ahead and not self._draining:
                        self._cond.wait()
                    if self._aborted or self._front not in self._ahead:
                        return  # what is left (gaps, chunks past them) is for hexdigest
                    start = self._front
                    end = self._ahead.pop(start)
                    while end in self._ahead and end - start < (64 << 20):  # one read of what is there
                        end = self._ahead.pop(end)
                    self._reading = end
                if not self._hash_file(start, end, stoppable=True):
                    return  # aborted mid-range: the prefix stays short of the size
                with self._cond:
                    self._front = end
        except Exception:  # an unreadable file: hexdigest hashes it again and raises there
            logger.debug("hashing a download as it lands failed; it is hashed again at the end", exc_info=True)
            with self._cond:
                self._irregular = True

    def _hash_file(self, start: int, end: int, *, stoppable: bool = False) -> bool:
        """Hash [start, end) of the file; False when `close` stopped it first (only if `stoppable`)."""
        while start < end:
            if stoppable and self._aborted:
                return False
            block = os.pread(self._fd, min(end - start, 4 << 20), start)
            if not block:
                raise OSError(f"short read at {start} of a downloaded file")
            self._sha.update(block)
            start += len(block)
        return True


class _Polled:
    """`threading.Event.is_set` over a callable: what the hash loops poll."""

    def __init__(self, fn: Callable[[], bool]) -> None:
        self.is_set = fn


def verified(path: Path, f: FileEntry, *, cancelled: Callable[[], bool] = lambda: False) -> bool:
    """The regular file at `path` (not a symlink) has `f`'s size and digest (`HashCancelled` once `cancelled()`)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_size == f.size
            and file_digest(path, f.algorithm, cancelled=cast(threading.Event, _Polled(cancelled))) == f.digest)


def link_or_copy(existing: Path, target: Path) -> None:
    """A verified local file `existing` placed at `target` for a restore: hard-linked on the same file system
    (no bytes copied), else copied."""
    try:
        same = existing.stat().st_dev == target.parent.stat().st_dev
    except OSError:
        same = False
    if same:
        os.link(existing, target)
    else:
        shutil.copyfile(existing, target)


def keep_verified(staging: Path, files: Iterable[FileEntry], *, cancelled: Callable[[], bool] = lambda: False) -> set[str]:
    """Empty the restore's `staging` folder but for the files that are whole and match `files` (the paths
    kept), or create it. What a restore keeps from a try that a storage error cut short: a download cut
    short leaves its file partial (or full-sized with holes), and its digest has it fetched again. A
    symlink is never followed (it is removed, not what it points to)."""
    if staging.is_symlink() or (staging.exists() and not staging.is_dir()):
        staging.unlink()
    if not staging.exists():
        staging.mkdir()
        return set()
    keep = {f.path for f in files if verified(staging / f.path, f, cancelled=cancelled)}
    for path in sorted(staging.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                path.rmdir()
        elif path.relative_to(staging).as_posix() not in keep:
            path.unlink()
    return keep
