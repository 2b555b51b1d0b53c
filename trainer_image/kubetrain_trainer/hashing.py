"""Local hashing: a checkpoint folder on this node's disk, turned into (or checked against) a commit record.

Every file is read once for its sha256 (`scan_folder`, or `FolderHash` while it uploads); a restore
hashes each file as its bytes land (`HashingFile`), and `verify_local` checks a
folder already on disk; `build_manifest` adds the metrics and the best-checkpoint
record from the folder's trainer_state.json. No network: `storage.py` uploads and
downloads, `sync.py` decides when.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Iterable, Mapping, NamedTuple

from kubetrain_trainer.layout import TRAINER_STATE, is_manifest_name, parse_checkpoint_dirname
from kubetrain_trainer.manifest import BestCheckpoint, FileEntry, Manifest, _numeric_only, rfc3339
from kubetrain_trainer.readiness import is_marker_name

logger = logging.getLogger(__name__)


class LocalFile(NamedTuple):
    """A file of a local checkpoint folder, by its path relative to the folder (POSIX) and its size."""

    path: str
    size: int


class HashCancelled(Exception):
    """The hash pass was stopped before it ended (`FolderHash.cancel`): its upload ended without it."""


def sha256_file(path: Path, *, chunk: int = 4 << 20, cancelled: threading.Event | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            if cancelled is not None and cancelled.is_set():
                raise HashCancelled(f"hashing {path.name} stopped")
            h.update(block)
    return h.hexdigest()


class HashingFile:
    """The file a download writes, hashing its bytes as they land, so a restore needs no second pass.

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

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_SET:
            raise OSError("HashingFile seeks to absolute offsets only")
        self._pos = offset
        return offset

    def write(self, data: bytes) -> int:
        start = self._pos
        self._write_all(data, start)  # never hash bytes the file did not get
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

    def _write_all(self, data: bytes, offset: int) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(self._fd, view, offset)
            if n <= 0:
                raise OSError(f"no byte written at offset {offset} of a downloaded file")
            view, offset = view[n:], offset + n

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


HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Files hashed at once by `scan_folder` and `FolderHash` (hashlib releases the GIL)."""


def list_folder(folder: Path) -> tuple[LocalFile, ...]:
    """Every regular file under `folder` (commit records and ready markers excluded), sorted by path."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            full = Path(root) / name
            rel = full.relative_to(folder).as_posix()
            if is_manifest_name(rel) or is_marker_name(name) or full.is_symlink() or not full.is_file():
                continue
            found.append(LocalFile(rel, full.stat().st_size))
    return tuple(sorted(found, key=lambda f: f.path))


def hash_files(folder: Path, files: Iterable[LocalFile], *,
                cancelled: threading.Event | None = None) -> tuple[FileEntry, ...]:
    """The commit records of `files` under `folder`, sorted by path; up to `HASH_THREADS` hashed at once.
    Once `cancelled` is set, no file starts and the ones being hashed stop within a chunk (`HashCancelled`)."""
    files = list(files)

    def entry(f: LocalFile) -> FileEntry:
        if cancelled is not None and cancelled.is_set():
            raise HashCancelled(f"hashing {f.path} not started")
        return FileEntry(path=f.path, size=f.size, sha256=sha256_file(folder / f.path, cancelled=cancelled))

    if HASH_THREADS > 1 and len(files) > 1:
        with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="sha256") as pool:
            entries = list(pool.map(entry, files))
    else:
        entries = [entry(f) for f in files]
    return tuple(sorted(entries, key=lambda f: f.path))


def scan_folder(folder: Path) -> tuple[FileEntry, ...]:
    """Every regular file under `folder` (commit records and ready markers excluded), hashed, sorted by path."""
    return hash_files(folder, list_folder(folder))


class FolderHash:
    """`scan_folder` of an immutable snapshot in a background thread, so an upload need not wait for it.

    `files` (paths and sizes) is known when this returns; `result()` waits for the hashes and raises
    what the hashing raised. The snapshot must not change meanwhile: the commit records describe the
    bytes read here, and the upload reads the same files. `cancel()` stops it within a chunk per file
    (an upload that ends without it, or a process on its way out: the pool's threads are joined at exit).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files = list_folder(folder)
        self._entries: tuple[FileEntry, ...] | None = None
        self._error: BaseException | None = None
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sha256-folder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._entries = hash_files(self.folder, self.files, cancelled=self._cancelled)
        except Exception as e:  # noqa: BLE001 - raised again by result(), in the thread that waits
            self._error = e

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def failed(self) -> bool:
        """Ended without the hashes (an error, or cancelled): a new pass is needed."""
        return not self._thread.is_alive() and self._entries is None

    def result(self) -> tuple[FileEntry, ...]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._entries is None:  # pragma: no cover - _run sets one of the two
            raise HashCancelled(f"hashing {self.folder.name} ended without a result")
        return self._entries


def verify_local(folder: Path, files: Iterable[FileEntry]) -> list[str]:
    """Why the files under `folder` do not match `files`; [] when every one matches byte for byte."""
    problems = []
    for f in files:
        p = folder / f.path
        if not p.is_file():
            problems.append(f"{f.path}: missing")
        elif p.stat().st_size != f.size:
            problems.append(f"{f.path}: size {p.stat().st_size} != {f.size}")
        elif sha256_file(p) != f.sha256:
            problems.append(f"{f.path}: sha256 mismatch")
    return problems


def read_trainer_metrics(folder: Path, step: int) -> tuple[dict[str, float], BestCheckpoint | None]:
    """Metrics logged at `step` and the best-checkpoint record, from the HF-style trainer_state.json.

    Missing or unreadable state yields no metrics: an arbitrary user command
    may not write one, and that must not stop the upload.
    """
    path = folder / TRAINER_STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, None
    metrics: dict[str, float] = {}
    for entry in state.get("log_history") or []:
        if isinstance(entry, Mapping) and entry.get("step") == step:
            metrics.update(_numeric_only(entry))
    metrics.pop("step", None)
    best = None
    best_value = state.get("best_metric")
    best_dir = state.get("best_model_checkpoint")
    best_step = state.get("best_global_step")
    if not isinstance(best_step, int) and isinstance(best_dir, str):
        best_step = parse_checkpoint_dirname(PurePosixPath(best_dir.rstrip("/")).name)
    if best_value is not None or best_step is not None:
        best = BestCheckpoint(
            metric=state.get("metric_for_best_model") if isinstance(state.get("metric_for_best_model"), str) else None,
            value=float(best_value) if isinstance(best_value, (int, float)) else None,
            step=best_step if isinstance(best_step, int) else None,
        )
    return metrics, best


def build_manifest(
    folder: Path,
    *,
    step: int,
    attempt: int,
    world_size: int,
    strategy: str,
    files: tuple[FileEntry, ...] | None = None,
    created: str | None = None,
    incarnation: int = 0,
) -> Manifest:
    """The manifest for a complete local checkpoint folder (files hashed unless given)."""
    metrics, best = read_trainer_metrics(folder, step)
    return Manifest(
        step=step,
        attempt=attempt,
        incarnation=incarnation,
        world_size=world_size,
        strategy=strategy,
        files=files if files is not None else scan_folder(folder),
        metrics=metrics,
        created=created or rfc3339(),
        best=best,
    )

