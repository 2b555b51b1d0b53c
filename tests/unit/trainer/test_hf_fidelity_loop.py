"""The loop as the HF Trainer 5.x runs it: the logged learning rate, epoch ends, the default collator, metrics.

Each test pins one behaviour an HF user relies on and kubetrain once differed in:

- `learning_rate` in the logs is the rate the step just taken used (read before the scheduler steps);
- every epoch ends with `on_epoch_end` and the epoch-end log/evaluate/save, also when `max_steps` or a
  callback stops it mid-epoch; `control.should_epoch_stop` ends the epoch (the next one starts) and
  `num_train_epochs` bounds the epochs; a stop and resume is still bitwise the straight run;
- `on_epoch_begin` fires when a run resumes mid-epoch;
- without a `data_collator`, rows are collated by HF's `default_data_collator` rules;
- `compute_metrics` may return lists (kept, numpy numbers made plain) and a dict `eval_dataset` is refused
  when the Trainer is built.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, default_collate

from kubetrain_trainer import Trainer, TrainerCallback
from kubetrain_trainer.args import ConfigError
from kubetrain_trainer.checkpoint import list_checkpoints
from kubetrain_trainer.data import default_data_collator
from kubetrain_trainer.state import TrainerState


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l = nn.Linear(4, 1)

    def forward(self, x, labels=None):
        out = self.l(x).squeeze(-1)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


def rows(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return [{"x": x[i], "labels": x[i].sum()} for i in range(n)]


class Events(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.events.append(("begin", state.global_step))

    def on_epoch_end(self, args, state, control, **kwargs):
        self.events.append(("end", state.global_step))


class StopEpochAfter(TrainerCallback):
    """Ends each epoch after its `n`-th batch (from the state, so a resumed run decides alike)."""

    def __init__(self, n, batch):
        self.samples = n * batch

    def on_step_end(self, args, state, control, **kwargs):
        if state.data_position.samples == self.samples:
            control.should_epoch_stop = True


# ----------------------------------------------------------------------------- learning rate
def test_logged_learning_rate_is_the_rate_the_step_used(make_args):
    # linear, warmup 2 of 4 steps: the steps use 0.1 x (0, 0.5, 1, 0.5); the rates after them are one ahead.
    trainer = Trainer(model=Linear(), args=make_args(max_steps=4, warmup_steps=2, learning_rate=0.1,
                                                     save_strategy="no"), train_dataset=rows(16))
    trainer.train()
    assert [e["learning_rate"] for e in trainer.state.log_history if "loss" in e] == \
        pytest.approx([0.0, 0.05, 0.1, 0.05])


def test_epoch_end_log_carries_the_last_steps_rate_and_grad_norm(make_args):
    trainer = Trainer(model=Linear(), args=make_args(num_train_epochs=2, max_steps=-1, learning_rate=0.1,
                                                     logging_strategy="epoch", save_strategy="no"),
                      train_dataset=rows(16))
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    # 4 steps per epoch, linear decay from 0.1 over 8: the epochs' last steps used 0.1 x 5/8 and 0.1 x 1/8.
    assert [(e["step"], e["learning_rate"]) for e in logs] == [(4, pytest.approx(0.0625)), (8, pytest.approx(0.0125))]
    assert all("grad_norm" in e for e in logs)


# ----------------------------------------------------------------------------- epoch ends
def test_should_epoch_stop_ends_the_epoch_and_the_next_starts(make_args):
    events, seen = Events(), []

    class Spy(TrainerCallback):
        def on_epoch_end(self, args, state, control, **kwargs):
            seen.append((state.data_position.epoch, state.data_position.samples))

    trainer = Trainer(model=Linear(), args=make_args(num_train_epochs=3, max_steps=-1, per_device_train_batch_size=2,
                                                     save_strategy="no"),
                      train_dataset=rows(16), callbacks=[StopEpochAfter(2, 2), events, Spy()])
    out = trainer.train()
    # HF: 3 epochs of 2 steps each (not 24 steps re-entering epoch 0), each ended by on_epoch_end.
    assert out.global_step == 6
    assert events.events == [("begin", 0), ("end", 2), ("begin", 2), ("end", 4), ("begin", 4), ("end", 6)]
    assert seen == [(1, 0), (2, 0), (3, 0)]  # the next batch is the next epoch's first


class StopEpochOnLog(TrainerCallback):
    """Ends the epoch from on_log (not on_step_end), at its `n`-th batch: the checkpoint saved at that step
    must already say that the next batch is the next epoch's first."""

    def __init__(self, n, batch):
        self.samples = n * batch

    def on_log(self, args, state, control, **kwargs):
        if state.data_position.samples == self.samples:
            control.should_epoch_stop = True


def test_an_epoch_stop_set_in_on_log_is_in_the_checkpoint_of_that_step(tiny_gpt, tokens, make_args, tmp_path):
    def run(out, seed=0):
        args = make_args(output_dir=str(out), num_train_epochs=2, max_steps=-1, per_device_train_batch_size=2,
                         save_steps=2, logging_steps=2)
        return Trainer(model=tiny_gpt(seed), args=args, train_dataset=tokens(16), callbacks=[StopEpochOnLog(2, 2)])

    straight = run(tmp_path / "a")
    straight.train()
    assert straight.state.global_step == 4
    state = TrainerState.load_from_json(tmp_path / "a" / "checkpoint-2" / "trainer_state.json")
    assert (state.data_position.epoch, state.data_position.samples) == (1, 0)
    resumed = run(tmp_path / "b", seed=5)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    for k, v in straight.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k


def test_epoch_stop_resume_is_bitwise_the_straight_run(tiny_gpt, tokens, make_args, tmp_path):
    def run(out, **kw):
        args = make_args(output_dir=str(out), num_train_epochs=3, max_steps=-1, per_device_train_batch_size=2,
                         save_steps=1)
        return Trainer(model=tiny_gpt(kw.pop("seed", 0)), args=args, train_dataset=tokens(16),
                       callbacks=[StopEpochAfter(3, 2)])

    straight = run(tmp_path / "a")
    straight.train()
    assert straight.state.global_step == 9
    state = TrainerState.load_from_json(tmp_path / "a" / "checkpoint-3" / "trainer_state.json")
    assert (state.data_position.epoch, state.data_position.samples) == (1, 0)  # saved after the epoch stop

    first = run(tmp_path / "b")
    first.train()
    resumed = run(tmp_path / "b", seed=5)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-4"))  # mid-epoch 1
    assert resumed.state.global_step == 9
    for k, v in straight.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k
    losses = [(e["step"], e["loss"], e["learning_rate"]) for e in straight.state.log_history if "loss" in e]
    assert losses == [(e["step"], e["loss"], e["learning_rate"]) for e in resumed.state.log_history if "loss" in e]


def test_max_steps_mid_epoch_ends_the_epoch_with_its_log_and_evaluation(make_args):
    events = Events()
    trainer = Trainer(model=Linear(), args=make_args(max_steps=3, eval_strategy="epoch", logging_strategy="epoch",
                                                     save_strategy="no"),
                      train_dataset=rows(16), eval_dataset=rows(8, seed=2), callbacks=[events])
    trainer.train()
    assert events.events == [("begin", 0), ("end", 3)]
    assert [e["step"] for e in trainer.state.log_history if "eval_loss" in e] == [3]
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [3]
    # A later run with more steps goes on in the same epoch: the position is where the next batch is.
    assert (trainer.state.data_position.epoch, trainer.state.data_position.samples) == (0, 12)


def test_on_epoch_begin_fires_when_resuming_mid_epoch(tiny_gpt, tokens, make_args, tmp_path):
    args = make_args(output_dir=str(tmp_path / "o"), max_steps=6, save_steps=3)  # 30 samples / 4: 8 steps an epoch
    Trainer(model=tiny_gpt(0), args=args, train_dataset=tokens()).train()
    events = Events()
    Trainer(model=tiny_gpt(0), args=args, train_dataset=tokens(), callbacks=[events]).train(
        resume_from_checkpoint=str(tmp_path / "o" / "checkpoint-3"))
    assert events.events == [("begin", 3), ("end", 6)]


def test_an_iterable_without_data_stops_instead_of_looping(make_args):
    class Empty(IterableDataset):
        def __iter__(self):
            return iter(())

    class Guard(TrainerCallback):
        ends = 0

        def on_epoch_end(self, args, state, control, **kwargs):
            Guard.ends += 1
            assert Guard.ends < 5, "empty epochs loop forever"

    out = Trainer(model=Linear(), args=make_args(max_steps=3, save_strategy="no"), train_dataset=Empty(),
                  callbacks=[Guard()]).train()
    assert out.global_step == 0 and Guard.ends == 1


# ----------------------------------------------------------------------------- default collator
def test_default_collator_follows_hf_default_data_collator():
    batch = default_data_collator([{"x": [float(i), 1.0], "label": i, "n": i, "text": f"s{i}", "none": None,
                                    "a": np.array([i, 2], dtype=np.int32)} for i in range(3)])
    assert set(batch) == {"x", "labels", "n", "a"}  # label -> labels; strings and None dropped
    assert batch["labels"].dtype == torch.long and batch["labels"].tolist() == [0, 1, 2]
    assert batch["x"].dtype == torch.float32 and batch["x"].shape == (3, 2)
    assert batch["a"].dtype == torch.int32 and batch["a"][:, 0].tolist() == [0, 1, 2]
    floats = default_data_collator([{"x": torch.ones(2), "label": torch.tensor(0.5)} for _ in range(2)])
    assert floats["labels"].dtype == torch.float32 and floats["x"].shape == (2, 2)
    ids = default_data_collator([{"label_ids": [i, i + 1]} for i in range(2)])
    assert ids["labels"].tolist() == [[0, 1], [1, 2]] and ids["labels"].dtype == torch.long


def test_default_collator_keeps_tensor_rows_tuples_and_tensors_as_torch_collates_them():
    data = rows(4)
    got, want = default_data_collator(data), default_collate(data)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in got)
    pairs = [(torch.ones(2) * i, i) for i in range(3)]
    got, want = default_data_collator(pairs), default_collate(pairs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(default_data_collator([torch.ones(2)] * 2), torch.ones(2, 2))


@pytest.mark.parametrize("variant", ["lists", "label", "text"])
def test_training_on_rows_of_python_values_without_a_collator(make_args, variant):
    class Rows(torch.utils.data.Dataset):  # as HF `datasets` yields them
        def __len__(self):
            return 8

        def __getitem__(self, i):
            row = {"x": [float(i), 1.0, 2.0, 3.0], ("label" if variant == "label" else "labels"): float(i)}
            if variant == "text":
                row["text"] = f"sample {i}"
            return row

    trainer = Trainer(model=Linear(), args=make_args(max_steps=2, save_strategy="no"), train_dataset=Rows())
    assert trainer.train().global_step == 2
    assert trainer.data_collator is default_data_collator  # HF: the default is the Trainer's data_collator


# ----------------------------------------------------------------------------- metrics and eval sets
def test_compute_metrics_may_return_lists_and_numpy_numbers(make_args):
    trainer = Trainer(model=Linear(), args=make_args(max_steps=1, save_strategy="no"), train_dataset=rows(8),
                      eval_dataset=rows(8, seed=2),
                      compute_metrics=lambda p: {"acc": np.float32(0.5), "per_class": [np.float64(0.5), 0.7], "n": 3})
    metrics = trainer.evaluate()
    assert metrics["eval_per_class"] == [0.5, 0.7] and type(metrics["eval_per_class"][0]) is float
    assert metrics["eval_acc"] == 0.5 and type(metrics["eval_acc"]) is float
    assert metrics["eval_n"] == 3


def test_a_dict_eval_dataset_is_refused_when_the_trainer_is_built(make_args):
    with pytest.raises(ConfigError, match="eval_dataset"):
        Trainer(model=Linear(), args=make_args(max_steps=1, eval_strategy="steps", eval_steps=1),
                train_dataset=rows(8), eval_dataset={"a": rows(4), "b": rows(4, seed=3)})
    trainer = Trainer(model=Linear(), args=make_args(max_steps=1), train_dataset=rows(8))
    with pytest.raises(ConfigError, match="eval_dataset"):
        trainer.evaluate({"a": rows(4)})


def test_save_strategy_epoch_with_max_steps_mid_epoch_saves_the_last_step(make_args, tmp_path):
    # As HF, whose epoch end saves it (a guard: kubetrain's own rule at max_steps saves it as well).
    trainer = Trainer(model=Linear(), args=make_args(output_dir=str(tmp_path / "c"), max_steps=6,
                                                     save_strategy="epoch"), train_dataset=rows(16))
    trainer.train()
    assert [s for s, _ in list_checkpoints(tmp_path / "c")] == [4, 6]
