"""`TrainerState.total_flos` as the HF Trainer counts it, without a cost per step.

HF (transformers 5.17, `Trainer.floating_point_ops`) adds, for every micro-batch on every rank,
6 x the numel of its main input (`model.main_input_name`, else `input_ids`) x the model's
`num_parameters(exclude_embeddings=True)`, and sums the ranks into `total_flos` when it logs, saves
and ends. A model without `num_parameters` (a plain `nn.Module`), or a batch without the main
input, counts 0.

The loop counts nothing per step here. The parameters are counted once, in the first `train()`
before the strategy shards them (the whole model's count on every rank). When the loop logs, saves
or ends, the steps since the last count are priced at the global batch each (all ranks' samples of a
step: no collective) of as many main-input elements per sample as the last micro-batch
trained has. That is HF's number for batches of one shape (fixed-length or packed sequences, the
built-in task's); with padding to each batch's longest row it is an estimate from the last
micro-batch, and an epoch's short last batch (or step) counts as a full one, as `data_position`
does. A resumed run continues from the checkpoint's `total_flos`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def non_embedding_parameters(model: nn.Module) -> int:
    """`model.num_parameters(exclude_embeddings=True)` (HF's factor); 0 for a model without it (HF counts no
    flos for it). Call it on the unsharded model: a ZeRO-3 rank's partitioned parameters hold no elements."""
    count = getattr(model, "num_parameters", None)
    if not callable(count):
        return 0
    try:
        return int(count(exclude_embeddings=True))
    except (TypeError, ValueError):  # a model's own num_parameters of another signature: bookkeeping never fails a run
        return 0


class FlosCounter:
    """Adds the flos of the steps since its last `store` to `state.total_flos` (see the module docstring)."""

    def __init__(self, model: nn.Module, parameters: int, step: int, samples_per_step: int):
        self.main_input = getattr(model, "main_input_name", "input_ids")
        self.parameters = parameters
        self.samples_per_step = samples_per_step
        """The global batch: per-device batch x accumulation x world size."""
        self.step = step
        """The step up to which `total_flos` counts."""

    def store(self, state: Any, batch: Any) -> None:
        """Count the steps since the last call, each of `samples_per_step` samples shaped as `batch` (the
        last micro-batch trained: the loop's variable, which an epoch's empty end leaves as it was)."""
        steps, self.step = state.global_step - self.step, state.global_step
        value = batch.get(self.main_input) if isinstance(batch, Mapping) else None
        if steps <= 0 or not self.parameters or not isinstance(value, torch.Tensor) or not value.dim():
            return  # nothing trained since, or no main input: HF counts 0
        per_sample = value.numel() / value.shape[0] if value.shape[0] else 0
        state.total_flos += 6 * self.parameters * steps * self.samples_per_step * per_sample
