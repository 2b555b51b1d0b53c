"""The DeepSpeed config filling: "auto" from TrainingArguments, disagreements and non-stage-3 rejected."""

from __future__ import annotations

import json

import pytest

from kubetrain_trainer.args import ConfigError, TrainingArguments
from kubetrain_trainer.strategies.zero3 import AutoValues, fill_auto, load_config


def args(**overrides) -> TrainingArguments:
    values = dict(output_dir="/tmp/x", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.1,
                  max_grad_norm=0.5, max_steps=100, warmup_ratio=0.1, bf16=True, report_to=["none"],
                  strategy="zero3", deepspeed={"zero_optimization": {"stage": 3}})
    values.update(overrides)
    return TrainingArguments(**values)


def values(**overrides) -> AutoValues:
    return AutoValues.from_args(args(**overrides), world_size=8)


FULL_AUTO = {
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto", "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
}


def test_every_auto_is_filled_from_the_training_arguments():
    out = fill_auto(FULL_AUTO, AutoValues.from_args(args(), world_size=8, hidden_size=64))
    assert out["train_micro_batch_size_per_gpu"] == 4
    assert out["gradient_accumulation_steps"] == 2
    assert out["train_batch_size"] == 4 * 2 * 8
    assert out["gradient_clipping"] == 0.5
    assert out["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1,
                                          "torch_adam": True}
    assert out["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10,
                                          "total_num_steps": 100}
    assert out["bf16"] == {"enabled": True} and out["fp16"] == {"enabled": False}
    assert out["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 64 * 64,
                                        "stage3_prefetch_bucket_size": int(0.9 * 64 * 64),
                                        "stage3_param_persistence_threshold": 640}
    # The loop owns gradient accumulation (see zero3.py).
    assert out["managed_gradient_accumulation"] is False
    assert FULL_AUTO["train_batch_size"] == "auto"  # pure: the input is untouched


def test_missing_batch_fields_are_set_and_unknown_bucket_sizes_left_to_deepspeed():
    out = fill_auto({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, values())
    assert (out["train_micro_batch_size_per_gpu"], out["gradient_accumulation_steps"],
            out["train_batch_size"], out["gradient_clipping"]) == (4, 2, 64, 0.5)
    assert "reduce_bucket_size" not in out["zero_optimization"]  # no hidden size known: DeepSpeed's default
    assert "optimizer" not in out and "scheduler" not in out  # the Trainer's optimizer and schedule are used


def test_explicit_values_that_agree_are_kept():
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4,
              "gradient_accumulation_steps": 2, "gradient_clipping": 0.5, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95]}}}
    assert fill_auto(config, values())["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.95]}


def test_every_disagreement_is_named_at_once():
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 16,
              "gradient_accumulation_steps": 1, "fp16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigError) as err:
        fill_auto(config, values())
    message = str(err.value)
    for part in ("train_micro_batch_size_per_gpu=16 but per_device_train_batch_size=4",
                 "gradient_accumulation_steps=1 but gradient_accumulation_steps=2",
                 "fp16.enabled=True but fp16=False", "optimizer.params.lr=0.001 but learning_rate=0.0003"):
        assert part in message


@pytest.mark.parametrize("config, field", [
    ({}, "zero_optimization.stage is missing"),
    ({"zero_optimization": {}}, "zero_optimization.stage is missing"),
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage is 2"),
])
def test_a_config_that_is_not_stage_3_is_rejected_naming_the_field(config, field):
    with pytest.raises(ConfigError, match=field):
        fill_auto(config, values())
    with pytest.raises(ConfigError, match=field):
        load_config(config)


def test_scheduler_auto_total_without_max_steps_is_an_error_saying_what_to_set():
    config = {"zero_optimization": {"stage": 3},
              "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto",
                                                                "warmup_num_steps": "auto"}}}
    epochs = AutoValues.from_args(args(max_steps=-1, num_train_epochs=2), world_size=8)
    with pytest.raises(ConfigError, match="total_num_steps is 'auto' but .* not known before training"):
        fill_auto(config, epochs)
    known = AutoValues.from_args(args(max_steps=-1, num_train_epochs=2), world_size=8, num_training_steps=50)
    assert fill_auto(config, known)["scheduler"]["params"] == {"total_num_steps": 50, "warmup_num_steps": 5}


def test_an_auto_kubetrain_cannot_fill_is_an_error():
    with pytest.raises(ConfigError, match="aio.block_size is 'auto'"):
        fill_auto({"zero_optimization": {"stage": 3}, "aio": {"block_size": "auto"}}, values())


def test_loop_managed_accumulation_cannot_be_switched_back_on():
    with pytest.raises(ConfigError, match="managed_gradient_accumulation must be false"):
        fill_auto({"zero_optimization": {"stage": 3}, "managed_gradient_accumulation": True}, values())


def test_load_config_reads_json_files_and_names_bad_ones(tmp_path):
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert load_config(str(good)) == {"zero_optimization": {"stage": 3}}
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)


class _Initialized(Exception):
    """Raised by the faked `deepspeed.initialize` once it has seen the config."""


def test_an_epoch_run_fills_the_scheduler_total_from_the_trainers_plan(monkeypatch, make_args, tiny_gpt, tokens):
    """Only num_train_epochs set: the Trainer knows max_steps from the dataloader before the strategy
    prepares, and the config's "auto" total and warmup come from it (HF: deepspeed_init(max_steps))."""
    import deepspeed
    import torch.distributed as dist

    from kubetrain_trainer import Trainer

    seen: dict = {}

    def initialize(*, config, **kwargs):
        seen.update(config)
        raise _Initialized
    monkeypatch.setattr(deepspeed, "initialize", initialize)
    config = {"zero_optimization": {"stage": 3},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto",
                                                                "total_num_steps": "auto"}}}
    args = make_args(strategy="zero3", deepspeed=config, max_steps=-1, num_train_epochs=2,
                     gradient_accumulation_steps=2, warmup_ratio=0.25, use_cpu=True)
    trainer = Trainer(model=tiny_gpt(), args=args, train_dataset=tokens(30))
    had_group = dist.is_initialized()
    try:
        with pytest.raises(_Initialized):
            trainer.train()
    finally:
        if dist.is_initialized() and not had_group:
            dist.destroy_process_group()  # the strategy's private one-rank group
    # 30 samples / 4 a batch = 8 batches, / 2 accumulated = 4 steps an epoch, 2 epochs.
    assert seen["scheduler"]["params"] == {"warmup_num_steps": 2, "total_num_steps": 8}


def test_a_warmup_scheduler_with_no_warmup_step_is_refused_before_the_engine_is_built():
    """DeepSpeed's WarmupLR refuses warmup_num_steps 0 ("must be a positive integer") only when the engine is
    built; "auto" with neither warmup_steps nor warmup_ratio resolves to 0."""
    import pytest

    from kubetrain_trainer.args_values import ConfigError

    for kind in ("WarmupLR", "WarmupDecayLR"):
        config = {"zero_optimization": {"stage": 3},
                  "scheduler": {"type": kind, "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}}}
        with pytest.raises(ConfigError, match=r"warmup_num_steps is 0.*warmup_steps >= 1"):
            fill_auto(config, AutoValues.from_args(args(warmup_ratio=0.0), world_size=8))
        filled = fill_auto(config, AutoValues.from_args(args(warmup_ratio=0.0, warmup_steps=3), world_size=8))
        assert filled["scheduler"]["params"]["warmup_num_steps"] == 3
