"""How many optimizer steps a run has, and where an epoch's batches start on a resume.

Both are fixed by the dataloader and the arguments before the loop starts, so
they are plain functions of them, kept out of the loop: the loop only asks
"how many steps" and "the batches of epoch e after s samples".
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Iterator

from torch.utils.data import DataLoader

from . import rng
from .args import ConfigError, TrainingArguments
from .data import ResumableDistributedSampler, batches_per_epoch, has_length
from .state import DataPosition

logger = logging.getLogger("kubetrain_trainer")


@dataclass(frozen=True)
class StepPlan:
    """How many steps, epochs and batches this run has (fixed before the loop starts)."""

    max_steps: int
    num_epochs: int
    batches_per_epoch: int | None
    """Micro-batches per rank in a full epoch; None for iterable datasets."""


def plan_steps(dataloader: DataLoader, args: TrainingArguments) -> StepPlan:
    """The run's steps from the dataloader's length (or `max_steps` when it has none)."""
    sampler = getattr(dataloader, "sampler", None)
    if isinstance(sampler, ResumableDistributedSampler):
        sampler.set_epoch(0, 0)
        per_epoch = batches_per_epoch(sampler, args.per_device_train_batch_size, args.dataloader_drop_last)
    elif has_length(dataloader):
        per_epoch = len(dataloader)
    else:
        per_epoch = None
    if per_epoch is None or per_epoch == 0:
        if args.max_steps <= 0 and isinstance(sampler, ResumableDistributedSampler) and sampler.dataset_len:
            raise ConfigError(f"the training data's {sampler.dataset_len} rows make no batch of "
                              f"per_device_train_batch_size {args.per_device_train_batch_size} on each of "
                              f"{sampler.num_replicas} rank(s) with dataloader_drop_last: set dataloader_drop_last: "
                              "false, or a smaller per_device_train_batch_size")
        if args.max_steps <= 0:
            raise ConfigError("the training data has no length (or is empty): set max_steps")
        return StepPlan(args.max_steps, 1, None)
    steps_per_epoch = math.ceil(per_epoch / args.gradient_accumulation_steps)
    if args.max_steps > 0:
        return StepPlan(args.max_steps, math.ceil(args.max_steps / steps_per_epoch), per_epoch)
    max_steps = math.ceil(args.num_train_epochs * steps_per_epoch)
    return StepPlan(max_steps, math.ceil(args.num_train_epochs), per_epoch)


def position_from_step(global_step: int, plan: StepPlan, args: TrainingArguments, world_size: int) -> DataPosition:
    """Where the data stands after `global_step` steps, as the HF Trainer derives it on a resume: whole epochs
    of `ceil(batches / gradient_accumulation_steps)` steps, then full steps of the current one (an iterable
    dataset: all in epoch 0). Exact for a run that never cut an epoch short (`should_epoch_stop`)."""
    per_epoch = math.ceil(plan.batches_per_epoch / args.gradient_accumulation_steps) if plan.batches_per_epoch else 0
    epoch, steps = divmod(global_step, per_epoch) if per_epoch else (0, global_step)
    return DataPosition(epoch, steps * args.gradient_accumulation_steps * args.per_device_train_batch_size * world_size)


def epoch_batches(dataloader: DataLoader, *, epoch: int, skip_samples: int, args: TrainingArguments,
                  world_size: int) -> Iterator:
    """An iterator over the epoch's batches starting after `skip_samples` (global count)."""
    if getattr(dataloader, "generator", None) is not None:
        dataloader.generator.manual_seed(args.data_seed + epoch)  # same worker seeds after a resume
    sampler = getattr(dataloader, "sampler", None)
    if isinstance(sampler, ResumableDistributedSampler):
        sampler.set_epoch(epoch, skip_samples)  # O(1) skip: the sampler starts at the offset
        return iter(dataloader)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    elif hasattr(dataloader.dataset, "set_epoch"):  # a stream that shuffles per epoch (HF's loader calls it)
        dataloader.dataset.set_epoch(epoch)
    skip_batches = skip_samples // (args.per_device_train_batch_size * world_size)
    if not skip_batches:
        return iter(dataloader)
    logger.warning("this dataloader cannot seek: skipping %d batches by iterating them", skip_batches)
    # The skipped batches were trained before the checkpoint: what they draw from the global generators (a
    # streaming dataset's augmentation, a loader without a generator's worker seed) is not this run's. The
    # resumed state comes back before the first real batch, as HF restores it after `skip_first_batches`.
    resumed = rng.capture()
    iterator = iter(dataloader)
    for _ in itertools.islice(iterator, skip_batches):
        pass
    rng.restore(resumed)
    return iterator
