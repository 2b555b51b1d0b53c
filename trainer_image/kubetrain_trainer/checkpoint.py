"""Local checkpoints: one registry of what a resume needs, atomic commit, discovery, retention.

Layout (HF Trainer compatible): `<output_dir>/checkpoint-<step>/` holding the
model (`model.safetensors` or strategy shards), `optimizer.pt`,
`scheduler.pt`, `rng_state_<rank>.pth` (and HF's `rng_state.pth` in a
1-process run), `training_args.json`,
`kubetrain_state.json` (the data position and what else an exact resume needs
beyond HF's `TrainerState`) and `trainer_state.json` (HF's fields, last).

Invariants:
- A checkpoint is written under `tmp-checkpoint-<step>` and renamed to
  `checkpoint-<step>` only once every rank has finished writing; the rename
  is the commit. Discovery only ever sees committed names, so a crash
  mid-save leaves nothing that resume would pick (the tmp folder is removed
  at the next start).
- Retention keeps at most `save_total_limit` checkpoints but never deletes the
  newest one nor the best one (by `metric_for_best_model`).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import SafetensorError

from . import distributed as dist_util
from .args_values import ConfigError
from .layout import TMP_PREFIX, TRAINER_STATE, by_step, checkpoint_dirname, parse_checkpoint_dirname, tmp_dirname
from .readiness import READY_MARKER, mark_ready
from .strategies.base import StateDictMismatch

logger = logging.getLogger("kubetrain_trainer")

COMPLETE_MARKER = TRAINER_STATE  # written last inside the tmp folder
checkpoint_name = checkpoint_dirname  # the layout's name, under the one the Trainer calls


@dataclass
class ResumeItem:
    """One thing a resume needs: how to write it into a checkpoint folder and read it back.

    `save` and `load` are called on every rank (in registry order); each item
    decides itself which ranks write (rank 0 only, every rank, or collectively).
    """

    name: str
    save: Callable[[Path], None]
    load: Callable[[Path], None]
    stage: Callable[[Path], Callable[[], None]] | None = None
    """For `async_save`: capture the state now, return the writer that writes it later (another thread)."""
    collective: bool = False
    """Whether `load` talks to the other ranks: then its failure can be theirs or the network's."""


class CheckpointUnreadable(ConfigError):
    """A checkpoint folder to resume from holds something that cannot be loaded into this run: a retry reads
    the same bytes into the same model, so it is a configuration error (exit 82), not an application failure."""


UNREADABLE = (ValueError, TypeError, KeyError, AttributeError, EOFError, pickle.UnpicklingError, FileNotFoundError,
              NotADirectoryError, IsADirectoryError, RuntimeError, SafetensorError)
"""What loading a broken or foreign file raises (JSON and type errors, torch.load's reader and unpickler,
load_state_dict, safetensors); a torch.distributed error among them is never this folder's."""


class ResumeRegistry:
    """The single list of everything saved into and restored from a checkpoint."""

    def __init__(self) -> None:
        self.items: list[ResumeItem] = []

    def register(self, name: str, *, save: Callable[[Path], None], load: Callable[[Path], None],
                 stage: Callable[[Path], Callable[[], None]] | None = None, collective: bool = False) -> None:
        if any(item.name == name for item in self.items):
            raise ValueError(f"resume item {name!r} registered twice")
        self.items.append(ResumeItem(name, save, load, stage, collective))

    def save_all(self, directory: Path) -> None:
        for item in self.items:
            item.save(directory)

    def stage_all(self, directory: Path) -> list[Callable[[], None]]:
        """Items with a `stage` capture their state and hand back writers; the others are written now."""
        writers = []
        for item in self.items:
            if item.stage is not None:
                writers.append(item.stage(directory))
            else:
                item.save(directory)
        return writers

    def load_all(self, directory: Path) -> None:
        """Load every item; CheckpointUnreadable naming the folder and the item when one cannot be loaded
        (only ever read: the folder is left as it was)."""
        for item in self.items:
            try:
                item.load(directory)
            except UNREADABLE as exc:
                if isinstance(exc, torch.distributed.DistError) or (item.collective and dist_util.world_size() > 1) \
                        or not _about_the_bytes(exc):
                    raise  # maybe a peer's failure, the network's or the device's: the attempt is retried
                raise unreadable(directory, f"the {item.name} in it", exc) from exc


_FORMAT_ERRORS = ("PytorchStreamReader failed reading zip archive", "failed finding central directory",
                  "Error(s) in loading state_dict", "size mismatch", "Missing key(s)", "Unexpected key(s)",
                  "invalid load key", "Invalid magic number", "unexpected EOF")
"""What torch says of a file that is not what it should be (truncated, another format, another model's)."""


def _about_the_bytes(exc: BaseException) -> bool:
    """`exc` says the folder's bytes cannot be loaded, which a retry would read again. A RuntimeError also means
    out of memory, a CUDA fault or a failed read of a network filesystem (torch's "file read failed"): those may
    pass, and the attempt is retried as before."""
    if isinstance(exc, StateDictMismatch) or not isinstance(exc, RuntimeError):
        return True
    if isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return False
    return any(marker in str(exc) for marker in _FORMAT_ERRORS)


def unreadable(directory: str | Path, what: str, exc: BaseException) -> CheckpointUnreadable:
    """The error for a resume folder of which `what` cannot be loaded, `exc` saying why."""
    lines = str(exc).strip().splitlines()
    detail = f"{type(exc).__name__}: {' '.join(lines[:3])[:400]}" if lines else type(exc).__name__
    detail = "; ".join([detail, *getattr(exc, "__notes__", ())])  # the file, where the reader named it
    hint = ("; its model has other weights than this one: the model's arguments (e.g. a built-in task's "
            "d_model) changed since it was saved") if isinstance(exc, StateDictMismatch) else ""
    return CheckpointUnreadable(f"resume_from_checkpoint {str(directory)!r}: {what} cannot be loaded ({detail}){hint}")


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Committed checkpoints under `output_dir`, oldest first."""
    return _folders_with(output_dir, COMPLETE_MARKER)


def list_local_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Checkpoints committed on this node, oldest first: with trainer_state.json, or this node's share of one
    (`commit_folder` marks each node's folder ready; on nodes that share no disk with world rank 0 the folder
    holds only the files their own ranks wrote). What `save_total_limit` counts, node by node."""
    return _folders_with(output_dir, COMPLETE_MARKER, READY_MARKER)


def _folders_with(output_dir: str | Path, *names: str) -> list[tuple[int, Path]]:
    """The `checkpoint-<step>` folders under `output_dir` holding a file of one of `names`, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    return [(step, child) for step, child in by_step((c.name, c) for c in root.iterdir())
            if child.is_dir() and any((child / name).is_file() for name in names)]


def newest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def is_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / COMPLETE_MARKER).is_file() and not p.name.startswith(TMP_PREFIX)


def remove_incomplete(output_dir: str | Path) -> list[Path]:
    """Delete leftovers of interrupted saves (`tmp-checkpoint-*`). Call on one process per node."""
    root = Path(output_dir)
    removed = []
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith(TMP_PREFIX):
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
    return removed


def _fsync_tree(directory: Path) -> None:
    """Flush file contents and the folder entries, so the commit rename never precedes the data."""
    for path in directory.rglob("*"):
        if path.is_file():
            _fsync(path)
    _fsync(directory)


def _fsync(path: Path) -> None:
    """Flush one file or directory entry (a directory's fsync makes its renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(output_dir: str | Path, step: int, registry: ResumeRegistry) -> Path:
    """*Collective.* Write every registered item under a temporary name, then commit it by renaming."""
    tmp = begin_save(output_dir, step)
    registry.save_all(tmp)
    dist_util.barrier()
    if dist_util.is_local_main_process():
        commit_folder(output_dir, step)
    dist_util.barrier()
    return Path(output_dir) / checkpoint_name(step)


def begin_save(output_dir: str | Path, step: int) -> Path:
    """*Collective.* The empty `tmp-checkpoint-<step>` folder, made by one process per node, seen by all."""
    tmp = Path(output_dir) / tmp_dirname(step)
    if dist_util.is_local_main_process():  # one process per node owns the node's folder
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist_util.barrier()
    return tmp


def commit_folder(output_dir: str | Path, step: int) -> Path:
    """The commit (local main process, once every rank of the node wrote): flush, mark ready, rename."""
    root = Path(output_dir)
    tmp, final = root / tmp_dirname(step), root / checkpoint_name(step)
    _fsync_tree(tmp)
    # The launcher's watcher commits a marked folder at first sight (readiness.py): every rank wrote.
    mark_ready(tmp)
    if final.exists():  # re-saving a step (e.g. an emergency save right after a regular one)
        stale = root / f"{TMP_PREFIX}-{step}-replaced"
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        tmp.rename(final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync(root)
    return final


def checkpoints_to_delete(checkpoints: list[tuple[int, Path]], *, limit: int | None,
                          keep: Iterable[str] = ()) -> list[Path]:
    """Oldest checkpoints beyond `limit`, sparing the newest and every folder named in `keep` (the best)."""
    if limit is None or len(checkpoints) <= limit:
        return []
    protected = {Path(k).name for k in keep if k}
    if checkpoints:
        protected.add(checkpoints[-1][1].name)
    excess = len(checkpoints) - limit
    doomed = []
    for _, path in checkpoints:
        if excess <= 0:
            break
        if path.name in protected:
            continue
        doomed.append(path)
        excess -= 1
    return doomed


def rotate_checkpoints(output_dir: str | Path, *, limit: int | None, keep: Iterable[str] = ()) -> list[Path]:
    """Apply `save_total_limit` on this node's folder (call on the local main process)."""
    doomed = checkpoints_to_delete(list_local_checkpoints(output_dir), limit=limit, keep=keep)
    for path in doomed:
        logger.info("deleting old checkpoint %s (save_total_limit=%s)", path, limit)
        remove_checkpoint(path)
    return doomed


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder: renamed first (one atomic step), then removed. The uploader's snapshot of it
    either got every file or fails (its folder gone): never a part of it left by a removal half done."""
    step = parse_checkpoint_dirname(path.name)
    doomed = path.with_name(f"{TMP_PREFIX}-{path.name if step is None else step}-deleting")  # a save in progress's
    # prefix: never listed nor uploaded, and cleared at the next start if this process dies before the removal
    try:
        path.rename(doomed)
    except FileNotFoundError:
        return
    except OSError:  # e.g. a leftover of that name: remove in place, as before
        doomed = path
    shutil.rmtree(doomed, ignore_errors=True)
