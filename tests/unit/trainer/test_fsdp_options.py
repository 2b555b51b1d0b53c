"""FSDP options and the choice of what to shard: pure, no process group (fast, despite the folder)."""

from __future__ import annotations

import pytest
from torch import nn

from kubetrain_trainer.args import ConfigError
from kubetrain_trainer.models import TinyGPT, TinyGPTConfig
from kubetrain_trainer.strategies import get_strategy
from kubetrain_strategy_harness import TinyLM
from kubetrain_trainer.strategies.fsdp import FSDPOptions, modules_to_shard


def test_options_accept_the_crd_spelling_and_the_python_one():
    crd = FSDPOptions.from_dict({"reshardAfterForward": False, "cpuOffload": True, "mixedPrecision": "bf16"})
    assert crd == FSDPOptions(reshard_after_forward=False, cpu_offload=True, mixed_precision="bf16")
    assert FSDPOptions.from_dict({"shard_modules": "Block"}).shard_modules == ("Block",)


@pytest.mark.parametrize("options, message", [
    ({"reshard_after_forwad": True}, "unknown option 'reshard_after_forwad'; did you mean 'reshard_after_forward'"),
    ({"mixed_precision": "fp8"}, "mixed_precision: 'fp8' is not one of none, bf16, fp16"),
    ({"cpu_offload": "yes"}, "cpu_offload: expected true or false"),
])
def test_bad_options_fail_at_construction_naming_the_fix(options, message):
    with pytest.raises(ConfigError, match=message):
        get_strategy("fsdp", **options)


def test_transformer_blocks_are_sharded_one_by_one():
    gpt = TinyGPT(TinyGPTConfig(n_layers=3))
    assert modules_to_shard(gpt) == list(gpt.blocks)
    lm = TinyLM()
    assert modules_to_shard(lm) == list(lm.layers)


def test_without_blocks_the_top_level_children_with_parameters_are_sharded():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert modules_to_shard(model) == [model[0], model[2]]


def test_a_module_with_a_tied_parameter_stays_in_the_root_group():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False))
    model[2].weight = model[0].weight  # tied input/output embeddings
    assert modules_to_shard(model) == [model[1]]


def test_named_classes_are_sharded_deepest_first():
    gpt = TinyGPT(TinyGPTConfig(n_layers=2))
    picked = modules_to_shard(gpt, ("Block", "Sequential"))
    assert picked[:2] == [gpt.blocks[0].mlp, gpt.blocks[1].mlp] and picked[2:] == list(gpt.blocks)


def test_trainer_rejects_a_prebuilt_optimizer_with_sharding(tmp_path):
    import torch

    from kubetrain_trainer import ConfigError, Trainer, TrainingArguments

    model = torch.nn.Linear(2, 1)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, strategy="fsdp")
    with pytest.raises(ConfigError, match="optimizers: .*create_optimizer"):
        Trainer(model, args, train_dataset=[{"x": torch.zeros(2)}],
                optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
