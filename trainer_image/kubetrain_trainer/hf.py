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

This module needs `transformers` (the user's image has it; kubetrain's own
image does not), and never talks to S3.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from transformers import TrainerCallback

from kubetrain_trainer.readiness import mark_ready

log = logging.getLogger(__name__)


class KubetrainCheckpointCallback(TrainerCallback):
    """Marks each checkpoint folder the HF Trainer saved as complete for this process."""

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not folder.is_dir():  # rotated away already, or this process wrote nothing there
            return
        local_rank = int(os.environ.get("LOCAL_RANK", getattr(args, "local_process_index", 0) or 0))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        mark_ready(folder, local_rank=local_rank, local_world_size=local_world_size)
        log.debug("marked %s ready (local rank %d of %d)", folder, local_rank, local_world_size)


__all__ = ["KubetrainCheckpointCallback"]
