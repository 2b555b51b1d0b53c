"""Checkpoint saves of the `Trainer` (a mixin): regular, in the background (`async_save`), and on SIGTERM.

A regular save writes `checkpoint-<step>` through `checkpoint.save_checkpoint`
(collective, committed when it returns) or, with `async_save`, stages it and
lets `background_save.BackgroundSaver` write and commit it in a thread. At most
one save is in flight: every save, the emergency checkpoint and the end of
training first wait for it, and its `on_save` fires once it is committed.
The emergency checkpoint (SIGTERM) is always synchronous: it must be on disk
before the process exits.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from . import checkpoint as ckpt
from . import distributed as dist_util
from .background_save import CheckpointWriteError
from .state import TrainingPreempted, take_epoch_end

logger = logging.getLogger("kubetrain_trainer")


class SavingMixin:
    """`_save_checkpoint`, `_wait_for_save` and `_preempt` of `Trainer` (it provides args, state, the saver...)."""

    def _save_checkpoint(self, registry: ckpt.ResumeRegistry, *, background: bool | None = None) -> Path:
        """*Collective.* Commit `checkpoint-<step>` and apply retention, then fire `on_save`; with `async_save`
        (or `background`) only stage it here (background_save.py). A save in flight is waited for first."""
        self._wait_for_save()
        args, state = self.args, self.state
        final = Path(args.output_dir) / ckpt.checkpoint_name(state.global_step)
        if state.best_global_step == state.global_step:  # as in HF: only the evaluated best step's checkpoint
            state.best_model_checkpoint = str(final)  # (a best found at a step without a save labels none)
        state.last_checkpoint_dir = str(final)
        self.callback_handler.save_states(state, self.control)
        keep = [state.best_model_checkpoint]
        if args.async_save if background is None else background:
            return self._saves.save(args.output_dir, state.global_step, registry, after_commit=functools.partial(
                ckpt.rotate_checkpoints, args.output_dir, limit=args.save_total_limit, keep=keep))
        ckpt.save_checkpoint(args.output_dir, state.global_step, registry)
        if dist_util.is_local_main_process():
            ckpt.rotate_checkpoints(args.output_dir, limit=args.save_total_limit, keep=keep)
        self.control = self.callback_handler.on_save(args, state, self.control, checkpoint_dir=str(final))
        return final

    def _load_best_model(self) -> None:
        """*Collective.* `load_best_model_at_end`: the best checkpoint loaded on every rank, from this node's
        folder, or (DDP) from world rank 0's when nodes share no disk (the others' folders hold only their own
        RNG states), else (warned) the last model kept, as HF does when the best is gone: training succeeds."""
        best = self._local_path(self.state.best_model_checkpoint)
        here = best.is_dir() and self.strategy.can_load_checkpoint(best)
        if not dist_util.any_rank(not here, self.device):
            logger.info("loading the best model from %s (%s=%s)", best, self.args.metric_for_best_model,
                        self.state.best_metric)
            self.strategy.load_checkpoint(best)
            return
        if dist_util.broadcast_object(here):  # world rank 0 has it: its weights, sent to every rank
            if self.strategy.load_model_from_main_rank(best):
                logger.info("loaded the best model from %s on world rank 0, sent to every rank (%s=%s)", best,
                            self.args.metric_for_best_model, self.state.best_metric)
                return
        logger.warning("Could not locate the best model at %s (%s=%s) on every rank (after a resume, only what "
                       "the restore fetched from checkpoint storage is on local disk); keeping the last model",
                       best, self.args.metric_for_best_model, self.state.best_metric)

    def _local_path(self, path: str) -> Path:
        """A checkpoint path from trainer_state.json, as found under this run's output_dir (it may have moved)."""
        local = Path(self.args.output_dir) / Path(path).name
        return local if local.is_dir() else Path(path)

    def _wait_for_save(self) -> None:
        """Wait until the background save in flight (if any) is committed on every rank; fire its `on_save`."""
        folder = self._saves.wait()
        if folder is not None:  # save_seconds: staging to commit, not the ~0 s the loop was blocked
            self.control = self.callback_handler.on_save(self.args, self.state, self.control, checkpoint_dir=str(folder),
                                                         save_seconds=self._saves.last_seconds)

    def _end_deferred_epoch(self, registry: ckpt.ResumeRegistry) -> None:
        """Resumed from a preemption right after an epoch's last step: that epoch's end first (`on_epoch_end` and
        the "epoch" strategies' eval, save and log), as the run would have had it (`state.epoch_end_pending`)."""
        if self.state.epoch_end_pending is not None:
            grad_norm, lr = take_epoch_end(self.state)
            self.control = self.callback_handler.on_epoch_end(self.args, self.state, self.control)
            self._maybe_log_save_evaluate(grad_norm, registry, lr)

    def _preempt(self, registry: ckpt.ResumeRegistry) -> None:
        """Emergency checkpoint (unless this step was just saved, and saved as it stands now: an epoch end left to
        the resumed run is in the state since), then raise TrainingPreempted."""
        state, args = self.state, self.args
        saved = None
        if args.save_strategy != "no":
            try:
                self._wait_for_save()  # the save in flight commits first; the emergency one is synchronous
            except CheckpointWriteError as exc:  # agreed on every rank: that folder is not committed,
                # but the training state is fine: the emergency checkpoint still saves it
                logger.error("SIGTERM: %s; writing the emergency checkpoint", exc)
            already = state.last_checkpoint_dir and Path(state.last_checkpoint_dir).name == \
                ckpt.checkpoint_name(state.global_step) and Path(state.last_checkpoint_dir).is_dir() \
                and state.epoch_end_pending is None
            saved = state.last_checkpoint_dir if already else str(self._save_checkpoint(registry, background=False))
        logger.warning("SIGTERM: stopped after step %d; emergency checkpoint: %s", state.global_step, saved)
        self.control = self.callback_handler.on_train_end(args, state, self.control, preempted=True)
        raise TrainingPreempted(state.global_step, saved)

