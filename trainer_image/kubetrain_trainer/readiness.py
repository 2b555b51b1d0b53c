"""When a local `checkpoint-<step>/` folder is complete: the commit rule for any checkpoint writer.

The launcher uploads checkpoints that the workers write, and it cannot see
inside them. kubetrain's own Trainer writes `tmp-checkpoint-<step>` and
renames it, but the HF transformers Trainer, torch DCP and plain `torch.save`
loops write `checkpoint-<step>` IN PLACE: a folder seen early is partial, and
committing it would put a torn checkpoint under a valid manifest. So a folder
is committed only when one of these holds (docs/contract.md, "When a local
checkpoint is complete"), checked in this order by `decide_commit`:

1. Ready markers (exact, beats every heuristic): the writer says the folder
   is complete on this node, with `.kubetrain-ready` (one writer for the
   node's folder) or `.kubetrain-ready-<r>-of-<n>` from each of the n local
   processes (the HF callback `kubetrain_trainer.hf` writes these).
2. Once a writer has marked any folder (or `KUBETRAIN_CHECKPOINT_COMMIT=marker`
   declares it), unmarked folders are never committed: it speaks the protocol.
3. An HF-shaped folder (`training_args.bin`, `rng_state*.pth`, or a writer
   that wrote `trainer_state.json` before) on node rank 0 waits for
   `trainer_state.json`: the HF Trainer writes it last.
4. Workers that exited on their own terms (0, or 83 after an emergency save)
   write nothing any more: what is there is final.
5. Otherwise the folder must be quiescent: no file added, resized or touched
   for the settle period WHILE the workers ran. A writer that died (a signal,
   a crash) may have died mid-save, so a folder that was not yet quiet when
   it died is never committed.

Markers are never uploaded (they are not part of the checkpoint). This module
is pure apart from `mark_ready`/`observe_folder`; the watcher in `watcher.py`
feeds it observations and acts on the decisions.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from kubetrain_trainer.layout import TRAINER_STATE

READY_MARKER = ".kubetrain-ready"
_RANK_MARKER = re.compile(r"^\.kubetrain-ready-(\d+)-of-(\d+)$")
# Names only the HF Trainer writes (generic ones like optimizer.pt are not evidence): training_args.bin
# comes with the model, first; rng_state files near the end; trainer_state.json last.
_HF_NAMES = frozenset({TRAINER_STATE, "training_args.bin", "rng_state.pth"})
_HF_RNG = re.compile(r"^rng_state_\d+\.pth$")

CommitMode = Literal["auto", "marker"]
COMMIT_MODES: tuple[CommitMode, ...] = ("auto", "marker")


def rank_marker_name(local_rank: int, local_world_size: int) -> str:
    return f"{READY_MARKER}-{local_rank}-of-{local_world_size}"


def is_marker_name(name: str) -> bool:
    """Ready markers are signals, never checkpoint files."""
    return name == READY_MARKER or _RANK_MARKER.match(name) is not None


def markers_complete(names: Iterable[str]) -> bool:
    """True when the top-level names of a folder say it is complete on this node."""
    names = set(names)
    if READY_MARKER in names:
        return True
    by_size: dict[int, set[int]] = {}
    for name in names:
        m = _RANK_MARKER.match(name)
        if m:
            by_size.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    return any(n >= 1 and ranks >= set(range(n)) for n, ranks in by_size.items())


def is_hf_shaped(names: Iterable[str]) -> bool:
    """Whether a folder holds files only the HF Trainer writes (so trainer_state.json will come last)."""
    return any(n in _HF_NAMES or _HF_RNG.match(n) for n in names)


def mark_ready(folder: str | os.PathLike, *, local_rank: int | None = None, local_world_size: int = 1) -> Path:
    """Declare `folder` complete (for this process's share): written atomically, after the checkpoint's files.

    Without `local_rank` the caller speaks for the node's whole folder; with
    it, the folder is complete once each of the `local_world_size` local
    processes has marked it.
    """
    folder = Path(folder)
    name = READY_MARKER if local_rank is None else rank_marker_name(local_rank, local_world_size)
    target = folder / name
    tmp = folder / f".{name}.tmp-{os.getpid()}"
    tmp.write_text("")
    tmp.replace(target)
    return target


@dataclass(frozen=True)
class FolderView:
    """What the watcher has seen of one local checkpoint folder."""

    ready: bool
    """Its ready markers are complete (`markers_complete`)."""
    hf_shaped: bool
    """HF Trainer file names in it, or this writer wrote trainer_state.json in an earlier folder."""
    has_trainer_state: bool
    quiet_s: float
    """How long its files have not changed while the workers ran (up to now, or to their exit)."""


@dataclass(frozen=True)
class WriterView:
    """What the watcher knows of the workers that write the folders."""

    uses_markers: bool
    """A ready marker was seen in this run, or KUBETRAIN_CHECKPOINT_COMMIT=marker."""
    expects_trainer_state: bool
    """Node rank 0: the HF Trainer writes trainer_state.json on world rank 0 only."""
    state: Literal["running", "finished", "died"]
    """finished: every worker exited 0 or 83 (on its own terms); died: a signal, a crash."""


@dataclass(frozen=True)
class CommitDecision:
    action: Literal["commit", "wait", "never"]
    reason: str


def decide_commit(folder: FolderView, writer: WriterView, *, settle_s: float) -> CommitDecision:
    """Whether a local checkpoint folder may be committed now (see the module docstring for the rule)."""
    running = writer.state == "running"
    if folder.ready:
        return CommitDecision("commit", "marked ready by its writer")
    if writer.uses_markers:
        if running:
            return CommitDecision("wait", "not marked ready yet")
        return CommitDecision("never", "its writer marks complete folders and never marked this one")
    if folder.hf_shaped and writer.expects_trainer_state and not folder.has_trainer_state:
        if running:
            return CommitDecision("wait", f"HF-shaped: waiting for {TRAINER_STATE} (written last)")
        return CommitDecision("never", f"HF-shaped without {TRAINER_STATE}: the save was interrupted")
    if writer.state == "finished":
        return CommitDecision("commit", "the workers finished: nothing writes to it any more")
    if folder.quiet_s >= settle_s:
        return CommitDecision("commit", f"unchanged for {folder.quiet_s:.0f}s (settle period {settle_s:.0f}s)")
    if running:
        return CommitDecision("wait", f"changed {folder.quiet_s:.0f}s ago (settle period {settle_s:.0f}s)")
    return CommitDecision("never", "its writer died before the folder was quiet: it may be partial")


Signature = tuple[tuple[str, int, int], ...]


def observe_folder(folder: Path) -> tuple[Signature, frozenset[str]]:
    """(every file's (path, size, mtime_ns), the top-level names) of a folder; raises OSError if it vanished."""
    files = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in names:
            full = os.path.join(root, name)
            try:
                st = os.stat(full, follow_symlinks=False)
            except FileNotFoundError:
                continue
            files.append((os.path.relpath(full, folder), st.st_size, st.st_mtime_ns))
    if not folder.is_dir():
        raise FileNotFoundError(folder)
    return tuple(sorted(files)), frozenset(os.listdir(folder))


__all__ = [
    "COMMIT_MODES",
    "READY_MARKER",
    "CommitDecision",
    "FolderView",
    "WriterView",
    "decide_commit",
    "is_hf_shaped",
    "is_marker_name",
    "mark_ready",
    "markers_complete",
    "observe_folder",
    "rank_marker_name",
]
