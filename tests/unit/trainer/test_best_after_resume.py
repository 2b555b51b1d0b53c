"""`load_best_model_at_end` after a resume on a new pod: the restore put only the newest checkpoint on local
disk, unless the launcher also fetched the best one (`restore.fetch_best`). With it, the best is loaded; without
it, training still succeeds and keeps the last model, with HF's warning ("Could not locate the best model")."""

from __future__ import annotations

import logging
import shutil

import torch
from safetensors.torch import load_file

from kubetrain_trainer import Trainer, TrainingArguments
from kubetrain_trainer.models import SyntheticRegression, TinyMLP


class Scripted:
    def __init__(self, values):
        self.values = list(values)

    def __call__(self, prediction):
        return {"score": self.values.pop(0)}


def _args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
                disable_tqdm=True, report_to=["none"], max_steps=8, eval_strategy="steps", eval_steps=2, save_steps=2,
                save_total_limit=1, load_best_model_at_end=True, metric_for_best_model="score",
                greater_is_better=False)
    return TrainingArguments(**{**base, **kw})


def _resume_on_a_new_pod(tmp_path, *, with_best: bool) -> tuple[Trainer, object]:
    pod1, pod2 = tmp_path / "pod1" / "out", tmp_path / "pod2" / "out"
    torch.manual_seed(0)
    first = Trainer(model=TinyMLP(), args=_args(pod1, max_steps=6), train_dataset=SyntheticRegression(32),
                    eval_dataset=SyntheticRegression(8, seed=1), compute_metrics=Scripted([3, 1, 2]))
    first.train()  # preempted after step 6 (as if): the best is checkpoint-4
    assert first.state.best_model_checkpoint == str(pod1 / "checkpoint-4")
    pod2.mkdir(parents=True)
    shutil.copytree(pod1 / "checkpoint-6", pod2 / "checkpoint-6")  # the restore: the newest complete one
    if with_best:
        shutil.copytree(pod1 / "checkpoint-4", pod2 / "checkpoint-4")  # ...and the best (fetch_best)
    best = load_file(str(pod1 / "checkpoint-4" / "model.safetensors"))
    shutil.rmtree(tmp_path / "pod1")  # the old pod's disk is gone
    second = Trainer(model=TinyMLP(), args=_args(pod2), train_dataset=SyntheticRegression(32),
                     eval_dataset=SyntheticRegression(8, seed=1), compute_metrics=Scripted([4]))
    second.train(resume_from_checkpoint=str(pod2 / "checkpoint-6"))
    return second, best


def test_the_best_checkpoint_fetched_by_the_restore_is_loaded(tmp_path):
    trainer, best = _resume_on_a_new_pod(tmp_path, with_best=True)
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, best[k])


def test_a_best_checkpoint_that_is_nowhere_keeps_the_last_model_and_training_succeeds(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kubetrain_trainer"):
        trainer, best = _resume_on_a_new_pod(tmp_path, with_best=False)
    assert trainer.state.global_step == 8
    assert any("Could not locate the best model" in r.message for r in caplog.records)
    last = load_file(str(tmp_path / "pod2" / "out" / "checkpoint-8" / "model.safetensors"))
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, last[k])
