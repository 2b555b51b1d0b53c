"""Samplers and dataloaders that resume mid-epoch in O(1).

The HF Trainer resumes mid-epoch by iterating (and discarding) every batch
already seen, which costs as long as the training it skips. Here the data
order of an epoch is a pure function of (data_seed, epoch): a permutation of
the dataset, padded so that every rank gets the same count, dealt out
round-robin to the ranks. After `n` samples have been consumed globally the
remaining order is `perm[n:]` dealt out the same way, so the sampler starts
there directly — no batch is loaded to be thrown away, and the world size
may even change between runs. Iterable datasets have no random access; they
fall back to skipping batches (logged). On several ranks one is read by rank 0
alone, which deals the batches (`DispatchedLoader`), or with
`accelerator_config.dispatch_batches: false` by every rank, each keeping its part (`IterableShard`).

Without a `data_collator`, batches are made as HF's `default_data_collator`
makes them (`default_data_collator` here; transformers is not needed).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import math
import pickle
import sys
from operator import attrgetter
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, Sized

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate, get_worker_info


class ResumableDistributedSampler(Sampler[int]):
    """Deterministic per-epoch order, sharded across ranks, that can start at any global sample offset."""

    def __init__(self, dataset_len: int, *, num_replicas: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside [0, {num_replicas})")
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.start_sample = 0
        # Same count on every rank, or collectives would hang on the uneven last step.
        if drop_last:
            self.total_size = (dataset_len // num_replicas) * num_replicas
        else:
            self.total_size = math.ceil(dataset_len / num_replicas) * num_replicas

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        """Select the epoch's order and skip its first `start_sample` samples (global count)."""
        self.epoch = epoch
        self.start_sample = min(start_sample - start_sample % self.num_replicas, self.total_size)

    def permutation(self) -> list[int]:
        """The epoch's order of the dataset's rows, before the padding to a multiple of the world."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.dataset_len, generator=g).tolist()
        return list(range(self.dataset_len))

    def epoch_order(self) -> list[int]:
        order = self.permutation()
        if self.total_size > len(order):  # pad by wrapping around, like DistributedSampler
            order += (order * math.ceil(self.total_size / max(len(order), 1)))[: self.total_size - len(order)]
        return order[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        order = self.epoch_order()
        return iter(order[self.start_sample + self.rank:: self.num_replicas])

    def __len__(self) -> int:
        return (self.total_size - self.start_sample) // self.num_replicas

    def samples_per_rank(self) -> int:
        """Samples one rank sees in a whole epoch."""
        return self.total_size // self.num_replicas


class IterableShard(IterableDataset):
    """One rank's part of an iterable dataset, as HF splits it (accelerate's `IterableDatasetShard`; its default,
    where rank 0 reads and sends each rank its batch, gives each rank the same samples): of every
    `batch_size * num_replicas` samples in a row, rank r takes the r-th `batch_size`. The last incomplete group
    is dropped (`drop_last`) or completed from the first samples, so every rank has as many batches and none
    waits at a collective for a rank whose data ran out. `rank` None: every rank's part, in rank order (what
    rank 0 reads to deal, `DispatchedLoader`)."""

    def __init__(self, dataset: IterableDataset, *, batch_size: int, num_replicas: int, rank: int | None,
                 drop_last: bool) -> None:
        self.dataset, self.batch_size, self.num_replicas, self.rank = dataset, batch_size, num_replicas, rank
        self.drop_last = drop_last

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        n, group = len(self.dataset), self.batch_size * self.num_replicas  # TypeError without a length
        per_rank = (n // group if self.drop_last else math.ceil(n / group)) * self.batch_size
        return per_rank * (self.num_replicas if self.rank is None else 1)

    def __iter__(self) -> Iterator:
        group = self.batch_size * self.num_replicas
        mine = slice(None) if self.rank is None else slice(self.rank * self.batch_size,
                                                             (self.rank + 1) * self.batch_size)
        first: list = []
        current: list = []
        for sample in self.dataset:
            current.append(sample)
            if len(current) == group:
                yield from current[mine]
                first = first or current
                current = []
        if current and not self.drop_last:
            current += (first or current) * math.ceil(group / len(first or current))
            yield from current[:group][mine]


class DispatchedLoader(DataLoader):
    """An iterable training set read once, by rank 0, which sends each rank its batch (HF's default for one:
    accelerate's `dispatch_batches`). Its dataset is an `IterableShard` of every rank's part: rank 0's loader
    makes the batches of a group in rank order and scatters them, one per rank; the other ranks never read the
    stream (nor start workers) and get the batches `IterableShard` would have given them. The end of the stream
    is scattered too (None), so every rank stops at the same batch. *Collective*: every rank iterates it alike,
    as the training loop does."""

    def __init__(self, *args: Any, world: int, rank: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.world, self.rank = world, rank

    def __len__(self) -> int:
        return super().__len__() // self.world

    def __iter__(self) -> Iterator:
        import torch.distributed as dist

        if self.rank:
            while True:
                box: list = [None]
                dist.scatter_object_list(box, None, src=0)
                if isinstance(box[0], _DispatchFailed):
                    raise RuntimeError(f"rank 0 could not read or send the training data's next batches "
                                       f"({box[0].error}): see rank 0's log")
                if box[0] is None:
                    return
                yield box[0]
        batches = super().__iter__()
        while True:
            # Rank 0's error is sent, else the others wait for their batch until the group's timeout: one reading
            # the stream, or pickling a batch (scatter_object_list pickles all before it sends a byte).
            parts: list | None = None
            try:
                parts = list(itertools.islice(batches, self.world))
                dist.scatter_object_list([None], parts if len(parts) == self.world else [None] * self.world, src=0)
            except Exception as exc:
                if parts is not None and not isinstance(exc, (pickle.PicklingError, TypeError, AttributeError)):
                    raise  # the scatter itself failed (a rank gone, a timeout): nothing can be sent
                failed = _DispatchFailed(f"{type(exc).__name__}: {exc}")
                dist.scatter_object_list([None], [failed] * self.world, src=0)
                raise
            if len(parts) < self.world:  # whole groups only: a short round is the end
                return
            yield parts[0]


class _DispatchFailed:
    """What rank 0 scatters instead of batches when it could not read or send them: the others raise it."""

    def __init__(self, error: str) -> None:
        self.error = error


class EpochRelay(IterableDataset):
    """A stream's `set_epoch` carried to its copies in persistent data workers: they were made at the first
    epoch, so the main process's `set_epoch` alone never reached them and every epoch replayed the first's order.
    The epoch sits in shared memory and each worker's copy is told it as its pass starts (as `datasets` shares an
    `IterableDataset`'s epoch with torch's persistent workers)."""

    def __init__(self, dataset: IterableDataset) -> None:
        self.dataset = dataset
        self.epoch = torch.zeros((), dtype=torch.long).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)
        self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dataset)  # TypeError without a length

    def __iter__(self) -> Iterator:
        if get_worker_info() is not None:  # a worker's copy, made at an earlier epoch
            self.dataset.set_epoch(int(self.epoch))
        return iter(self.dataset)


def batches_per_epoch(sampler: ResumableDistributedSampler, batch_size: int, drop_last: bool) -> int:
    n = sampler.samples_per_rank()
    return n // batch_size if drop_last else math.ceil(n / batch_size)


def has_length(dataset: Any) -> bool:
    try:
        return isinstance(dataset, Sized) and len(dataset) >= 0 and not isinstance(dataset, IterableDataset)
    except TypeError:
        return False


def seed_worker(worker_id: int, num_workers: int = 1, rank: int = 0) -> None:
    """Seed python/numpy in each worker from torch's per-worker seed (which derives from the loader's generator),
    offset by `num_workers * rank` as HF's `seed_worker` offsets it: the loader's generator is seeded alike on every
    rank, and without it each rank's worker k drew the same augmentation as every other rank's."""
    import random

    import numpy as np

    seed = torch.initial_seed() + num_workers * rank
    if rank:
        torch.manual_seed(seed)
    random.seed(seed % 2**32)
    np.random.seed(seed % 2**32)


def make_loader(dataset: Dataset, *, batch_size: int, sampler: Sampler | None, collate_fn: Callable | None,
                num_workers: int, pin_memory: bool, drop_last: bool, generator_seed: int, rank: int = 0,
                persistent_workers: bool = False, prefetch_factor: int | None = None,
                dispatch_to: int = 0) -> DataLoader:
    """`persistent_workers` and `prefetch_factor` apply with workers only (torch refuses them without).
    `dispatch_to` > 1 ranks: a `DispatchedLoader` (rank 0 reads `dataset`, every rank's part, and deals it)."""
    # A private generator: DataLoader draws the workers' base seed from it rather than from the
    # global torch RNG, which would otherwise advance at each epoch start and break exact resume.
    g = torch.Generator()
    g.manual_seed(generator_seed)
    dispatch = dict(world=dispatch_to, rank=rank) if dispatch_to > 1 else {}
    if sampler is None:  # a stream is read whole, by rank 0 (`DispatchedLoader`) or by every rank (`_dealt`, a
        rank = 0  # rank's `IterableShard`): its workers must draw alike on every rank (HF seeds per rank only the
        # sets a sampler shards)
    return (DispatchedLoader if dispatch else DataLoader)(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn or default_data_collator,
        num_workers=num_workers,
        pin_memory=pin_memory,
        drop_last=drop_last,
        generator=g,
        worker_init_fn=functools.partial(seed_worker, num_workers=num_workers, rank=rank) if num_workers else None,
        persistent_workers=persistent_workers and num_workers > 0,
        prefetch_factor=prefetch_factor if num_workers else None,
        **dispatch,
    )


logger = logging.getLogger("kubetrain_trainer")


class RemoveColumns:
    """HF's `RemoveColumnsCollator` (`remove_unused_columns`): dict rows keep only the keys in `keep` (the model's
    `forward` arguments and the label columns) before `collate` batches them; the first drop is logged."""

    def __init__(self, collate: Callable, keep: frozenset[str], what: str) -> None:
        self.collate, self.keep, self.what, self.told = collate, keep, what, False

    def __call__(self, features: list) -> Any:
        if features and isinstance(features[0], Mapping) and not self.keep.issuperset(features[0]):
            if not self.told:
                self.told = True
                logger.info("the %s's columns %s are not arguments of the model's forward: ignored (as HF; set "
                            "remove_unused_columns: false to keep them)", self.what,
                            ", ".join(sorted(k for k in features[0] if k not in self.keep)))
            features = [{k: v for k, v in f.items() if k in self.keep} for f in features]
        return self.collate(features)


def remove_unused_columns(collate: Callable | None, model: Any, label_names: Sequence[str] | None,
                          what: str) -> Callable | None:
    """`collate` (None: `default_data_collator`) behind `RemoveColumns`; as it is for a plain module's
    `forward(**kwargs)`. A transformers model's `**kwargs` (every one's, in transformers 5) are its own options
    (attention, cache), never a column: its named arguments are kept, as HF keeps them (of a PEFT model's base
    model, as HF reads them)."""
    if type(model).__module__.partition(".")[0] == "peft" and hasattr(model, "get_base_model"):
        model = model.get_base_model()
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no signature to read: nothing is known to be unused
        return collate
    transformers = sys.modules.get("transformers")  # a transformers model has imported it
    if (any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            and not (transformers and isinstance(model, getattr(transformers, "PreTrainedModel", ())))):
        return collate  # it takes any keyword: no column is unused
    keep = frozenset(params) | {"label", "label_ids"} | set(label_names or ())
    return RemoveColumns(collate or default_data_collator, keep, what)


_TENSOR = frozenset((torch.Tensor,))
_LABEL_KEYS = ("label", "label_ids")


def _is_numpy(value: Any) -> bool:
    return type(value).__module__ == "numpy"  # an ndarray or a numpy scalar (numpy stays optional)


def _stack_numpy(values: list) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.stack(values))


def _labels(values: list, ids: bool) -> torch.Tensor:
    """The `labels` of a batch from its rows' `label` (`ids` False) or `label_ids` (`ids` True) values.

    HF's rules where they work: a Python int or a 0-dim non-float tensor is long, a Python float, a 0-dim
    float tensor or a list under `label` float32, `label_ids` lists by their first item. Where HF fails or loses the type: a tensor with
    dimensions (a multi-label row) is stacked as it is, numpy values keep their dtype (HF makes numpy ints
    float32), and empty `label_ids` lists are long (HF raises IndexError)."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        if ids or first.dim():
            return torch.stack(values)
        return torch.stack(values).to(torch.float if first.is_floating_point() else torch.long)
    if _is_numpy(first):  # ints keep their type; floats are float32, as HF makes every float label
        stacked = _stack_numpy(values)
        return stacked.float() if stacked.is_floating_point() else stacked
    sample = (first[0] if first else 0) if ids and isinstance(first, (list, tuple)) else first
    integral = isinstance(sample, int) or (_is_numpy(sample) and sample.dtype.kind in "biu")
    return torch.tensor(values, dtype=torch.long if integral else torch.float)


def default_data_collator(features: list) -> Any:
    """HF's `default_data_collator` (the HF Trainer's default), with torch's `default_collate` where HF has none.

    Rows that are mappings (or objects, through `vars`) become one dict: tensors are stacked, numpy arrays
    stacked, anything else (Python numbers, lists of them) goes through `torch.tensor`; keys whose first
    value is None or a string are dropped, and `label` / `label_ids` become `labels` (see `_labels`). A batch
    of dicts of tensors only without those keys (the common case, every step) and rows that are tuples or
    tensors go to torch's `default_collate` as before, so those batches are exactly what they were.
    """
    first = features[0]
    if (type(first) is dict and _TENSOR.issuperset(map(type, first.values()))
            and "label" not in first and "label_ids" not in first):
        return default_collate(features)
    if not isinstance(first, Mapping):
        if isinstance(first, (torch.Tensor, tuple, list)) or not hasattr(first, "__dict__"):
            return default_collate(features)
        features = [vars(f) for f in features]
        first = features[0]
    batch: dict[str, Any] = {}
    if first.get("label") is not None:
        batch["labels"] = _labels([f["label"] for f in features], ids=False)
    elif first.get("label_ids") is not None:
        batch["labels"] = _labels([f["label_ids"] for f in features], ids=True)
    for key, value in first.items():
        if key in _LABEL_KEYS or value is None or isinstance(value, str):
            continue
        values = [f[key] for f in features]
        if isinstance(value, torch.Tensor):
            batch[key] = torch.stack(values)
        elif type(value).__name__ == "ndarray" and _is_numpy(value):
            batch[key] = _stack_numpy(values)
        elif isinstance(value, Mapping):  # nested: HF has no rule; torch's
            batch[key] = default_collate(values)
        else:
            batch[key] = torch.tensor(values)
    return batch


_DEVICE = attrgetter("device")
_IS_CPU = attrgetter("is_cpu")  # a flag, where .device makes a device object per tensor


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        values = batch.values()
        # Every step: a dict of tensors already on `device` (a CPU run's batches) is checked and copied in C.
        # A copy, as before: an override that pops the labels must not change a batch its loader hands out again.
        if _TENSOR.issuperset(map(type, values)) and (all(map(_IS_CPU, values)) if device.type == "cpu"
                                                      else {device} == set(map(_DEVICE, values))):
            return dict(batch)
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(to_device(v, device) for v in batch)
    if hasattr(batch, "to") and callable(batch.to):  # e.g. a transformers BatchEncoding
        return batch.to(device)
    return batch


def batch_size_of(batch: Any) -> int:
    """Leading dimension of the first tensor in a batch (used to weight eval losses)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):  # a dict, or a collator's BatchEncoding (a UserDict)
        return batch_size_of(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    return 1


def with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """(item, whether it is the last one): HF's `end_of_dataloader`, read one item ahead."""
    items = iter(items)
    for item in items:
        for after in items:
            yield item, False
            item = after
        yield item, True
