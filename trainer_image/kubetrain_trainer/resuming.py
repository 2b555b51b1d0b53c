"""Where a `Trainer.train` resumes from, and the progress it takes over (a mixin of `Trainer`).

The checkpoint folder is found (`resume_from_checkpoint`: True is the newest
complete one), every rank agrees on it, and its `trainer_state.json` becomes
the run's state (with `kubetrain_state.json` beside it): the progress from
the checkpoint, the schedule from this run's arguments. A checkpoint written by the HF Trainer has no data position;
it follows from `global_step` as HF derives it (`steps.position_from_step`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from . import checkpoint as ckpt
from . import distributed as dist_util
from .args import ConfigError
from .state import SCHEDULE_FIELDS, TrainerState, read_saved
from .steps import StepPlan, position_from_step

logger = logging.getLogger("kubetrain_trainer")


class ResumingMixin:
    """`_resolve_resume`, `_check_same_resume`, `_load_state` and `_check_resumed_state` of `Trainer`."""

    _position_saved = True
    """Whether the checkpoint resumed from says where the data stands (kubetrain's do, HF's do not)."""

    def _resolve_resume(self, resume: str | bool | None) -> Path | None:
        if resume is None or resume is False:
            return None
        if resume is True:
            found = ckpt.newest_checkpoint(self.args.output_dir)
            if found is None:
                logger.info("no complete checkpoint in %s: starting fresh", self.args.output_dir)
            return found
        path = Path(resume)
        if not ckpt.is_checkpoint(path):
            raise ConfigError(f"resume_from_checkpoint {str(path)!r} is not a complete checkpoint folder "
                              f"(it needs {ckpt.COMPLETE_MARKER})")
        return path

    def _check_same_resume(self, resume_dir: Path | None) -> None:
        """*Collective.* Every rank resumes from the same step, or none does. On nodes that share no disk, a node
        whose output_dir lacks the checkpoint would start over while the others resume, and the gang would hang
        at its first collective that differs."""
        try:
            step = -1 if resume_dir is None else TrainerState.load_from_json(Path(resume_dir) / ckpt.COMPLETE_MARKER).global_step
        except (ValueError, TypeError) as exc:  # not JSON, or not the state's types: its bytes never change
            raise ckpt.unreadable(resume_dir, ckpt.COMPLETE_MARKER, exc) from exc
        main = dist_util.broadcast_object(step)
        if dist_util.any_rank(step != main, self.device):
            def what(s: int) -> str:
                return "no checkpoint (a fresh start)" if s < 0 else f"the checkpoint of step {s}"
            raise ConfigError(f"resume_from_checkpoint: world rank {dist_util.rank()} found {what(step)} in "
                              f"{self.args.output_dir}, world rank 0 {what(main)} (some ranks differ): every node "
                              "needs the same checkpoint: a shared output_dir, or resume through checkpoint storage "
                              "(the launcher gives every node its part)")

    def _load_state(self, directory: Path) -> None:
        data = read_saved(directory / ckpt.COMPLETE_MARKER)
        saved = TrainerState.from_saved(data)
        self._position_saved = "data_position" in data
        current = self.state
        saved.is_world_process_zero, saved.is_local_process_zero = current.is_world_process_zero, current.is_local_process_zero
        # The schedule comes from this run's arguments, the progress from the checkpoint.
        for name in SCHEDULE_FIELDS:
            setattr(saved, name, getattr(current, name))
        self.state = saved
        self.callback_handler.load_states(saved)

    def _check_resumed_state(self, plan: StepPlan) -> None:
        state = self.state
        if not self._position_saved:  # an HF Trainer's checkpoint: where its data stands follows from its step
            state.data_position = position_from_step(state.global_step, plan, self.args, dist_util.world_size())
            logger.warning("the checkpoint has no data_position (an HF Trainer's trainer_state.json): continuing "
                           "from global_step %d at epoch %d after %d samples, as HF derives it", state.global_step,
                           state.data_position.epoch, state.data_position.samples)
        if state.global_step >= plan.max_steps:
            logger.warning("the checkpoint is at step %d, max_steps is %d: nothing left to train",
                           state.global_step, plan.max_steps)
