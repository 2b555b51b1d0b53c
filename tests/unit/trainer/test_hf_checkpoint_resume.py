"""Checkpoints both ways between kubetrain and the HF Trainer: HF reads kubetrain's trainer_state.json, and a
checkpoint as the HF Trainer writes it resumes here exactly (the data position kubetrain adds is derived when
it is missing, as HF derives it, and the RNG state is read from HF's rng_state.pth), as does one of an
older kubetrain (its fields inline).

The resume tests train straight through, and again stopped at a checkpoint that is then reshaped and resumed:
the two runs' losses and weights must be equal, bitwise.
"""

from __future__ import annotations

import json

import pytest
import torch

from kubetrain_trainer import Trainer
from test_trainer_resume import StopAt

STEPS = 12  # 30 samples / batch 4 = 8 micro-batches an epoch = 4 steps of 2: two epochs and a half


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


def _as_hf(folder):
    """The checkpoint as the HF Trainer writes it in one process: no kubetrain_state.json beside
    trainer_state.json, and the RNG state in rng_state.pth only (no rng_state_0.pth)."""
    (folder / "kubetrain_state.json").unlink()
    (folder / "rng_state_0.pth").unlink()


def _inline(folder):
    """The checkpoint as kubetrain wrote it before kubetrain_state.json: its fields inside trainer_state.json."""
    extra = folder / "kubetrain_state.json"
    state = {**json.loads((folder / "trainer_state.json").read_text()), **json.loads(extra.read_text())}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    extra.unlink()


def test_a_trainer_state_without_data_position_resumes_where_hf_would(tiny_gpt, tokens, make_args, tmp_path):
    """checkpoint-9 (epoch 2.25) without `data_position` continued at step 9 from epoch 0's first batch: the
    position now follows from global_step as HF derives it (epoch 9 // 4 = 2, then 1 step of 2 batches)."""
    straight = _run(tiny_gpt, tokens, make_args, tmp_path / "a")
    _run(tiny_gpt, tokens, make_args, tmp_path / "b", stop=9)
    _as_hf(tmp_path / "b" / "checkpoint-9")
    resumed = _run(tiny_gpt, tokens, make_args, tmp_path / "b", seed=7, resume=str(tmp_path / "b" / "checkpoint-9"))
    _assert_same_run(straight, resumed)


def test_an_epoch_boundary_without_data_position_starts_the_next_epoch(tiny_gpt, tokens, make_args, tmp_path):
    straight = _run(tiny_gpt, tokens, make_args, tmp_path / "a", save_steps=4)
    _run(tiny_gpt, tokens, make_args, tmp_path / "b", stop=8, save_steps=4)
    _as_hf(tmp_path / "b" / "checkpoint-8")
    resumed = _run(tiny_gpt, tokens, make_args, tmp_path / "b", seed=7, resume=True, save_steps=4)
    _assert_same_run(straight, resumed)


def test_the_hf_trainer_reads_a_kubetrain_trainer_state(tiny_gpt, tokens, make_args, tmp_path):
    """`transformers.TrainerState.load_from_json` takes HF's fields only (another key is a TypeError):
    trainer_state.json holds them, kubetrain's own fields are in kubetrain_state.json beside it."""
    transformers = pytest.importorskip("transformers")
    trainer = _run(tiny_gpt, tokens, make_args, tmp_path / "a", stop=6)
    trainer.save_state()
    for path in (tmp_path / "a" / "checkpoint-6" / "trainer_state.json", tmp_path / "a" / "trainer_state.json"):
        state = transformers.TrainerState.load_from_json(str(path))
        assert state.global_step == 6 and state.epoch == 1.5
        assert state.log_history[:6] == trainer.state.log_history[:6]  # the run's summary after them in save_state
    # HF resumes one process's RNG from rng_state.pth, loaded as HF loads it (weights_only, numpy allowed)
    folder = tmp_path / "a" / "checkpoint-6"
    with transformers.trainer_pt_utils.safe_globals():
        hf_rng = torch.load(folder / "rng_state.pth", weights_only=True)
    ours = torch.load(folder / "rng_state_0.pth", weights_only=False)
    assert hf_rng.keys() == ours.keys() and torch.equal(hf_rng["cpu"], ours["cpu"]) and hf_rng["python"] == ours["python"]



def test_the_hf_trainer_resumes_a_kubetrain_checkpoint_and_saves_past_it(tiny_gpt, tokens, make_args, tmp_path):
    """HF's first save after the resume read `stateful_callbacks["TrainerControl"]`: kubetrain wrote none, and
    the HF Trainer stopped with KeyError at it."""
    transformers = pytest.importorskip("transformers")
    Trainer(model=tiny_gpt(0), args=make_args(max_steps=3), train_dataset=tokens()).train()
    folder = tmp_path / "out" / "checkpoint-3"
    saved = json.loads((folder / "trainer_state.json").read_text())["stateful_callbacks"]["TrainerControl"]
    assert set(saved) == {"args", "attributes"} and set(saved["args"]) == set(transformers.TrainerControl().state()["args"])
    hf = transformers.Trainer(model=tiny_gpt(0), train_dataset=tokens(), args=transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=6, save_steps=3, logging_steps=1, per_device_train_batch_size=4,
        report_to="none", use_cpu=True, disable_tqdm=True))
    hf.train(resume_from_checkpoint=str(folder))
    assert hf.state.global_step == 6 and (tmp_path / "hf" / "checkpoint-6" / "trainer_state.json").is_file()
    # ... and kubetrain resumes it with its own control (no "state of callbacks this run does not have").
    resumed = Trainer(model=tiny_gpt(0), args=make_args(output_dir=str(tmp_path / "b")), train_dataset=tokens())
    assert resumed.train(resume_from_checkpoint=str(folder)).global_step == 6


def test_an_older_checkpoint_with_kubetrain_s_fields_inline_resumes_bitwise(tiny_gpt, tokens, make_args, tmp_path):
    straight = _run(tiny_gpt, tokens, make_args, tmp_path / "a")
    _run(tiny_gpt, tokens, make_args, tmp_path / "b", stop=9)
    _inline(tmp_path / "b" / "checkpoint-9")
    resumed = _run(tiny_gpt, tokens, make_args, tmp_path / "b", seed=7, resume=True)
    _assert_same_run(straight, resumed)


def test_hf_s_rng_state_pth_is_read_in_a_1_process_run_only(tmp_path):
    from kubetrain_trainer import rng

    rng.set_seed(1)
    rng.save(tmp_path, rank=0, world_size=1)
    (tmp_path / "rng_state_0.pth").unlink()
    expected = torch.rand(3)
    rng.set_seed(2)
    assert not rng.load(tmp_path, rank=0, world_size=2)  # HF too reads rng_state_<rank>.pth only in several
    assert rng.load(tmp_path, rank=0, world_size=1)
    assert torch.equal(torch.rand(3), expected)


def test_an_hf_checkpoint_of_a_model_with_tied_weights_resumes(tokens, make_args, tmp_path):
    """HF saves GPT-2's tied lm_head once (as transformer.wte.weight): the strict load refused the checkpoint as
    another model's ("the model's arguments changed"). A key really missing is still refused."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from kubetrain_trainer import ConfigError

    def gpt2():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16,
                                                                    n_layer=1, n_head=2))

    straight = Trainer(model=gpt2(), args=make_args(max_steps=6), train_dataset=tokens())
    straight.train()
    folder = tmp_path / "out" / "checkpoint-3"
    weights = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" in weights
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    resumed = Trainer(model=gpt2(), args=make_args(output_dir=str(tmp_path / "b")), train_dataset=tokens())
    resumed.train(resume_from_checkpoint=str(folder))
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
    save_file({k: v for k, v in weights.items() if not k.startswith("transformer.h.0.ln_1")},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"Missing key\(s\).*ln_1"):
        Trainer(model=gpt2(), args=make_args(output_dir=str(tmp_path / "c")), train_dataset=tokens()).train(
            resume_from_checkpoint=str(folder))


def test_a_missing_key_is_excused_only_as_the_same_tensor_under_another_name():
    """A reviewer's catch: a loaded tensor that is only a slice of the missing one shares its data pointer."""
    from kubetrain_trainer.strategies.base import StateDictMismatch
    from kubetrain_trainer.strategies.ddp import load_weights

    class Sliced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.big = torch.nn.Parameter(torch.zeros(8))
            self.register_buffer("head", self.big.data[:2], persistent=True)

    module = Sliced()
    with pytest.raises(StateDictMismatch, match="big"):
        load_weights(module, {"head": torch.ones(2)})
