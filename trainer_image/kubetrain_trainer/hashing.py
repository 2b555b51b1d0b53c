"""Local hashing: a checkpoint folder on this node's disk, turned into (or checked against) a commit record.

Every file is read once for its digest (`scan_folder`, or `FolderHash` while it uploads); a restore
hashes each file as its bytes land (`landing.py`), and `verify_local` checks a
folder already on disk; `build_manifest` adds the metrics and the best-checkpoint
record from the folder's trainer_state.json. No network: `storage.py` uploads and
downloads, `sync.py` decides when.

The digest a new record carries is `xxh128` (docs/contract.md "Commit records"): the XXH3-128 of the
concatenated XXH3-128 digests of the file's consecutive `DIGEST_PART` (8 MiB) parts. About 18 GiB/s
of one core here against sha256's 1.4, and its parts can be hashed in any order, so a restore whose
ranged GETs land out of order hashes each part in memory as it arrives. Records written before it
carry `sha256`, which is still read and checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Iterable, Mapping, NamedTuple

import xxhash

from kubetrain_trainer.layout import TRAINER_STATE, is_manifest_name, parse_checkpoint_dirname
from kubetrain_trainer.manifest import SHA256, XXH128, BestCheckpoint, FileEntry, Manifest, _numeric_only, rfc3339
from kubetrain_trainer.readiness import is_marker_name

logger = logging.getLogger(__name__)


class LocalFile(NamedTuple):
    """A file of a local checkpoint folder, by its path relative to the folder (POSIX) and its size."""

    path: str
    size: int


class HashCancelled(Exception):
    """The hash pass was stopped before it ended (`FolderHash.cancel`): its upload ended without it."""


DIGEST_PART = 8 << 20
"""The part size of the `xxh128` digest: part of the record format, never a tuning knob."""


def tree_hexdigest(part_digests: Iterable[bytes]) -> str:
    """The `xxh128` of a file, from its parts' XXH3-128 digests (16 bytes each, in file order)."""
    return xxhash.xxh3_128_hexdigest(b"".join(part_digests))


def file_digest(path: Path, algorithm: str = XXH128, *, cancelled: threading.Event | None = None) -> str:
    """The `algorithm` digest of the file at `path`; once `cancelled` is set, `HashCancelled` within a part."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return fd_digest(fd, algorithm, name=path.name, cancelled=cancelled)
    finally:
        os.close(fd)


def fd_digest(fd: int, algorithm: str, *, name: str, cancelled: threading.Event | None = None) -> str:
    """The `algorithm` digest of the whole file open as `fd` (read from offset 0; its position is unused)."""
    if algorithm not in (XXH128, SHA256):
        raise ValueError(f"unknown digest {algorithm!r}")
    sha = hashlib.sha256() if algorithm == SHA256 else None
    parts: list[bytes] = []
    view = memoryview(bytearray(DIGEST_PART))
    offset = 0
    while True:
        if cancelled is not None and cancelled.is_set():
            raise HashCancelled(f"hashing {name} stopped")
        n = _read_part(fd, view, offset)
        if n:
            if sha is not None:
                sha.update(view[:n])
            else:
                parts.append(xxhash.xxh3_128_digest(view[:n]))
            offset += n
        if n < DIGEST_PART:
            break
    return sha.hexdigest() if sha is not None else tree_hexdigest(parts)


def _read_part(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` from `offset` (short only at the end of the file); the bytes read."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Files hashed at once by `scan_folder` and `FolderHash` (xxhash and hashlib release the GIL)."""


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
        return FileEntry(path=f.path, size=f.size, digest=file_digest(folder / f.path, cancelled=cancelled))

    if HASH_THREADS > 1 and len(files) > 1:
        with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="digest") as pool:
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
        self._thread = threading.Thread(target=self._run, name="digest-folder", daemon=True)
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
        elif file_digest(p, f.algorithm) != f.digest:
            problems.append(f"{f.path}: {f.algorithm} mismatch")
    return problems


def read_trainer_metrics(folder: Path, step: int) -> tuple[dict[str, float], BestCheckpoint | None]:
    """Metrics logged at `step` and the best-checkpoint record, from the HF-style trainer_state.json.

    Missing or unreadable state yields no metrics: an arbitrary user command
    may not write one, and that must not stop the upload.
    """
    path = folder / TRAINER_STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}, None
    if not isinstance(state, Mapping):  # `null`, a list: a command's own file, not a trainer state
        return {}, None
    history = state.get("log_history")
    metrics: dict[str, float] = {}
    for entry in history if isinstance(history, list) else ():
        if isinstance(entry, Mapping) and entry.get("step") == step:
            metrics.update(_numeric_only(entry))
    metrics.pop("step", None)
    best = None
    best_value = state.get("best_metric")
    best_dir = state.get("best_model_checkpoint")
    # The best *checkpoint*'s step: best_global_step may be an evaluation at a step that saved nothing.
    best_step = parse_checkpoint_dirname(PurePosixPath(best_dir.rstrip("/")).name) if isinstance(best_dir, str) else None
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

