"""HF 5's evaluation arguments `eval_on_start` and `batch_eval_metrics`, run next to the installed transformers
Trainer on the same tiny GPT-2: what each logs and what `compute_metrics` is given."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers import Trainer as HFTrainer
from transformers import TrainingArguments as HFTrainingArguments

from kubetrain_trainer import ConfigError, Trainer, TrainingArguments

SEQ = 8
KINDS = {"hf": (HFTrainingArguments, HFTrainer), "kt": (TrainingArguments, Trainer)}


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=SEQ))


def _rows(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 50, (n, SEQ), generator=g)]


def _trainer(kind, out, *, compute_metrics=None, **kw):
    args_class, trainer_class = KINDS[kind]
    args = args_class(**{**dict(output_dir=str(out), per_device_train_batch_size=2, per_device_eval_batch_size=4,
                                report_to="none", disable_tqdm=True, use_cpu=True, logging_steps=2, save_steps=2,
                                max_steps=2), **kw})
    return trainer_class(model=_gpt2(), args=args, train_dataset=_rows(), eval_dataset=_rows(6, seed=2),
                         compute_metrics=compute_metrics)


def _evals(trainer):
    return [(e["step"], round(e["eval_loss"], 5)) for e in trainer.state.log_history if "eval_loss" in e]


def test_eval_on_start_evaluates_before_the_first_step_as_hf(tmp_path):
    got = {}
    for kind in KINDS:
        trainer = _trainer(kind, tmp_path / kind, eval_on_start=True)
        trainer.train()
        got[kind] = _evals(trainer)
    assert [step for step, _ in got["kt"]] == [step for step, _ in got["hf"]] == [0]
    # The untrained model's loss (HF's differs for a causal LM: it divides by a token per row too many).
    assert got["kt"][0][1] == round(_trainer("kt", tmp_path / "fresh").evaluate()["eval_loss"], 5)


def test_eval_on_start_evaluates_again_on_a_resume_as_hf(tmp_path):
    got = {}
    for kind in KINDS:
        _trainer(kind, tmp_path / kind, max_steps=4, save_steps=2).train()  # checkpoint-2 and checkpoint-4
        trainer = _trainer(kind, tmp_path / kind, max_steps=4, save_steps=2, eval_on_start=True)
        trainer.train(resume_from_checkpoint=str(tmp_path / kind / "checkpoint-2"))
        got[kind] = [step for step, _ in _evals(trainer)]
    assert got["kt"] == got["hf"] == [2]  # at the resumed step: no best metric, no checkpoint of its own


def test_eval_on_start_without_an_eval_dataset_is_refused_when_the_trainer_is_built(make_args, tiny_gpt, tokens):
    with pytest.raises(ConfigError, match="eval_on_start needs an eval_dataset"):
        Trainer(model=tiny_gpt(), args=make_args(eval_on_start=True), train_dataset=tokens())
