"""Local hashing: a checkpoint folder on this node's disk, turned into (or checked against) a commit record.

Every file is read once for its sha256 (`scan_folder`) before upload, and
again after a restore (`verify_local`); `build_manifest` adds the metrics and
the best-checkpoint record from the folder's trainer_state.json. No network:
`storage.py` uploads and downloads, `sync.py` decides when.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Iterable, Mapping

from kubetrain_trainer.layout import TRAINER_STATE, is_manifest_name, parse_checkpoint_dirname
from kubetrain_trainer.manifest import BestCheckpoint, FileEntry, Manifest, _numeric_only, rfc3339
from kubetrain_trainer.readiness import is_marker_name


def sha256_file(path: Path, *, chunk: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


class HashingSink:
    """A write-only stream into an open file that hashes what passes through it, so a download is
    verified without a second read of the file. It has `write` and nothing else on purpose: s3transfer
    treats a target without `seek` as a stream and hands it the bytes in order (its DeferQueue holds
    parts that arrive early), however many parts are in flight."""

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self._sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self._sha.update(data)  # hashlib releases the GIL for large buffers
        self._fh.write(data)
        self.size += len(data)
        return len(data)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Files hashed at once by `scan_folder` (hashlib releases the GIL): the hash pass before an upload
is time the checkpoint is not on its way (benchmarks/s3_throughput.py)."""


def scan_folder(folder: Path) -> tuple[FileEntry, ...]:
    """Every regular file under `folder` (commit records and ready markers excluded), hashed, sorted by path."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            full = Path(root) / name
            rel = full.relative_to(folder).as_posix()
            if is_manifest_name(rel) or is_marker_name(name) or full.is_symlink() or not full.is_file():
                continue
            found.append((rel, full))

    def entry(item: tuple[str, Path]) -> FileEntry:
        rel, full = item
        return FileEntry(path=rel, size=full.stat().st_size, sha256=sha256_file(full))

    if HASH_THREADS > 1 and len(found) > 1:
        with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="sha256") as pool:
            entries = list(pool.map(entry, found))
    else:
        entries = [entry(item) for item in found]
    return tuple(sorted(entries, key=lambda f: f.path))


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

