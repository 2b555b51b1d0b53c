"""The real `Trainer` with `strategy: fsdp` and `strategy: zero3`, 2 processes, gloo, CPU, end to end.

A run stopped after its step-3 checkpoint and resumed in fresh processes
(`resume_from_checkpoint=True`, other initial weights) must end where an
uninterrupted run ends (dropout on: the per-rank RNG is restored too), and
its final model must be a complete `model.safetensors` + `config.json` that a
plain, unsharded model loads, and that `from_pretrained` loads as it was saved.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from kubetrain_trainer.layout import RANK_FILES_NAME
from kubetrain_trainer.models import TinyGPT, TinyGPTConfig
from kubetrain_trainer.rank_files import RankFiles
from kubetrain_strategy_harness import TrainerSpec, max_abs_diff, run_distributed, trainer_worker

pytestmark = pytest.mark.slow

ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 10**9}


def _losses(history: list[dict]) -> list[float]:
    return [h["loss"] for h in history if "loss" in h]


@pytest.mark.parametrize("strategy, options, layout", [
    ("fsdp", {"reshard_after_forward": True}, ["pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"]),
    ("zero3", {"config": ZERO3}, ["latest", "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
])
def test_trainer_resume_equals_uninterrupted(strategy, options, layout, tmp_path, request):
    if strategy == "zero3":
        request.getfixturevalue("zero3_ready")
    straight = run_distributed(trainer_worker, TrainerSpec(strategy, str(tmp_path / "a"), options))[0]
    stopped = run_distributed(trainer_worker, TrainerSpec(strategy, str(tmp_path / "b"), options, stop_at=3))[0]
    assert stopped["global_step"] == 3
    checkpoint = tmp_path / "b" / "checkpoint-3"
    for name in layout:
        assert (checkpoint / name).is_file(), sorted(p.name for p in checkpoint.iterdir())
    resumed = run_distributed(trainer_worker, TrainerSpec(strategy, str(tmp_path / "b"), options, resume=True,
                                                          init_seed=99))[0]
    assert resumed["global_step"] == 6

    full = _losses(straight["history"])
    assert len(full) == 6 and full[-1] < full[0]
    diff_loss = max(abs(a - b) for a, b in zip(_losses(resumed["history"]), full))
    a = load_file(str(tmp_path / "a" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "final" / "model.safetensors"))
    diff = max_abs_diff(a, b)
    print(f"trainer {strategy}: resume max |param diff| = {diff:.3g}, max |loss diff| = {diff_loss:.3g}")
    assert _losses(resumed["history"])[-3:] and diff_loss <= 1e-6
    assert diff <= 1e-6

    # The final model: complete, and loadable by a plain model (the from_pretrained layout).
    config = json.loads((tmp_path / "a" / "final" / "config.json").read_text())
    plain = TinyGPT(TinyGPTConfig(**{k: v for k, v in config.items() if k in TinyGPTConfig.__dataclass_fields__}))
    plain.load_state_dict(a, strict=True)
    assert all(math.isfinite(v.float().abs().max().item()) for v in a.values())


@pytest.mark.parametrize("strategy, options", [
    ("fsdp", {"reshard_after_forward": True}),
    ("zero3", {"config": ZERO3}),
])
def test_async_save_written_after_training_moved_on_resumes_like_uninterrupted(strategy, options, tmp_path,
                                                                                request):
    """async_save (DCP's async_save for FSDP; a staged copy through DeepSpeed's own save for ZeRO-3):
    checkpoint-3's files are written only once the loop reached step 6 (held), yet resuming from it
    ends where an uninterrupted synchronous run ends."""
    if strategy == "zero3":
        request.getfixturevalue("zero3_ready")
    straight = run_distributed(trainer_worker, TrainerSpec(strategy, str(tmp_path / "a"), options))[0]
    held = run_distributed(trainer_worker, TrainerSpec(strategy, str(tmp_path / "b"), options, async_save=True,
                                                       hold_writes=True))[0]
    assert held["global_step"] == 6
    names = sorted(p.name for p in (tmp_path / "b").iterdir() if p.name.startswith(("checkpoint", "tmp-")))
    assert names == ["checkpoint-3", "checkpoint-6"]
    assert (tmp_path / "b" / "checkpoint-3" / ".kubetrain-ready").is_file()
    # The background write also records each rank's own files, so a node restores only its own (rank_files.py).
    records = [RankFiles.from_json(p.read_bytes()) for p in (tmp_path / "b" / "checkpoint-3").rglob(RANK_FILES_NAME)]
    assert len(records) == (2 if strategy == "fsdp" else 1) and all(r.world_size == 2 for r in records)
    resumed = run_distributed(trainer_worker, TrainerSpec(strategy, str(tmp_path / "b"), options, async_save=True,
                                                          resume=str(tmp_path / "b" / "checkpoint-3"),
                                                          init_seed=99))[0]
    assert resumed["global_step"] == 6
    assert _losses(resumed["history"]) == _losses(straight["history"])  # restored steps 1-3, trained 4-6
    a = load_file(str(tmp_path / "a" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "final" / "model.safetensors"))
    assert max_abs_diff(a, b) == 0.0


def test_zero3_bf16_final_model_loads_back_as_the_trained_fp32_weights(tmp_path, request):
    """DeepSpeed casts the module to bf16 in place; the final model is written from the fp32 master weights,
    so its config.json must say float32, or from_pretrained (dtype "auto") rounds every tensor to bf16."""
    request.getfixturevalue("zero3_ready")
    from transformers import AutoModelForCausalLM

    options = {"config": {**ZERO3, "bf16": {"enabled": "auto"}}}
    run_distributed(trainer_worker, TrainerSpec("zero3", str(tmp_path), options, max_steps=2, bf16=True, gpt2=True))
    final = tmp_path / "final"
    saved = load_file(str(final / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float32}
    # Trained: the weights are not bf16 values widened (else a bf16 load could not be told apart).
    assert any(not torch.equal(t, t.bfloat16().float()) for t in saved.values())
    assert json.loads((final / "config.json").read_text())["dtype"] == "float32"
    loaded = AutoModelForCausalLM.from_pretrained(final).state_dict()
    assert all(torch.equal(loaded[k], t) for k, t in saved.items())
