"""`group_by_length`: batches of samples of similar length, in an order that resumes exactly.

HF's `LengthGroupedSampler` (transformers' trainer_pt_utils) orders an epoch so: a random permutation cut into
megabatches of `train_batch_size * gradient_accumulation_steps` samples times 50 (fewer on a small set, so that
there are 4), each sorted longest first, then the longest sample of all swapped into the first place, so that
running out of memory shows at the first step rather than hours in. accelerate deals that order out in batches
of `per_device_train_batch_size`: rank r's k-th batch is batch `k * world_size + r`.

Here the permutation is the resumable sampler's (a function of `data_seed` and the epoch alone), and the grouping
a pure function of it and the lengths, so the order is the same on every rank and in every run: a resume
mid-epoch starts at the same global sample of the same order, as without grouping. The batches are dealt as
accelerate deals them (a rank's batch is one run of similar lengths); the last incomplete round of batches sample
by sample, so that every rank has as many batches.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from .args_values import ConfigError
from .data import ResumableDistributedSampler

logger = logging.getLogger("kubetrain_trainer")

MEGABATCH_MULT = 50
"""Megabatches of at most this many groups (HF's `mega_batch_mult`)."""


def length_grouped_order(permutation: Sequence[int], lengths: Sequence[int], group: int) -> list[int]:
    """HF's `get_length_grouped_indices` over a given permutation: the same order for the same permutation."""
    mult = min(len(permutation) // (group * 4), MEGABATCH_MULT) or 1
    size = mult * group
    megabatches = [sorted(permutation[i:i + size], key=lengths.__getitem__, reverse=True)
                   for i in range(0, len(permutation), size)]
    if megabatches:  # the longest sample first (the first of the ties, as torch.argmax takes it)
        longest = max(range(len(megabatches)), key=lambda m: lengths[megabatches[m][0]])
        megabatches[0][0], megabatches[longest][0] = megabatches[longest][0], megabatches[0][0]
    return [i for megabatch in megabatches for i in megabatch]


class BatchDealtSampler(ResumableDistributedSampler):
    """The resumable sampler's epochs dealt to the ranks in whole batches of `batch_size`, as accelerate deals a
    sampler's order in HF (`train_sampling_strategy` sequential and group_by_length: a batch is a run of the order)."""

    def __init__(self, dataset_len: int, *, batch_size: int, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        super().__init__(dataset_len, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.batch_size = batch_size

    def __iter__(self):
        rest = self.epoch_order()[self.start_sample:]
        round_ = self.batch_size * self.num_replicas
        whole = len(rest) - len(rest) % round_
        first = self.rank * self.batch_size
        mine = [i for start in range(first, whole, round_) for i in rest[start:start + self.batch_size]]
        return iter(mine + rest[whole + self.rank::self.num_replicas])  # the tail is a multiple of the world


class LengthGroupedSampler(BatchDealtSampler):
    """The resumable sampler's epochs in HF's length-grouped order, dealt to the ranks in whole batches."""

    def __init__(self, lengths: Sequence[int], *, batch_size: int, group: int, num_replicas: int = 1, rank: int = 0,
                 seed: int = 0, drop_last: bool = False):
        super().__init__(len(lengths), batch_size=batch_size, num_replicas=num_replicas, rank=rank, shuffle=True,
                         seed=seed, drop_last=drop_last)
        self.lengths, self.group = list(lengths), group

    def permutation(self) -> list[int]:
        return length_grouped_order(super().permutation(), self.lengths, self.group)


def dataset_lengths(dataset: Any, *, column: str, model_input_name: str) -> list[int]:
    """The rows' lengths, as HF takes them: an HF dataset's `column` where it has one, else each row's
    `model_input_name` measured (a ConfigError naming both when neither is there)."""
    columns = getattr(dataset, "column_names", None)  # an HF datasets.Dataset
    if isinstance(columns, (list, tuple)) and column in columns:
        values = dataset[column]
        return [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]
    n = len(dataset)
    first = dataset[0] if n else {model_input_name: ()}
    if not isinstance(first, Mapping) or model_input_name not in first:
        got = f"keys {', '.join(map(repr, first))}" if isinstance(first, Mapping) else type(first).__name__
        raise ConfigError(f"group_by_length: the training data has no {column!r} column (length_column_name) and "
                          f"its rows ({got}) have no {model_input_name!r} to measure: add a column of lengths and "
                          "name it in length_column_name, or set group_by_length: false")
    logger.info("group_by_length: measuring the %d training rows' %r", n, model_input_name)
    return [len(dataset[i][model_input_name]) for i in range(n)]
