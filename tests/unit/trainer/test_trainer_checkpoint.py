"""Local checkpoints: atomic commit, newest-complete discovery, retention that spares the best and newest."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kubetrain_trainer import Trainer
from kubetrain_trainer.checkpoint import (ResumeRegistry, checkpoints_to_delete, list_checkpoints, newest_checkpoint,
                                          save_checkpoint)


def _fake(root, step, complete=True):
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x")
    if complete:
        (d / "trainer_state.json").write_text("{}")
    return d


def test_newest_checkpoint_ignores_partial_and_tmp_folders(tmp_path):
    _fake(tmp_path, 10)
    _fake(tmp_path, 20)
    _fake(tmp_path, 30, complete=False)  # a folder whose save never finished
    (tmp_path / "tmp-checkpoint-40").mkdir()
    (tmp_path / "tmp-checkpoint-40" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-abc").mkdir()
    assert newest_checkpoint(tmp_path) == tmp_path / "checkpoint-20"
    assert newest_checkpoint(tmp_path / "missing") is None


def test_failed_save_leaves_nothing_resume_would_pick(tmp_path):
    registry = ResumeRegistry()
    registry.register("weights", save=lambda d: (d / "model.safetensors").write_bytes(b"w"), load=lambda d: None)

    def crash(d):
        raise OSError("disk full")
    registry.register("trainer_state", save=crash, load=lambda d: None)
    _fake(tmp_path, 5)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 10, registry)
    assert (tmp_path / "tmp-checkpoint-10" / "model.safetensors").exists()
    assert newest_checkpoint(tmp_path) == tmp_path / "checkpoint-5"


def test_resume_after_a_torn_save_uses_the_previous_checkpoint_and_cleans_up(tiny_gpt, tokens, make_args, tmp_path):
    args = make_args(max_steps=3, save_steps=3)
    Trainer(model=tiny_gpt(0), args=args, train_dataset=tokens()).train()
    out = tmp_path / "out"
    # Simulate a process killed while writing step 6: tmp folder plus an uncommitted final name.
    (out / "tmp-checkpoint-6").mkdir()
    (out / "tmp-checkpoint-6" / "model.safetensors").write_bytes(b"torn")
    _fake(out, 6, complete=False)
    trainer = Trainer(model=tiny_gpt(0), args=make_args(max_steps=6, save_steps=3), train_dataset=tokens())
    trainer.train(resume_from_checkpoint=True)
    seen = [e["step"] for e in trainer.state.log_history if "loss" in e]
    assert seen == [1, 2, 3, 4, 5, 6]  # steps 1-3 from checkpoint-3's history, 4-6 trained now
    assert not (out / "tmp-checkpoint-6").exists()
    assert (out / "checkpoint-6" / "trainer_state.json").is_file()


def test_retention_rule_spares_newest_and_best(tmp_path):
    cps = [(s, tmp_path / f"checkpoint-{s}") for s in (2, 4, 6, 8, 10)]
    assert [p.name for p in checkpoints_to_delete(cps, limit=2, keep=[])] == ["checkpoint-2", "checkpoint-4",
                                                                                "checkpoint-6"]
    assert [p.name for p in checkpoints_to_delete(cps, limit=2, keep=[str(tmp_path / "checkpoint-4")])] == [
        "checkpoint-2", "checkpoint-6", "checkpoint-8"]
    # limit 1 and a best that is not the newest: both stay
    assert [p.name for p in checkpoints_to_delete(cps, limit=1, keep=["checkpoint-2"])] == [
        "checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert checkpoints_to_delete(cps, limit=None) == []


def test_checkpoint_layout_and_rotation_in_a_run(tiny_gpt, tokens, make_args, tmp_path):
    args = make_args(max_steps=8, save_steps=2, save_total_limit=2)
    Trainer(model=tiny_gpt(0), args=args, train_dataset=tokens()).train()
    out = tmp_path / "out"
    assert [s for s, _ in list_checkpoints(out)] == [6, 8]
    files = sorted(p.name for p in (out / "checkpoint-8").iterdir())
    assert files == [".kubetrain-ready", "config.json", "kubetrain_state.json", "model.safetensors", "optimizer.pt",
                     "rng_state.pth", "rng_state_0.pth", "scheduler.pt", "trainer_state.json",
                     "training_args.json"]  # the marker: see readiness.py; rng_state.pth: HF's name in 1 process
    state = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and "data_position" not in state  # HF's fields only: HF's Trainer reads it
    extra = json.loads((out / "checkpoint-8" / "kubetrain_state.json").read_text())
    assert extra["data_position"] == {"epoch": 1, "samples": 0}  # 30 samples / 4 = 8 batches: epoch 0 is done
    assert extra["last_checkpoint_dir"] == str(out / "checkpoint-8")
    assert json.loads((out / "checkpoint-8" / "training_args.json").read_text())["max_steps"] == 8
    assert "tok.weight" in load_file(str(out / "checkpoint-8" / "model.safetensors"))


def test_on_save_receives_the_committed_folder(tiny_gpt, tokens, make_args):
    from kubetrain_trainer import TrainerCallback

    seen = []

    class Spy(TrainerCallback):
        def on_save(self, args, state, control, checkpoint_dir=None, **kwargs):
            from pathlib import Path
            assert Path(state.last_checkpoint_dir, "trainer_state.json").is_file()
            seen.append((state.last_checkpoint_dir, checkpoint_dir))

    args = make_args(max_steps=4, save_steps=2)
    Trainer(model=tiny_gpt(0), args=args, train_dataset=tokens(), callbacks=[Spy()]).train()
    assert [a.rsplit("/", 1)[1] for a, b in seen] == ["checkpoint-2", "checkpoint-4"]
    assert all(a == b for a, b in seen)


def test_a_checkpoint_of_a_transformers_model_loads_with_from_pretrained(tokens, make_args, tmp_path):
    """As with the HF Trainer, checkpoint-N holds the config (and generation config) next to the weights:
    `AutoModelForCausalLM.from_pretrained("out/checkpoint-N")` evaluates or serves an intermediate step."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1,
                                                                 n_head=2))
    Trainer(model=model, args=make_args(max_steps=2, save_steps=2), train_dataset=tokens()).train()
    folder = tmp_path / "out" / "checkpoint-2"
    assert (folder / "config.json").is_file() and (folder / "generation_config.json").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert type(loaded) is transformers.GPT2LMHeadModel
    trained = model.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
