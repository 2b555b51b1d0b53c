"""The workers' progress report to their launcher (progress.py): rules, kubetrain's Trainer, HF's Trainer callback.

The rules run against an injected clock (no waiting); the Trainer runs for real
(a few steps of the built-in tasks on CPU) and the HF side uses transformers'
own TrainingArguments and TrainerState.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kubetrain_trainer.builtin import run
from kubetrain_trainer.progress import (PROGRESS_FILE_ENV, NullTracker, ProgressTracker, WorkerProgress,
                                        progress_callbacks)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _read(path: Path) -> WorkerProgress:
    return WorkerProgress.from_file(path.read_text())


def test_writes_at_most_once_a_second_but_at_once_after_a_save_and_at_the_end(tmp_path: Path):
    clock, path = Clock(), tmp_path / "progress.json"
    tracker = ProgressTracker(path, clock=clock)
    tracker.train_begin(step=0, max_steps=1000)
    assert tracker.writes == 1 and _read(path).max_steps == 1000
    for step in range(1, 81):  # 80 steps of 1/16 s: 5 s
        tracker.step_begin()
        clock.now += 0.0625
        tracker.step_end(step=step, max_steps=1000, epoch=None, samples_per_step=16)
    assert tracker.writes == 1 + 5
    assert _read(path).step == 80
    tracker.step_begin()
    clock.now += 0.0625
    tracker.step_end(step=81, max_steps=1000, epoch=None, samples_per_step=16)
    assert _read(path).step == 80  # not due yet
    tracker.saved(81)
    assert _read(path).step == 81 and tracker.writes == 7
    tracker.train_end()
    assert tracker.writes == 8
    report = _read(path)
    assert report.step_seconds.count == 81 and report.samples_per_second == pytest.approx(16 / 0.0625)
    assert report.eta_seconds == pytest.approx((1000 - 81) * 0.0625)


def test_a_save_is_timed_from_the_trainers_last_event_not_from_the_step(tmp_path: Path):
    clock, path = Clock(), tmp_path / "progress.json"
    tracker = ProgressTracker(path, clock=clock)
    tracker.train_begin(step=0, max_steps=10)
    tracker.step_begin()
    clock.now += 1.0
    tracker.step_end(step=1, max_steps=10, epoch=None, samples_per_step=4)
    clock.now += 30.0  # an evaluation ...
    tracker.event()  # ... ends (on_evaluate), then the save starts
    clock.now += 2.5
    tracker.saved(1)
    report = _read(path)
    assert report.saves == ((1, 2.5),) and report.save_seconds_of(1) == 2.5 and report.save_seconds.total == 2.5
    assert report.save_seconds_of(2) is None


def test_outside_the_launcher_nothing_is_written(tmp_path: Path, monkeypatch):
    monkeypatch.delenv(PROGRESS_FILE_ENV, raising=False)
    assert isinstance(ProgressTracker.from_env(), NullTracker)
    assert progress_callbacks() == []
    ProgressTracker.from_env().step_end(step=1, max_steps=1, epoch=None, samples_per_step=1)  # a no-op, no error


def test_an_unwritable_progress_file_warns_once_and_training_goes_on(tmp_path: Path, caplog):
    tracker = ProgressTracker(tmp_path / "missing-folder" / "progress.json", min_interval_s=0.0)
    with caplog.at_level(logging.WARNING, logger="kubetrain_trainer.progress"):
        tracker.train_begin(step=0, max_steps=3)
        for step in (1, 2, 3):
            tracker.step_end(step=step, max_steps=3, epoch=None, samples_per_step=1)
        tracker.train_end()
    assert len([r for r in caplog.records if "cannot write the progress file" in r.getMessage()]) == 1


def test_kubetrains_trainer_reports_through_the_launchers_file(tmp_path: Path, monkeypatch):
    path = tmp_path / "progress.json"
    monkeypatch.setenv(PROGRESS_FILE_ENV, str(path))
    args = {"report_to": ["none"], "disable_tqdm": True, "logging_steps": 2, "output_dir": str(tmp_path / "out"),
            "max_steps": 6, "save_steps": 3, "per_device_train_batch_size": 4, "vocab_size": 32, "seq_len": 8,
            "d_model": 16, "n_layers": 1, "n_heads": 2, "num_samples": 64, "eval_samples": 8}
    env = {"KUBETRAIN_BUILTIN_TASK": "causal-lm", "KUBETRAIN_TRAINER_ARGS": json.dumps(args)}
    assert run(env, []) == 0
    report = _read(path)
    assert report.step == 6 and report.max_steps == 6 and report.epoch is not None
    assert report.loss is not None and report.learning_rate is not None
    assert report.samples_per_second > 0
    assert report.tokens_per_second == pytest.approx(report.samples_per_second * 8)  # causal-lm: seq_len tokens
    assert report.step_seconds.count == 6
    assert [step for step, _seconds in report.saves] == [3, 6]


def test_kubetrains_trainer_reports_the_tokens_it_counts(tmp_path: Path, monkeypatch, tiny_gpt, make_args):
    """With include_num_input_tokens_seen the job's progress has the tokens per second of the counted tokens (as
    for an HF Trainer), not none for a model without a built-in task's declared sample length."""
    import torch

    from kubetrain_trainer import Trainer

    path = tmp_path / "progress.json"
    monkeypatch.setenv(PROGRESS_FILE_ENV, str(path))
    rows = [{"input_ids": torch.arange(8) % 32, "labels": torch.arange(8) % 32} for _ in range(32)]
    args = make_args(include_num_input_tokens_seen=True, save_strategy="no", max_steps=6)
    Trainer(model=tiny_gpt(), args=args, train_dataset=rows).train()
    report = _read(path)
    assert report.tokens_per_second == pytest.approx(report.samples_per_second * 8, rel=1e-6)


def test_the_hf_callback_reports_from_transformers_own_state(tmp_path: Path, monkeypatch):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from kubetrain_trainer.hf import KubetrainCheckpointCallback

    path = tmp_path / "progress.json"
    monkeypatch.setenv(PROGRESS_FILE_ENV, str(path))
    callback = KubetrainCheckpointCallback()
    clock = Clock()
    callback.progress.clock = clock
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8,
                             gradient_accumulation_steps=2, use_cpu=True, report_to="none")
    state, control = TrainerState(max_steps=20, train_batch_size=8, num_input_tokens_seen=0), TrainerControl()

    class Scheduler:
        def get_last_lr(self):
            return [5e-5]

    callback.on_train_begin(args, state, control)
    for step in range(1, 11):
        callback.on_step_begin(args, state, control)
        clock.now += 0.5
        state.global_step, state.epoch, state.num_input_tokens_seen = step, step / 10, step * 1000
        callback.on_step_end(args, state, control, lr_scheduler=Scheduler())
    callback.on_log(args, state, control, logs={"loss": 0.75, "learning_rate": 5e-5})
    (tmp_path / "out" / "checkpoint-10").mkdir(parents=True)
    clock.now += 4.0
    callback.on_save(args, state, control)
    report = _read(path)
    assert report.step == 10 and report.max_steps == 20 and report.epoch == 1.0 and report.loss == 0.75
    assert report.learning_rate == 5e-5
    assert report.samples_per_second == pytest.approx(8 * 2 / 0.5)  # global batch: 8 x 2 accumulation x 1 process
    assert report.tokens_per_second == pytest.approx(1000 / 0.5)  # HF counted them
    assert report.saves == ((10, 4.0),)
    assert any(p.name.startswith(".kubetrain-ready") for p in (tmp_path / "out" / "checkpoint-10").iterdir())


def test_a_run_that_promises_its_end_reports_it(tmp_path: Path):
    """The launcher tells a training run that crashed under a shell (`python train.py; echo done` exits 0) from one
    that finished by this: kubetrain's callbacks promise `train_end`, a custom loop that does not stays unjudged."""
    path = tmp_path / "progress.json"
    tracker = ProgressTracker(path)
    tracker.train_begin(step=0, max_steps=10, reports_end=True)
    assert _read(path).run == "training"
    tracker.train_end()
    assert _read(path).run == "finished"
    tracker.train_begin(step=10, max_steps=20, reports_end=True)
    tracker.train_end(preempted=True)
    assert _read(path).run == "preempted"
    plain = ProgressTracker(tmp_path / "plain.json")
    plain.train_begin(step=0, max_steps=10)
    assert _read(tmp_path / "plain.json").run is None


def test_a_run_end_that_cannot_be_written_leaves_no_stale_training_report(tmp_path: Path, monkeypatch):
    path = tmp_path / "progress.json"
    tracker = ProgressTracker(path)
    tracker.train_begin(step=0, max_steps=10, reports_end=True)
    monkeypatch.setattr(Path, "write_text", lambda self, text: (_ for _ in ()).throw(OSError(28, "full")))
    tracker.train_end()
    assert not path.exists()


def test_kubetrains_trainer_and_the_hf_callback_report_the_end_of_their_run(tmp_path: Path, monkeypatch):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from kubetrain_trainer.hf import KubetrainCheckpointCallback
    from kubetrain_trainer.progress import TrainProgressCallback

    path = tmp_path / "progress.json"
    monkeypatch.setenv(PROGRESS_FILE_ENV, str(path))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none")
    state, control = TrainerState(max_steps=20, train_batch_size=8), TrainerControl()
    for callback in (KubetrainCheckpointCallback(), TrainProgressCallback()):
        callback.on_train_begin(args, state, control)
        assert _read(path).run == "training"
        callback.on_train_end(args, state, control)
        assert _read(path).run == "finished"
    callback.on_train_begin(args, state, control)
    callback.on_train_end(args, state, control, preempted=True)  # kubetrain's Trainer after its emergency save
    assert _read(path).run == "preempted"
