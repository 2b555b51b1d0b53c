"""When the loop logs, evaluates and saves, which checkpoint is the best, and what a run prints and reports.

The schedule (`DefaultFlowCallback`) is compared step by step with the
transformers Trainer on the same tiny model; the printed log dicts with HF's
`PrinterCallback`.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import types

import torch
from torch import nn
from transformers import Trainer as HFTrainer
from transformers import TrainerCallback as HFTrainerCallback
from transformers import TrainingArguments as HFTrainingArguments
from transformers.trainer_callback import PrinterCallback as HFPrinterCallback
from transformers.trainer_callback import TrainerState as HFTrainerState

from kubetrain_trainer import Trainer, TrainerControl, TrainerState, TrainingArguments
from kubetrain_trainer.callbacks import ProgressCallback
from kubetrain_trainer.models import SyntheticRegression, TinyMLP


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l = nn.Linear(4, 1)

    def forward(self, x, labels=None):
        out = self.l(x).squeeze(-1)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out}


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return [{"x": x[i], "labels": x[i].sum()} for i in range(n)]


class Events(HFTrainerCallback):
    """The steps at which a run logged its loss, evaluated and saved (an HF callback: it runs in both)."""

    def __init__(self):
        self.logs, self.evals, self.saves = [], [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.logs.append(state.global_step)

    def on_evaluate(self, args, state, control, **kwargs):
        self.evals.append(state.global_step)

    def on_save(self, args, state, control, **kwargs):
        self.saves.append(state.global_step)


def test_log_evaluate_and_save_steps_are_hfs(tmp_path):
    # 16 samples in batches of 8: 2 steps per epoch.
    cases = [  # (arguments, (loss logged, evaluated, saved) at these steps)
        # The last step (5) is evaluated and saved, though not a multiple of eval_steps / save_steps; not logged.
        (dict(max_steps=5, eval_strategy="steps", eval_steps=2, save_steps=2, logging_steps=2),
         ([2, 4], [2, 4, 5], [2, 4, 5])),
        # save_strategy "epoch": the last step is saved once, at the end of its epoch.
        (dict(num_train_epochs=2, eval_strategy="epoch", save_strategy="epoch", logging_strategy="epoch"),
         ([2, 4], [2, 4], [2, 4])),
        # Stopped by max_steps mid-epoch: the epoch ends there (the loop), so "epoch" strategies act at step 5.
        (dict(max_steps=5, eval_strategy="steps", eval_steps=2, save_strategy="epoch", logging_strategy="epoch"),
         ([2, 4, 5], [2, 4, 5], [2, 4, 5])),
    ]
    for i, (arguments, expected) in enumerate(cases):
        for name, trainer_class, args_class in (("hf", HFTrainer, HFTrainingArguments), ("kt", Trainer, TrainingArguments)):
            events = Events()
            args = args_class(output_dir=str(tmp_path / f"{name}{i}"), per_device_train_batch_size=8,
                              report_to="none", disable_tqdm=True, use_cpu=True, **arguments)
            trainer_class(model=Linear(), args=args, train_dataset=_data(16, 1), eval_dataset=_data(8, 2),
                          callbacks=[events]).train()
            assert (events.logs, events.evals, events.saves) == expected, (name, arguments)


class Scripted:
    def __init__(self, values):
        self.values = list(values)

    def __call__(self, prediction):
        return {"score": self.values.pop(0)}


class BestAtSave(HFTrainerCallback):
    def __init__(self):
        self.seen = {}

    def on_save(self, args, state, control, **kwargs):
        self.seen[state.global_step] = (state.best_global_step, state.best_model_checkpoint)


def test_best_model_checkpoint_names_only_the_checkpoint_of_the_best_evaluation(make_args, tmp_path):
    # Evaluations at steps 2 and 4, saves at 3 and 4. At step 3 the best is step 2's, which has no checkpoint:
    # checkpoint-3 was never evaluated, so no checkpoint is the best (as in HF); at step 4 it may be step 4's.
    for i, (scores, best_step) in enumerate((([1, 5], 2), ([5, 1], 4))):
        out = tmp_path / f"out{i}"
        best_checkpoint = str(out / "checkpoint-4") if best_step == 4 else None
        seen = BestAtSave()
        args = make_args(output_dir=str(out), max_steps=4, eval_strategy="steps", eval_steps=2, save_steps=3,
                         metric_for_best_model="score", greater_is_better=False)
        torch.manual_seed(0)
        trainer = Trainer(model=TinyMLP(), args=args, train_dataset=SyntheticRegression(32),
                          eval_dataset=SyntheticRegression(8, seed=1), compute_metrics=Scripted(scores), callbacks=[seen])
        trainer.train()
        assert seen.seen == {3: (2, None), 4: (best_step, best_checkpoint)}
        saved = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
        assert (saved["best_global_step"], saved["best_model_checkpoint"]) == (best_step, best_checkpoint)


def test_trainer_state_json_without_best_global_step_still_loads(tmp_path):
    path = tmp_path / "trainer_state.json"
    TrainerState(global_step=7, best_metric=0.5, best_global_step=6).save_to_json(path)
    assert TrainerState.load_from_json(path).best_global_step == 6
    old = json.loads(path.read_text())
    del old["best_global_step"]
    path.write_text(json.dumps(old))
    loaded = TrainerState.load_from_json(path)
    assert (loaded.global_step, loaded.best_metric, loaded.best_global_step) == (7, 0.5, None)


class Logged(HFTrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def _as_hf_prints(logs):
    """What HF's PrinterCallback prints for these log dicts."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for entry in logs:
            HFPrinterCallback().on_log(None, HFTrainerState(), None, logs=dict(entry))
    return printed.getvalue()


def test_each_log_dict_is_printed_as_hf_prints_it(make_args, capsys):
    for disable_tqdm in (True, False):  # PrinterCallback; the progress bar's tqdm.write
        logged = Logged()
        torch.manual_seed(0)
        trainer = Trainer(model=TinyMLP(), args=make_args(max_steps=3, save_strategy="no", disable_tqdm=disable_tqdm),
                          train_dataset=SyntheticRegression(16), eval_dataset=SyntheticRegression(8, seed=1),
                          callbacks=[logged])
        capsys.readouterr()
        trainer.train()
        printed = capsys.readouterr().out
        assert len(logged.logs) == 4  # the loss at steps 1-3 and the training summary
        assert printed == _as_hf_prints(logged.logs), disable_tqdm
        trainer.evaluate()
        # HF's progress bar prints only while training; its PrinterCallback prints an evaluate() after it too
        assert capsys.readouterr().out == (_as_hf_prints(logged.logs[-1:]) if disable_tqdm else "")


def test_nothing_is_printed_on_the_other_ranks(make_args, capsys):
    from kubetrain_trainer.callbacks import PrinterCallback

    args, control = make_args(), TrainerControl()
    replica = TrainerState(max_steps=3, is_world_process_zero=False, is_local_process_zero=False)
    PrinterCallback().on_log(args, replica, control, logs={"loss": 1.0})
    progress = ProgressCallback()
    progress.on_train_begin(args, replica, control)
    progress.on_log(args, replica, control, logs={"loss": 1.0})
    progress.on_train_end(args, replica, control)
    captured = capsys.readouterr()
    assert progress.bar is None and captured.out == "" and captured.err == ""


class FakeSummaryWriter:
    made: list["FakeSummaryWriter"] = []

    def __init__(self, log_dir):
        self.scalars, self.closed = [], False
        FakeSummaryWriter.made.append(self)

    def add_text(self, tag, text):
        pass

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_an_evaluate_after_train_is_reported(make_args, tmp_path, monkeypatch):
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    FakeSummaryWriter.made = []
    torch.manual_seed(0)
    trainer = Trainer(model=TinyMLP(), args=make_args(max_steps=2, save_strategy="no", report_to=["jsonl", "tensorboard"]),
                      train_dataset=SyntheticRegression(16), eval_dataset=SyntheticRegression(8, seed=1))
    trainer.train()
    trainer.evaluate()
    records = [json.loads(line) for line in (tmp_path / "out" / "runs" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 2, 2] and "train_runtime" in records[2] and "eval_loss" in records[3]
    during, after = FakeSummaryWriter.made  # closed at the end of training; a new event file for the evaluation
    assert during.closed and ("train/loss", 2) in during.scalars
    assert ("eval/loss", 2) in after.scalars
