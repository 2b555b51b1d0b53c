"""The loop as the HF Trainer 5.x runs it: the logged learning rate, epoch ends, the default collator, metrics.

Each test pins one behaviour an HF user relies on and kubetrain once differed in:

- `learning_rate` in the logs is the rate the step just taken used (read before the scheduler steps);
- every epoch ends with `on_epoch_end` and the epoch-end log/evaluate/save, also when `max_steps` or a
  callback stops it mid-epoch; `control.should_epoch_stop` ends the epoch (the next one starts) and
  `num_train_epochs` bounds the epochs; a stop and resume is still bitwise the straight run;
- `on_epoch_begin` fires when a run resumes mid-epoch;
- without a `data_collator`, rows are collated by HF's `default_data_collator` rules (and multi-label
  tensor rows, numpy labels and empty `label_ids`, where HF's fail, keep working as torch collated them);
- `compute_metrics` values are made JSON-able as HF's `denumpify_detensorize` makes them (numpy arrays and
  tensors become lists), so trainer_state.json is still written;
- a dict `eval_dataset` is evaluated set by set under `eval_<name>_`, as in HF 5.x, in the loop too
  (`metric_for_best_model` names one set's metric; one that names none is refused when the Trainer is built).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, default_collate

from kubetrain_trainer import Trainer, TrainerCallback
from kubetrain_trainer.args import ConfigError
from kubetrain_trainer.checkpoint import list_checkpoints
from kubetrain_trainer.data import default_data_collator
from kubetrain_trainer.evaluation import plain_metrics
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


def test_default_collator_stacks_tensor_labels_and_keeps_numpy_label_dtypes():
    multi = default_data_collator([{"x": torch.ones(2) * i, "label": torch.tensor([0.0, 1.0, float(i)])}
                                   for i in range(3)])  # a multi-label row: HF's `.item()` fails on it
    assert multi["labels"].dtype == torch.float32 and multi["labels"].tolist() == [[0, 1, 0], [0, 1, 1], [0, 1, 2]]
    assert multi["x"].shape == (3, 2)
    ints = default_data_collator([{"x": torch.ones(2), "label": torch.tensor([i, 1], dtype=torch.int32)}
                                  for i in range(2)])
    assert ints["labels"].dtype == torch.int32 and ints["labels"].tolist() == [[0, 1], [1, 1]]
    for label, dtype in ((np.int64(3), torch.int64), (np.int32(3), torch.int32), (np.float64(0.5), torch.float32),
                         (np.array([1, 0], dtype=np.int64), torch.int64)):
        batch = default_data_collator([{"x": [1.0, 2.0], "label": label}] * 2)
        assert batch["labels"].dtype == dtype and batch["labels"].shape == (2, *np.shape(label)), label
    ids = default_data_collator([{"x": [1.0], "label_ids": np.array([i, 2], dtype=np.int32)} for i in range(2)])
    assert ids["labels"].dtype == torch.int32 and ids["labels"].tolist() == [[0, 2], [1, 2]]
    numpy_ints = default_data_collator([{"x": [1.0], "label_ids": [np.int64(i)]} for i in range(2)])
    assert numpy_ints["labels"].dtype == torch.long
    empty = default_data_collator([{"x": [1.0], "label_ids": []} for _ in range(2)])  # HF: IndexError
    assert empty["labels"].dtype == torch.long and empty["labels"].shape == (2, 0)
    # HF's rules stay where they hold: Python int long, Python float (and a list under `label`) float32,
    # a 0-dim tensor by its value (an int32 one long).
    assert default_data_collator([{"label": 1}] * 2)["labels"].dtype == torch.long
    assert default_data_collator([{"label": 1.0}] * 2)["labels"].dtype == torch.float32
    assert default_data_collator([{"label": [0, 1]}] * 2)["labels"].dtype == torch.float32
    assert default_data_collator([{"label": torch.tensor(1, dtype=torch.int32)}] * 2)["labels"].dtype == torch.long


def test_training_on_multi_label_tensor_rows_without_a_collator(make_args):
    class MultiLabel(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.l = nn.Linear(4, 3)

        def forward(self, x, labels=None):
            logits = self.l(x)
            return {"loss": nn.functional.binary_cross_entropy_with_logits(logits, labels), "logits": logits}

    data = [{"x": r["x"], "label": (r["x"][:3] > 0).float()} for r in rows(8)]
    trainer = Trainer(model=MultiLabel(), args=make_args(max_steps=2, save_strategy="no"), train_dataset=data)
    assert trainer.train().global_step == 2


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


def test_compute_metrics_arrays_and_tensors_become_lists_and_the_state_is_still_written(make_args, tmp_path):
    assert plain_metrics({"a": (np.array([0.5]), torch.tensor([1.0, 2.0])), "b": [torch.tensor([3]), np.bool_(True)],
                          "m": np.array([[1, 2]], dtype=np.int64)}) == \
        {"a": ([0.5], [1.0, 2.0]), "b": [3, True], "m": [[1, 2]]}
    out = tmp_path / "state"
    trainer = Trainer(model=Linear(), args=make_args(output_dir=str(out), max_steps=1, save_strategy="no"),
                      train_dataset=rows(8), eval_dataset=rows(8, seed=2),
                      compute_metrics=lambda p: {"f1": np.array([0.5]), "per_class": np.array([0.25, 0.75]),
                                                 "t": torch.tensor([1.0, 2.0]), "one": torch.tensor([3.0])})
    metrics = trainer.evaluate()
    assert (metrics["eval_f1"], metrics["eval_per_class"], metrics["eval_t"], metrics["eval_one"]) == \
        ([0.5], [0.25, 0.75], [1.0, 2.0], 3.0)
    trainer.save_state()  # json.dumps of the log history: an ndarray left in it raised TypeError
    saved = json.loads((out / "trainer_state.json").read_text())
    assert [e["eval_per_class"] for e in saved["log_history"] if "eval_per_class" in e] == [[0.25, 0.75]]


def test_a_dict_eval_dataset_is_evaluated_set_by_set_as_in_hf(make_args, tmp_path):
    sets = {"a": rows(4, seed=2), "b": rows(6, seed=3)}
    seen = []

    class Seen(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            seen.append((state.global_step, sorted(k for k in metrics if k.endswith("_loss"))))

    args = make_args(output_dir=str(tmp_path / "o"), max_steps=2, eval_strategy="steps", eval_steps=1,
                     save_steps=1, load_best_model_at_end=True, metric_for_best_model="b_loss")
    trainer = Trainer(model=Linear(), args=args, train_dataset=rows(8), eval_dataset=sets, callbacks=[Seen()])
    trainer.train()
    # The loop's evaluations: each set on its own (logged, on_evaluate), ranked by the named set's loss.
    assert seen == [(1, ["eval_a_loss"]), (1, ["eval_b_loss"]), (2, ["eval_a_loss"]), (2, ["eval_b_loss"])]
    b_losses = [e["eval_b_loss"] for e in trainer.state.log_history if "eval_b_loss" in e]
    assert len(b_losses) == 2 and trainer.state.best_metric == min(b_losses)
    merged = trainer.evaluate()
    assert {"eval_a_loss", "eval_a_runtime", "eval_b_loss", "eval_b_samples_per_second"} <= set(merged)
    assert "eval_loss" not in merged
    one = trainer.evaluate("a")  # HF: a name picks the Trainer's set, under the plain prefix
    assert one["eval_loss"] == pytest.approx(merged["eval_a_loss"]) and "eval_b_loss" not in one
    assert trainer.get_eval_dataloader("b").dataset is sets["b"]
    given = trainer.evaluate({"x": rows(4, seed=2)}, metric_key_prefix="test")  # a dict passed in: by its names
    assert given["test_x_loss"] == pytest.approx(merged["eval_a_loss"])
    with pytest.raises(KeyError, match="'c'"):
        trainer.evaluate("c")
    with pytest.raises(ValueError, match="name one of its sets"):
        trainer.get_eval_dataloader()


def test_a_dict_eval_dataset_refuses_a_metric_none_of_its_sets_has(make_args, tmp_path):
    args = make_args(output_dir=str(tmp_path / "o"), max_steps=2, eval_strategy="steps", eval_steps=1,
                     save_steps=1, load_best_model_at_end=True)  # metric_for_best_model: "loss", i.e. eval_loss
    with pytest.raises(ConfigError, match="'eval_a_loss'"):
        Trainer(model=Linear(), args=args, train_dataset=rows(8), eval_dataset={"a": rows(4), "b": rows(4, seed=3)})
    with pytest.raises(ConfigError, match="empty dict"):
        Trainer(model=Linear(), args=args, train_dataset=rows(8), eval_dataset={})
    with pytest.raises(ConfigError, match="names"):
        Trainer(model=Linear(), args=make_args(max_steps=1), train_dataset=rows(8), eval_dataset={0: rows(4)})

    class OwnMetrics(Trainer):  # an evaluate() of one's own may return eval_loss: not refused
        def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
            metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
            return {**metrics, "eval_loss": sum(v for k, v in metrics.items() if k.endswith("_loss"))}

    trainer = OwnMetrics(model=Linear(), args=args, train_dataset=rows(8), eval_dataset={"a": rows(4)})
    trainer.train()
    assert trainer.state.best_metric is not None


def test_save_strategy_epoch_with_max_steps_mid_epoch_saves_the_last_step(make_args, tmp_path):
    # As HF, whose epoch end saves it (a guard: kubetrain's own rule at max_steps saves it as well).
    trainer = Trainer(model=Linear(), args=make_args(output_dir=str(tmp_path / "c"), max_steps=6,
                                                     save_strategy="epoch"), train_dataset=rows(16))
    trainer.train()
    assert [s for s, _ in list_checkpoints(tmp_path / "c")] == [4, 6]
