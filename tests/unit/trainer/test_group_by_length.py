"""`group_by_length` and `length_column_name`, as HF's `LengthGroupedSampler` orders the training data.

Before, both were unknown arguments: an HF script passing them failed at once (ConfigError, exit 82). The order
is HF's for the same permutation, dealt in whole batches as accelerate deals them, and a function of the seed and
the epoch only: every rank computes the same one, and a run stopped and resumed mid-epoch trains the same batches
as the run that went straight through.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch import nn

from kubetrain_trainer import ConfigError, Trainer, TrainerCallback, TrainingArguments
from kubetrain_trainer import distributed as dist_util
from kubetrain_trainer.length_grouping import LengthGroupedSampler


def _lengths(n, seed=0):
    rng = random.Random(seed)
    return [rng.randint(1, 60) for _ in range(n)]


# ------------------------------------------------------------------------------------------- the order
@pytest.mark.parametrize("n,group", [(7, 4), (100, 4), (1000, 8), (1003, 6)])
def test_the_order_is_hf_s_for_the_same_permutation(n, group):
    hf = pytest.importorskip("transformers.trainer_pt_utils")
    lengths = _lengths(n)
    for epoch in (0, 3):
        sampler = LengthGroupedSampler(lengths, batch_size=group, group=group, seed=11)
        sampler.set_epoch(epoch)
        expected = hf.get_length_grouped_indices(lengths, group, generator=torch.Generator().manual_seed(11 + epoch))
        assert sampler.permutation() == expected
        assert lengths[expected[0]] == max(lengths)  # the longest first: an out-of-memory shows at once


@pytest.mark.parametrize("world,drop_last", [(1, False), (2, False), (3, False), (3, True)])
def test_ranks_get_whole_batches_of_the_order_in_turn_and_as_many(world, drop_last):
    lengths, bs = _lengths(103), 4
    ranks = [LengthGroupedSampler(lengths, batch_size=bs, group=bs * 2, num_replicas=world, rank=r, seed=1,
                                  drop_last=drop_last) for r in range(world)]
    order = ranks[0].epoch_order()
    seen = [list(s) for s in ranks]
    assert len({len(x) for x in seen}) == 1 and len(seen[0]) == len(ranks[0])
    rounds = len(order) // (bs * world)
    for r in range(world):  # rank r's k-th batch is the order's batch k * world + r (accelerate's dealing)
        assert seen[r][:rounds * bs] == [i for k in range(rounds) for i in
                                         order[(k * world + r) * bs:(k * world + r + 1) * bs]]
    assert sorted(sum(seen, [])) == sorted(order)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_resumed_epoch_is_the_tail_of_the_full_one_on_every_rank(world):
    lengths, bs = _lengths(90), 3
    make = lambda r: LengthGroupedSampler(lengths, batch_size=bs, group=bs, num_replicas=world, rank=r, seed=4)  # noqa: E731
    for epoch in (0, 1):
        full = []
        for r in range(world):
            s = make(r)
            s.set_epoch(epoch)
            full.append(list(s))
        for consumed in range(0, 91, bs * world):
            for r in range(world):
                s = make(r)
                s.set_epoch(epoch, consumed)
                assert list(s) == full[r][consumed // world:] and len(s) == len(full[r]) - consumed // world


# ----------------------------------------------------------------------------- the Trainer
class Rows(torch.utils.data.Dataset):
    """Token rows of lengths 1..13 (not in order), each with its index."""

    def __init__(self, n=40, key="input_ids"):
        self.n, self.key = n, key

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {self.key: list(range((i * 7) % 13 + 1)), "idx": i}


class LengthColumn(Rows):
    """An HF `datasets.Dataset`'s surface: named columns, a column by name (rows are never read for lengths)."""

    column_names = ["input_ids", "idx", "n_tokens"]
    reads = 0

    def __getitem__(self, key):
        if key == "n_tokens":
            return torch.tensor([100 - i for i in range(self.n)])  # as a torch-formatted dataset gives it
        self.reads += 1
        return super().__getitem__(key)


def pad(rows):
    width = max(len(r["input_ids"]) for r in rows)
    return {"input_ids": torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in rows]),
            "idx": torch.tensor([r["idx"] for r in rows])}


class Recorder(nn.Module):
    def __init__(self, seen):
        super().__init__()
        self.w, self.seen = nn.Parameter(torch.ones(())), seen

    def forward(self, input_ids, idx):
        self.seen.append(idx.tolist())
        return {"loss": (self.w * input_ids.float().mean()) ** 2}


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _trainer(make_args, seen, dataset=None, callbacks=(), **kw):
    args = make_args(**{"group_by_length": True, "per_device_train_batch_size": 4, "max_steps": 14, "save_steps": 3,
                        "gradient_accumulation_steps": 1, **kw})
    return Trainer(model=Recorder(seen), args=args, train_dataset=dataset or Rows(), data_collator=pad,
                   callbacks=list(callbacks))


def test_the_arguments_are_hf_s():
    args = TrainingArguments.from_dict({"group_by_length": "true", "length_column_name": "n_tokens"})
    assert args.group_by_length is True and args.length_column_name == "n_tokens"
    assert TrainingArguments().group_by_length is False and TrainingArguments().length_column_name == "length"


def test_training_batches_hold_similar_lengths_longest_first(make_args):
    def batch_lengths(**kw):
        seen = []
        _trainer(make_args, seen, dataset=Rows(160), save_strategy="no", max_steps=40, **kw).train()  # one epoch
        assert sorted(sum(seen, [])) == list(range(160))
        return [[(i * 7) % 13 + 1 for i in batch] for batch in seen]

    grouped, shuffled = batch_lengths(), batch_lengths(group_by_length=False)
    assert grouped[0][0] == 13 and all(b == sorted(b, reverse=True) for b in grouped)  # runs of sorted megabatches
    spread = lambda batches: sum(max(b) - min(b) for b in batches)  # noqa: E731
    assert spread(grouped) * 4 < spread(shuffled), (grouped, shuffled)  # megabatches of 10 batches


def test_stop_checkpoint_and_resume_mid_epoch_train_the_straight_run_s_batches(make_args, tmp_path):
    straight, split = [], []
    _trainer(make_args, straight, output_dir=str(tmp_path / "a")).train()
    _trainer(make_args, split, output_dir=str(tmp_path / "b"), callbacks=[StopAt(6)]).train()  # checkpoint-6
    assert len(split) == 6
    _trainer(make_args, split, output_dir=str(tmp_path / "b")).train(resume_from_checkpoint=True)
    assert split == straight and len(straight) == 14  # epoch 0's 10 batches, then epoch 1's first 4


def test_the_length_column_is_read_where_the_dataset_has_it(make_args):
    data = LengthColumn()
    sampler = _trainer(make_args, [], dataset=data, length_column_name="n_tokens").get_train_dataloader().sampler
    assert sampler.lengths == [100 - i for i in range(40)] and data.reads == 0
    measured = _trainer(make_args, [], dataset=LengthColumn()).get_train_dataloader().sampler  # no "length" column
    assert measured.lengths == [(i * 7) % 13 + 1 for i in range(40)]


def test_rows_are_measured_by_the_processing_class_s_first_input_name(make_args):
    class Processor:
        model_input_names = ["input_values", "attention_mask"]

    trainer = _trainer(make_args, [], dataset=Rows(key="input_values"))
    trainer.processing_class = Processor()
    assert trainer.get_train_dataloader().sampler.lengths == [(i * 7) % 13 + 1 for i in range(40)]


def test_without_a_column_or_input_ids_it_is_a_config_error_naming_both(make_args):
    trainer = _trainer(make_args, [], dataset=Rows(key="tokens"))
    with pytest.raises(ConfigError, match=r"group_by_length: the training data has no 'length' column "
                                          r"\(length_column_name\) and its rows \(keys 'tokens', 'idx'\) have no "
                                          r"'input_ids'"):
        trainer.get_train_dataloader()


def test_each_rank_trains_its_batches_of_the_same_order(make_args, monkeypatch):
    trainer = _trainer(make_args, [])
    monkeypatch.setattr(dist_util, "world_size", lambda: 2)
    per_rank = []
    for rank in (0, 1):
        monkeypatch.setattr(dist_util, "rank", lambda rank=rank: rank)
        per_rank.append([b["idx"].tolist() for b in trainer.get_train_dataloader()])
    order = trainer.get_train_dataloader().sampler.epoch_order()
    assert [b for pair in zip(*per_rank) for b in pair] == [order[i:i + 4] for i in range(0, 40, 4)]


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(Rows()[i] for i in range(12))


def test_an_iterable_dataset_is_trained_in_its_own_order_with_a_warning(make_args, caplog):
    seen = []
    with caplog.at_level(logging.WARNING, logger="kubetrain_trainer"):
        _trainer(make_args, seen, dataset=Stream(), max_steps=3, save_strategy="no").train()
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert "group_by_length is ignored: the training data has no length" in caplog.text


# ------------------------------------------------------------- HF 5.2's name: train_sampling_strategy
def test_train_sampling_strategy_group_by_length_is_the_same_option(make_args):
    args = TrainingArguments(train_sampling_strategy="group_by_length")
    assert args.group_by_length is True
    assert TrainingArguments(group_by_length=True).train_sampling_strategy == "group_by_length"
    by_name, by_flag = [], []
    _trainer(make_args, by_name, group_by_length=False, train_sampling_strategy="group_by_length",
             save_strategy="no", max_steps=10).train()
    _trainer(make_args, by_flag, save_strategy="no", max_steps=10).train()
    assert by_name == by_flag


def test_train_sampling_strategy_sequential_trains_the_rows_in_order(make_args):
    seen = []
    _trainer(make_args, seen, group_by_length=False, train_sampling_strategy="sequential", save_strategy="no",
             max_steps=12).train()
    assert seen == [list(range(i, i + 4)) for i in range(0, 40, 4)] + [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_train_sampling_strategy_sequential_gives_each_rank_runs_of_rows_as_hf(make_args, monkeypatch):
    # HF: a SequentialSampler that accelerate deals in whole batches (rank r: rows r*bs.., then (r+world)*bs..).
    # Dealt row by row instead, rank 0 trained rows 0, 2, 4, 6 and rank 1 rows 1, 3, 5, 7: a batch was never a
    # run of the data (consecutive pairs, pre-packed or pre-sorted batches split across ranks).
    trainer = _trainer(make_args, [], group_by_length=False, train_sampling_strategy="sequential")
    monkeypatch.setattr(dist_util, "world_size", lambda: 2)
    per_rank = []
    for rank in (0, 1):
        monkeypatch.setattr(dist_util, "rank", lambda rank=rank: rank)
        per_rank.append([b["idx"].tolist() for b in trainer.get_train_dataloader()])
    assert per_rank[0][:2] == [[0, 1, 2, 3], [8, 9, 10, 11]] and per_rank[1][:2] == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert sorted(sum(sum(per_rank, []), [])) == list(range(40))


def test_train_sampling_strategies_kubetrain_has_not_or_that_conflict_are_refused():
    with pytest.raises(ConfigError, match="train_sampling_strategy: 'batch_rebalance' is not one of 'random', "
                                          "'sequential', 'group_by_length'"):
        TrainingArguments(train_sampling_strategy="batch_rebalance")
    with pytest.raises(ConfigError, match="group_by_length and train_sampling_strategy 'sequential' are both set"):
        TrainingArguments(group_by_length=True, train_sampling_strategy="sequential")
