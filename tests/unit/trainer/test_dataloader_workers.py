"""`dataloader_persistent_workers` and `dataloader_prefetch_factor`, as HF 5 takes them.

Before, both were unknown arguments: an HF script passing them failed at once (ConfigError, exit 82). They reach
the train, eval and test loaders when there are worker processes; without any they are refused by name (HF refuses
the prefetch factor itself, torch's DataLoader persistent workers when HF builds the loader). Persistent eval
workers are kept for the next evaluation (a loader per eval set), as HF keeps them.
"""

from __future__ import annotations

import pytest
import torch

from kubetrain_trainer import ConfigError, Trainer, TrainingArguments
from kubetrain_trainer.models import SyntheticRegression, TinyMLP
from kubetrain_recorder import Recorder


def _trainer(make_args, **kw):
    args = make_args(**{"save_strategy": "no", "max_steps": 4, "per_device_eval_batch_size": 4, **kw})
    return Trainer(model=TinyMLP(), args=args, train_dataset=SyntheticRegression(16),
                   eval_dataset=SyntheticRegression(8, seed=1))


def test_the_arguments_are_hf_s_and_coerced_from_strings():
    args = TrainingArguments.from_dict({"dataloader_num_workers": "2", "dataloader_persistent_workers": "true",
                                        "dataloader_prefetch_factor": "4"})
    assert args.dataloader_persistent_workers is True and args.dataloader_prefetch_factor == 4
    default = TrainingArguments()
    assert default.dataloader_persistent_workers is False and default.dataloader_prefetch_factor is None  # HF's


@pytest.mark.parametrize("setting", [{"dataloader_prefetch_factor": 2}, {"dataloader_persistent_workers": True}])
def test_without_workers_each_is_refused_by_name(setting):
    (name,) = setting
    with pytest.raises(ConfigError, match=f"{name} needs worker processes: set dataloader_num_workers > 0"):
        TrainingArguments(**setting)


def test_a_prefetch_factor_below_one_is_refused():
    with pytest.raises(ConfigError, match="dataloader_prefetch_factor must be >= 1, got 0"):
        TrainingArguments(dataloader_num_workers=1, dataloader_prefetch_factor=0)


def test_they_reach_the_train_eval_and_test_loaders(make_args):
    trainer = _trainer(make_args, dataloader_num_workers=2, dataloader_persistent_workers=True,
                       dataloader_prefetch_factor=5)
    for loader in (trainer.get_train_dataloader(), trainer.get_eval_dataloader(),
                   trainer.get_test_dataloader(SyntheticRegression(4))):
        assert loader.persistent_workers is True and loader.prefetch_factor == 5
    plain = _trainer(make_args, dataloader_num_workers=2).get_train_dataloader()
    assert plain.persistent_workers is False and plain.prefetch_factor == 2  # torch's default, as before


def test_persistent_eval_workers_are_kept_for_the_next_evaluation_per_set(make_args):
    trainer = _trainer(make_args, dataloader_num_workers=1, dataloader_persistent_workers=True)
    first = trainer.get_eval_dataloader()
    assert trainer.get_eval_dataloader() is first
    other = SyntheticRegression(4, seed=2)
    assert trainer.get_eval_dataloader(other).dataset is other  # another set is evaluated, not the kept one's
    without = _trainer(make_args, dataloader_num_workers=1)
    assert without.get_eval_dataloader() is not without.get_eval_dataloader()


def test_training_and_evaluating_twice_with_persistent_workers_gives_the_in_process_results(make_args):
    def run(**kw):
        torch.manual_seed(0)
        trainer = _trainer(make_args, num_train_epochs=2, max_steps=-1, per_device_train_batch_size=8, **kw)
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        return losses, trainer.evaluate()["eval_loss"], trainer.evaluate()["eval_loss"]

    workers = run(dataloader_num_workers=1, dataloader_persistent_workers=True, dataloader_prefetch_factor=1)
    assert workers == run()


class _EpochStream(torch.utils.data.IterableDataset):
    """Rows {"x": 1000 * epoch + i}: a stream whose order depends on the epoch it was told (a shuffle buffer)."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter([{"x": torch.tensor(float(1000 * self.epoch + i))} for i in range(self.n)])


@pytest.mark.parametrize("persistent", [False, True])
def test_kept_workers_read_each_epoch_of_a_stream_as_it_was_told(make_args, persistent):
    """Before, with dataloader_persistent_workers the workers' copies of a stream were made at the first epoch and
    `set_epoch` reached only the main process's: every epoch replayed the first's order (0..3 three times)."""
    model = Recorder()
    args = make_args(per_device_train_batch_size=2, max_steps=6, save_strategy="no", dataloader_num_workers=1,
                     dataloader_persistent_workers=persistent)
    Trainer(model=model, args=args, train_dataset=_EpochStream(4)).train()
    assert model.seen == [0, 1, 2, 3, 1000, 1001, 1002, 1003, 2000, 2001, 2002, 2003]
