"""Checkpoints that do not stall training (`TrainingArguments.async_save`): stage in the loop, commit in a thread.

A save with `async_save` blocks the loop only while the state is captured:
the strategy copies what it would write into fresh CPU memory (DCP's own
`async_save` for FSDP) and hands back a writer; the small items (scheduler,
RNG, arguments, trainer state) are written at once. A thread then writes the
files and commits the folder by the same rule as a synchronous save
(`checkpoint.py`):

- everything goes into `tmp-checkpoint-<step>`; when this rank's writer has
  finished, the ranks agree (a MIN all-reduce of "my part is on disk" on a
  gloo group of the saver's own, so the thread's collectives never interleave
  with the loop's); only if every rank succeeded does each node's local main
  process flush, mark ready and rename the folder, and then apply
  `save_total_limit`. A barrier on that group follows, so when the save ends
  the folder is committed on every node. The launcher's watcher never sees a
  half-written folder: it looks only at renamed ones.
- at most one save is in flight: the Trainer calls `wait()` before the next
  save, before the emergency checkpoint, and at the end of training. A failed
  write raises there, in the loop; its temporary folder is never committed
  (and is removed at the next start).
- `on_save` fires on the main thread once the save is committed: at the first
  step end where every rank's thread has finished (the loop's per-step
  all-reduce carries the flag), or at the `wait()`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from . import distributed as dist_util

logger = logging.getLogger("kubetrain_trainer")


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed on some rank: that checkpoint was not committed."""


@dataclass
class _InFlight:
    step: int
    folder: Path
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    thread: threading.Thread | None = None
    started: float = 0.0
    seconds: float | None = None
    """From the start of staging to the end of the commit: what a synchronous save of it would have taken,
    and so what the emergency checkpoint needs (the grace split reads it through the progress report)."""


class BackgroundSaver:
    """One checkpoint written and committed in the background at a time (see the module docstring)."""

    def __init__(self) -> None:
        self._job: _InFlight | None = None
        self._group = None
        self.last_seconds: float | None = None
        """How long the last save `wait()` returned took, staging to commit."""

    @property
    def busy(self) -> bool:
        """A save is in flight (the same on every rank: saves start and are waited for at the same step)."""
        return self._job is not None

    def finished(self) -> bool:
        """This rank's thread of the save in flight has ended (committed or failed)."""
        return self._job is not None and self._job.done.is_set()

    def save(self, output_dir: str | Path, step: int, registry: ckpt.ResumeRegistry, *,
             after_commit: Callable[[], None] | None = None) -> Path:
        """*Collective.* Stage `checkpoint-<step>` now and commit it in the background; `after_commit` runs on
        each node's local main process right after its rename (retention). Call `wait()` first."""
        if self._job is not None:
            raise RuntimeError("a checkpoint save is already in flight: wait() for it first")
        if self._group is None and dist_util.world_size() > 1:
            self._group = dist.new_group(backend="gloo")  # collective, once: every rank saves at the same step
        started = time.monotonic()
        tmp = ckpt.begin_save(output_dir, step)
        writers = registry.stage_all(tmp)
        job = _InFlight(step, Path(output_dir) / ckpt.checkpoint_name(step), started=started)
        job.thread = threading.Thread(target=self._run, args=(job, Path(output_dir), writers, after_commit),
                                      name=f"kubetrain-save-{step}", daemon=True)
        self._job = job
        job.thread.start()
        return job.folder

    def _run(self, job: _InFlight, output_dir: Path, writers: list[Callable[[], None]],
             after_commit: Callable[[], None] | None) -> None:
        try:
            try:
                for write in writers:
                    write()
                ok = True
            except BaseException as exc:  # noqa: BLE001 - reported in the loop by wait()
                job.error, ok = exc, False
            everywhere = ok
            if self._group is not None:  # every rank's part on disk, or nobody commits
                flag = torch.tensor([1.0 if ok else 0.0])
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
                everywhere = bool(flag.item())
            committed = True
            if everywhere and dist_util.is_local_main_process():
                try:
                    ckpt.commit_folder(output_dir, job.step)
                    if after_commit is not None:
                        after_commit()
                except BaseException as exc:  # noqa: BLE001 - agreed below, reported by wait()
                    job.error, committed = exc, False
            if self._group is not None:  # committed on every node before anyone reports it, or failed everywhere
                flag = torch.tensor([1.0 if committed else 0.0])
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
                committed = bool(flag.item())
            if not everywhere and job.error is None:
                job.error = RuntimeError("another rank could not write its part")
            elif not committed and job.error is None:
                job.error = RuntimeError("another node could not commit the checkpoint folder")
        except BaseException as exc:  # noqa: BLE001
            job.error = job.error or exc
        finally:
            job.seconds = time.monotonic() - job.started
            job.done.set()

    def wait(self) -> Path | None:
        """Block until the save in flight has ended; its committed folder, or None if none was in flight.

        Raises `CheckpointWriteError` when it failed (on any rank): that folder was not committed."""
        job, self._job = self._job, None
        if job is None:
            return None
        assert job.thread is not None
        job.thread.join()
        if job.error is not None:
            raise CheckpointWriteError(f"checkpoint-{job.step}: the background write failed, it was not committed: "
                                       f"{job.error}") from job.error
        self.last_seconds = job.seconds
        logger.info("checkpoint-%d committed in the background (%.2f s from staging to commit)", job.step,
                    job.seconds or 0.0)
        return job.folder
