"""Trainer behaviour users rely on: NaN handling, best model, early stopping, eval, saving, precision, hooks."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file

from kubetrain_trainer import (ConfigError, EarlyStoppingCallback, NonFiniteLossError, Trainer, TrainerCallback)
from kubetrain_trainer.checkpoint import list_checkpoints
from kubetrain_trainer.modelio import save_model_files
from kubetrain_trainer.models import SyntheticRegression, TinyGPT, TinyGPTConfig, TinyMLP
from kubetrain_trainer.optim import decay_parameter_names


class NanAt(torch.utils.data.Dataset):
    """Regression data with a NaN target at one index: exactly one batch per epoch has a NaN loss."""

    def __init__(self, n=16, bad=5):
        self.inner, self.bad = SyntheticRegression(n), bad

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        item = dict(self.inner[i])
        if i == self.bad:
            item["y"] = torch.tensor(float("nan"))
        return item


def test_nan_loss_is_skipped_and_reported_with_the_step(make_args, caplog):
    torch.manual_seed(0)
    trainer = Trainer(model=TinyMLP(), args=make_args(max_steps=4, save_strategy="no"), train_dataset=NanAt())
    with caplog.at_level(logging.WARNING, logger="kubetrain_trainer"):
        trainer.train()
    assert trainer.state.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any("loss is nan" in r.message and "update skipped" in r.message for r in caplog.records)
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


def test_nan_loss_stops_when_configured(make_args):
    torch.manual_seed(0)
    trainer = Trainer(model=TinyMLP(), args=make_args(max_steps=4, nan_inf_policy="stop", save_strategy="no"),
                      train_dataset=NanAt())
    with pytest.raises(NonFiniteLossError, match=r"step \d+: the loss is nan"):
        trainer.train()


class Scripted:
    """compute_metrics returning a scripted sequence of `score` values, one per evaluation."""

    def __init__(self, values):
        self.values = list(values)

    def __call__(self, prediction):
        assert prediction.predictions.shape == (8,)
        return {"score": self.values.pop(0)}


def test_load_best_model_at_end_reloads_the_best_and_rotation_keeps_it(make_args, tmp_path):
    torch.manual_seed(0)
    args = make_args(max_steps=8, eval_strategy="steps", eval_steps=2, save_steps=2, save_total_limit=1,
                     load_best_model_at_end=True, metric_for_best_model="score", greater_is_better=False)
    trainer = Trainer(model=TinyMLP(), args=args, train_dataset=SyntheticRegression(32),
                      eval_dataset=SyntheticRegression(8, seed=1), compute_metrics=Scripted([3, 1, 2, 4]))
    trainer.train()
    out = tmp_path / "out"
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-4")
    assert trainer.state.best_metric == 1
    assert [s for s, _ in list_checkpoints(out)] == [4, 8]  # limit 1, but best and newest both kept
    best = load_file(str(out / "checkpoint-4" / "model.safetensors"))
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, best[k])


def test_early_stopping_stops_after_patience_evaluations(make_args):
    torch.manual_seed(0)
    args = make_args(max_steps=20, eval_strategy="steps", eval_steps=2, save_strategy="no",
                     metric_for_best_model="score", greater_is_better=False)
    trainer = Trainer(model=TinyMLP(), args=args, train_dataset=SyntheticRegression(32),
                      eval_dataset=SyntheticRegression(8, seed=1), compute_metrics=Scripted([3, 1, 2, 4, 0, 0]),
                      callbacks=[EarlyStoppingCallback(early_stopping_patience=2)])
    out = trainer.train()
    assert out.global_step == 8


def test_evaluate_and_predict(make_args):
    torch.manual_seed(0)
    eval_ds = SyntheticRegression(10, seed=1)
    model = TinyMLP()
    trainer = Trainer(model=model, args=make_args(per_device_eval_batch_size=3), train_dataset=SyntheticRegression(8),
                      eval_dataset=eval_ds, compute_metrics=lambda p: {"mae": float(abs(p.predictions - eval_ds.y.numpy()).mean())})
    metrics = trainer.evaluate()
    with torch.no_grad():
        pred = model(eval_ds.x)["logits"]
    assert metrics["eval_loss"] == pytest.approx(torch.nn.functional.mse_loss(pred, eval_ds.y).item(), rel=1e-5)
    assert metrics["eval_mae"] == pytest.approx((pred - eval_ds.y).abs().mean().item(), rel=1e-5)
    result = trainer.predict(eval_ds)
    assert result.predictions.shape == (10,)
    assert torch.allclose(torch.from_numpy(result.predictions), pred)


def test_eval_strategy_without_eval_dataset_fails_before_training(make_args):
    with pytest.raises(ConfigError, match="no eval_dataset"):
        Trainer(model=TinyMLP(), args=make_args(eval_strategy="epoch"), train_dataset=SyntheticRegression(8))


def test_weight_decay_skips_biases_and_norm_weights():
    names = decay_parameter_names(TinyGPT(TinyGPTConfig(n_layers=1)))
    assert "blocks.0.qkv.weight" in names and "head.weight" in names and "tok.weight" in names
    assert not any(n.endswith(".bias") for n in names)
    assert not any("ln" in n for n in names)


def test_save_model_writes_a_loadable_config_and_safetensors(tiny_gpt, tokens, make_args, tmp_path):
    trainer = Trainer(model=tiny_gpt(0), args=make_args(max_steps=2, save_strategy="no"), train_dataset=tokens())
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    reloaded = TinyGPT(TinyGPTConfig(**config))
    reloaded.load_state_dict(load_file(str(tmp_path / "final" / "model.safetensors")))
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, reloaded.state_dict()[k])


def test_hf_transformers_model_trains_and_saves_for_from_pretrained(make_args, tokens, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    before = model.transformer.wte.weight.detach().clone()
    trainer = Trainer(model=model, args=make_args(max_steps=2, save_strategy="no", gradient_checkpointing=True),
                      train_dataset=tokens())
    trainer.train()
    assert not torch.equal(before, model.transformer.wte.weight)
    trainer.save_model(str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for k, v in model.state_dict().items():
        assert torch.equal(v, again.state_dict()[k])


def test_a_bf16_cast_model_saved_from_fp32_master_weights_loads_back_as_those(tmp_path):
    """ZeRO-3 with bf16: DeepSpeed casts the module to bf16 in place and the final model is written from the
    fp32 master weights. config.json must say float32: from_pretrained (dtype "auto") loads in its dtype."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16,
                                                                 n_layer=1, n_head=2))
    master = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.bfloat16()
    save_model_files(model, master, tmp_path / "fp32")
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32").state_dict()
    for k, v in master.items():
        assert torch.equal(again[k], v), k
    assert str(model.config.dtype) == "bfloat16"  # the live config is the module's, as save_pretrained left it
    # 16-bit weights (stage3_gather_16bit_weights_on_model_save) keep the bfloat16 config, as HF writes them.
    save_model_files(model, model.state_dict(), tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_bf16_autocast_runs_the_forward_in_bfloat16(tiny_gpt, tokens, make_args):
    dtypes = []
    model = tiny_gpt(0)
    model.blocks[0].qkv.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    out = Trainer(model=model, args=make_args(max_steps=2, bf16=True, save_strategy="no"), train_dataset=tokens()).train()
    assert set(dtypes) == {torch.bfloat16} and math.isfinite(out.training_loss)
    assert model.tok.weight.dtype == torch.float32  # master weights stay fp32


def test_fp16_on_cpu_is_a_config_error(tiny_gpt, make_args):
    with pytest.raises(ConfigError, match="fp16 needs a GPU; on CPU set bf16"):
        Trainer(model=tiny_gpt(0), args=make_args(fp16=True))


def test_gradient_checkpointing_gives_the_same_training(tiny_gpt, tokens, make_args, tmp_path):
    plain = Trainer(model=tiny_gpt(0, dropout=0.0), args=make_args(max_steps=3, save_strategy="no"),
                    train_dataset=tokens())
    plain.train()
    ckpt = Trainer(model=tiny_gpt(0, dropout=0.0), args=make_args(max_steps=3, save_strategy="no",
                                                                  gradient_checkpointing=True), train_dataset=tokens())
    ckpt.train()
    assert ckpt.model.gradient_checkpointing
    for (k, a), b in zip(plain.model.state_dict().items(), ckpt.model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k
    with pytest.raises(ConfigError, match="no gradient_checkpointing_enable"):
        Trainer(model=TinyMLP(), args=make_args(gradient_checkpointing=True))


def test_neftune_noises_embeddings_while_training_only(tiny_gpt, tokens, make_args):
    clean = []  # per training forward: did the embedding output equal the plain lookup?

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            # Registered after NEFTune's hook, so it sees the noised output.
            self.handle = model.tok.register_forward_hook(lambda m, i, o: clean.append(torch.equal(o, m.weight[i[0]])))

        def on_train_end(self, args, state, control, **kwargs):
            self.handle.remove()

    model = tiny_gpt(0)
    Trainer(model=model, args=make_args(max_steps=2, neftune_noise_alpha=5.0, save_strategy="no"),
            train_dataset=tokens(), callbacks=[Probe()]).train()
    assert clean == [False, False]
    assert len(model.tok._forward_hooks) == 0  # NEFTune's hook is gone after training
    ids = torch.arange(8).unsqueeze(0)
    assert torch.equal(model.tok(ids), model.tok.weight[ids])


def test_fractional_logging_steps_and_jsonl_report(tiny_gpt, tokens, make_args, tmp_path):
    trainer = Trainer(model=tiny_gpt(0), args=make_args(max_steps=8, logging_steps=0.25, save_strategy="no",
                                                        report_to=["jsonl", "tensorboard"]), train_dataset=tokens())
    trainer.train()
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [2, 4, 6, 8]
    lines = [json.loads(x) for x in (tmp_path / "out" / "runs" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [2, 4, 6, 8]
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "out" / "runs").glob("*/*"))


def test_model_without_loss_is_reported(make_args):
    class NoLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, x, y):
            return {"logits": self.lin(x)}

    trainer = Trainer(model=NoLoss(), args=make_args(max_steps=1, save_strategy="no"),
                      train_dataset=SyntheticRegression(8))
    with pytest.raises(ValueError, match="the model returned no loss"):
        trainer.train()
