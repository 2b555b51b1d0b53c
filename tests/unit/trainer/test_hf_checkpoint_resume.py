"""A checkpoint as the HF Trainer writes it resumes here exactly: what kubetrain adds to a checkpoint (the data
position) is derived when it is missing, as HF derives it.

Each test trains straight through, and again stopped at a checkpoint that is then made HF's (kubetrain's
additions removed) and resumed: the two runs' losses and weights must be equal, bitwise.
"""

from __future__ import annotations

import json

import torch

from kubetrain_trainer import Trainer, TrainerCallback

STEPS = 12  # 30 samples / batch 4 = 8 micro-batches an epoch = 4 steps of 2: two epochs and a half


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _run(tiny_gpt, tokens, make_args, out, *, seed=0, stop=None, resume=None, **kw):
    args = make_args(output_dir=str(out), max_steps=STEPS, gradient_accumulation_steps=2, warmup_steps=2,
                     lr_scheduler_type="cosine", weight_decay=0.1, **{"save_steps": 3, **kw})
    trainer = Trainer(model=tiny_gpt(seed), args=args, train_dataset=tokens(), callbacks=[StopAt(stop)] if stop else [])
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _losses(trainer):
    return [(e["step"], e["epoch"], e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


def _assert_same_run(a, b):
    assert _losses(a) == _losses(b) and len(_losses(b)) == STEPS
    theirs = b.model.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in a.model.state_dict().items())


def _drop(folder, *keys):
    path = folder / "trainer_state.json"
    state = json.loads(path.read_text())
    for key in keys:
        state.pop(key)
    path.write_text(json.dumps(state))


def test_a_trainer_state_without_data_position_resumes_where_hf_would(tiny_gpt, tokens, make_args, tmp_path):
    """checkpoint-9 (epoch 2.25) without `data_position` continued at step 9 from epoch 0's first batch: the
    position now follows from global_step as HF derives it (epoch 9 // 4 = 2, then 1 step of 2 batches)."""
    straight = _run(tiny_gpt, tokens, make_args, tmp_path / "a")
    _run(tiny_gpt, tokens, make_args, tmp_path / "b", stop=9)
    _drop(tmp_path / "b" / "checkpoint-9", "data_position")
    resumed = _run(tiny_gpt, tokens, make_args, tmp_path / "b", seed=7, resume=str(tmp_path / "b" / "checkpoint-9"))
    _assert_same_run(straight, resumed)


def test_an_epoch_boundary_without_data_position_starts_the_next_epoch(tiny_gpt, tokens, make_args, tmp_path):
    straight = _run(tiny_gpt, tokens, make_args, tmp_path / "a", save_steps=4)
    _run(tiny_gpt, tokens, make_args, tmp_path / "b", stop=8, save_steps=4)
    _drop(tmp_path / "b" / "checkpoint-8", "data_position")
    resumed = _run(tiny_gpt, tokens, make_args, tmp_path / "b", seed=7, resume=True, save_steps=4)
    _assert_same_run(straight, resumed)
