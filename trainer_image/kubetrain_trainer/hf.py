"""One line for an HF transformers script: exact checkpoint commit points under kubetrain.

The HF Trainer writes `checkpoint-<step>/` in place (model, optimizer, RNG,
then trainer_state.json), so without help the launcher can only guess when a
folder is complete (readiness.py). With this callback the guess is gone:

    from kubetrain_trainer.hf import KubetrainCheckpointCallback
    trainer = Trainer(..., callbacks=[KubetrainCheckpointCallback()])   # or trainer.add_callback(...)

`on_save` runs on every process after the Trainer finished writing that
process's share of the folder; each local process marks its share
(`.kubetrain-ready-<r>-of-<n>`), and the launcher commits the folder once all
n local processes did. A save interrupted half-way is never marked, so it is
never committed. Outside kubetrain the markers are harmless empty files.

The same callback reports the run's progress to the launcher (step, loss,
learning rate, throughput, step and save times: `progress.py`), which serves
it as the pod's /metrics and /progress. Tokens per second need the Trainer to
count them (`include_num_input_tokens_seen`).

This module needs `transformers` (kubetrain's trainer image has it), and
never talks to S3.

TEST HOOK (off unless `KUBETRAIN_TEST_HF_HOLD` is set; docs/contract.md, "Test
hooks"): a comma-separated list of `<attempt>:step:<N>` (hold after step N,
between saves) and `<attempt>:save:<N>` (hold inside the save of
`checkpoint-<N>`, after the model file is written and before the rest), for
the attempt `KUBETRAIN_ATTEMPT` names. The process prints a line and waits
for its SIGTERM (at most `KUBETRAIN_TEST_HOLD_SECONDS`, default 600), so a
test preempts an unmodified HF script at the point it chose.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from kubetrain_trainer.contract import TEST_HF_HOLD, TEST_HOLD_SECONDS
from kubetrain_trainer.distributed import settle_gloo_at_exit
from kubetrain_trainer.progress import ProgressTracker
from kubetrain_trainer.readiness import mark_ready
from kubetrain_trainer.workerenv import WorkerEnv

log = logging.getLogger(__name__)


HF_HOLD_ENV = TEST_HF_HOLD
HOLD_SECONDS_ENV = TEST_HOLD_SECONDS


def parse_holds(raw: str, attempt: int) -> dict[str, int]:
    """`KUBETRAIN_TEST_HF_HOLD` for this attempt: {"step": N, "save": M}; ValueError names the bad entry."""
    holds: dict[str, int] = {}
    for entry in filter(None, (e.strip() for e in raw.split(","))):
        parts = entry.split(":")
        if len(parts) != 3 or parts[1] not in ("step", "save") or not all(p.isdigit() for p in parts[::2]):
            raise ValueError(f"{HF_HOLD_ENV}: {entry!r} is not <attempt>:step:<N> or <attempt>:save:<N>")
        if int(parts[0]) == attempt:
            holds[parts[1]] = int(parts[2])
    return holds


def _hold(what: str) -> None:
    seconds = float(WorkerEnv.from_environ().test_hold_seconds or 600)
    print(f"kubetrain test hook: holding {what} until SIGTERM (at most {seconds:.0f} s)", file=sys.stderr, flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # SIGTERM's default action ends the process here
        time.sleep(0.2)


class KubetrainCheckpointCallback(TrainerCallback):
    """Marks each checkpoint folder the HF Trainer saved as complete for this process, and reports progress."""

    def __init__(self) -> None:
        env = WorkerEnv.from_environ()
        self._holds = parse_holds(env.test_hf_hold, env.attempt or 0) if env.test_hf_hold else {}
        self.progress = ProgressTracker.from_env()

    def on_train_begin(self, args, state, control, **kwargs):
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_backend() == "gloo":
            settle_gloo_at_exit()  # the script's group: torch's gloo may abort a finished run as it exits
        if state.is_local_process_zero:
            self.progress.train_begin(step=state.global_step, max_steps=state.max_steps,
                                      tokens_seen=getattr(state, "num_input_tokens_seen", None) or None,
                                      reports_end=True)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.is_local_process_zero:
            self.progress.step_begin()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero:
            self.progress.logged(logs)

    def on_evaluate(self, args, state, control, **kwargs):
        if state.is_local_process_zero:
            self.progress.event()

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_local_process_zero:
            self.progress.train_end()

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        step = state.global_step
        if state.is_local_process_zero:
            # HF's state.train_batch_size is per process: the global batch is counted here.
            per_step = (state.train_batch_size or args.per_device_train_batch_size) \
                * args.gradient_accumulation_steps * args.world_size
            self.progress.step_end(step=step, max_steps=state.max_steps, epoch=state.epoch, samples_per_step=per_step,
                                   tokens_seen=getattr(state, "num_input_tokens_seen", None) or None,
                                   learning_rate=(lambda: lr_scheduler.get_last_lr()[0]) if lr_scheduler else None)
        if self._holds.get("step") == step:
            _hold(f"after step {step}")
        if self._holds.get("save") == step:
            # The Trainer writes model.safetensors, then torch.save()s the rest of checkpoint-<step>:
            # hold at the first of those, so the folder is half written when the SIGTERM lands.
            original = torch.save

            def held_save(*a, **kw):
                torch.save = original
                _hold(f"inside the save of checkpoint-{step} (model written, the rest not)")
                return original(*a, **kw)

            torch.save = held_save

    def on_save(self, args, state, control, **kwargs):
        if state.is_local_process_zero:  # before the marker: the launcher's commit record reads the save time
            self.progress.saved(state.global_step)
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not folder.is_dir():  # rotated away already, or this process wrote nothing there
            return
        env = WorkerEnv.from_environ()
        local_rank = env.local_rank if env.local_rank_set else int(getattr(args, "local_process_index", 0) or 0)
        local_world_size = env.local_world_size
        mark_ready(folder, local_rank=local_rank, local_world_size=local_world_size)
        log.debug("marked %s ready (local rank %d of %d)", folder, local_rank, local_world_size)


__all__ = ["KubetrainCheckpointCallback"]
