"""`total_flos` as the installed transformers Trainer counts it: 6 x main-input tokens x non-embedding parameters
per micro-batch, in `trainer_state.json`, the train() metrics and the final log; 0 for a model without
`num_parameters`; continued across a resume. Both trainers run on the same tiny GPT-2 built from a config."""

from __future__ import annotations

import json
import types

import torch
from torch import nn
from transformers import Trainer as HFTrainer
from transformers import TrainingArguments as HFTrainingArguments

from kubetrain_trainer import Trainer, TrainerCallback, TrainingArguments

from hf_tiny import SEQ, tiny_gpt2 as _gpt2, token_rows as _rows


def _run(args_class, trainer_class, out, model, callbacks=(), resume=None, **kw):
    args = args_class(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                      report_to="none", disable_tqdm=True, use_cpu=True, logging_steps=2, save_steps=2, **kw)
    trainer = trainer_class(model=model, args=args, train_dataset=_rows(), callbacks=list(callbacks))
    return trainer, trainer.train(resume_from_checkpoint=resume)


def test_total_flos_is_the_transformers_trainers(tmp_path):
    hf, _ = _run(HFTrainingArguments, HFTrainer, tmp_path / "hf", _gpt2(), max_steps=3)
    kt, kt_out = _run(TrainingArguments, Trainer, tmp_path / "kt", _gpt2(), max_steps=3)
    # The reference by hand: HF's own per-micro-batch figure, 2 micro-batches per step, 3 steps.
    per_micro = HFTrainer.floating_point_ops(types.SimpleNamespace(model=_gpt2()), _rows(2)[0] | {
        "input_ids": torch.zeros(2, SEQ, dtype=torch.long)})
    assert per_micro == 6 * 2 * SEQ * _gpt2().num_parameters(exclude_embeddings=True) > 0
    assert hf.state.total_flos == 3 * 2 * per_micro
    assert kt.state.total_flos == hf.state.total_flos
    # HF's PrinterCallback (disable_tqdm) pops it from the metrics dict in place; its log_history keeps it.
    assert kt_out.metrics["total_flos"] == hf.state.log_history[-1]["total_flos"] == hf.state.total_flos
    assert kt.state.log_history[-1]["total_flos"] == hf.state.total_flos
    saved = {name: json.loads((tmp_path / name / "checkpoint-2" / "trainer_state.json").read_text())["total_flos"]
             for name in ("hf", "kt")}
    assert saved["kt"] == saved["hf"] == 2 * 2 * per_micro


class Plain(nn.Module):
    """No `num_parameters`: HF counts no flos for it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 4)

    def forward(self, input_ids, labels=None):
        return {"loss": self.emb(input_ids).pow(2).mean()}


def test_a_model_without_num_parameters_counts_no_flos_as_hf(tmp_path):
    hf, _ = _run(HFTrainingArguments, HFTrainer, tmp_path / "hf", Plain(), max_steps=2)
    kt, out = _run(TrainingArguments, Trainer, tmp_path / "kt", Plain(), max_steps=2)
    assert kt.state.total_flos == hf.state.total_flos == out.metrics["total_flos"] == 0


class OwnCount(Plain):
    def num_parameters(self):  # a plain module's own method, without HF's exclude_embeddings
        return 3


def test_a_model_whose_own_num_parameters_takes_other_arguments_trains_and_counts_none(tmp_path):
    kt, out = _run(TrainingArguments, Trainer, tmp_path / "kt", OwnCount(), max_steps=2)
    assert out.global_step == 2 and kt.state.total_flos == 0


class StopAt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == 2


def test_a_resumed_run_continues_from_the_saved_total_flos(tmp_path):
    straight, _ = _run(TrainingArguments, Trainer, tmp_path / "a", _gpt2(), max_steps=4)
    _run(TrainingArguments, Trainer, tmp_path / "b", _gpt2(), callbacks=[StopAt()], max_steps=4)
    resumed, out = _run(TrainingArguments, Trainer, tmp_path / "b", _gpt2(), resume=True, max_steps=4)
    assert resumed.state.total_flos == out.metrics["total_flos"] == straight.state.total_flos > 0
    final = json.loads((tmp_path / "b" / "checkpoint-4" / "trainer_state.json").read_text())
    assert final["total_flos"] == straight.state.total_flos
