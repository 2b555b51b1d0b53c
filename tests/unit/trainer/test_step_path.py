"""The per-step shortcuts of the training loop give exactly what the general path gives.

Each one exists only to take Python work out of every step (issue 12's overhead goal): one AdamW call
over both parameter groups, one evaluation of the shared schedule, a batch kept when it is already on
the device, the loss sums kept as numbers, and callback dispatch cached per event. These tests pin the
results to torch's own path, bit for bit, and check that every unusual case falls back to it.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.optimizer import register_optimizer_step_post_hook

from kubetrain_trainer import Trainer, TrainerCallback
from kubetrain_trainer.callbacks import CallbackHandler, TrainerControl
from kubetrain_trainer.data import to_device
from kubetrain_trainer.optim import SharedLambdaLR, _SCHEDULES, step_groups_at_once
from kubetrain_trainer.state import TrainerState


def _two_groups(seed: int = 0, fused: bool | None = True, **second) -> torch.optim.AdamW:
    torch.manual_seed(seed)
    decay = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    rest = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]
    groups = [{"params": decay, "weight_decay": 0.0}, {"params": rest, "weight_decay": 0.0, **second}]
    return torch.optim.AdamW(groups, lr=1e-2, fused=fused)


def _step_merged(opt: torch.optim.Optimizer) -> None:
    merged = step_groups_at_once(opt)
    assert merged is not None
    groups, opt.param_groups = opt.param_groups, merged
    try:
        opt.step()
    finally:
        opt.param_groups = groups


def _fill_grads(opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("fused", [True, None], ids=["fused", "foreach"])
def test_one_adamw_call_over_both_groups_updates_bit_for_bit_like_two(fused):
    plain, merged = _two_groups(fused=fused), _two_groups(fused=fused)
    for step in range(6):
        _fill_grads(plain, step)
        _fill_grads(merged, step)
        plain.step()
        _step_merged(merged)
    for a, b in zip(plain.param_groups, merged.param_groups):
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q)
    # The checkpoint layout is the two groups' (the merged group was only lent to the step).
    assert len(merged.param_groups) == 2
    sa, sb = plain.state_dict(), merged.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for key in sa["state"]:
        for name, value in sa["state"][key].items():
            assert torch.equal(value, sb["state"][key][name]), (key, name)


def test_groups_merge_into_one_with_the_first_groups_settings():
    opt = _two_groups()
    (group,) = step_groups_at_once(opt)
    assert group["params"] == opt.param_groups[0]["params"] + opt.param_groups[1]["params"]
    assert {k: v for k, v in group.items() if k != "params"} == \
        {k: v for k, v in opt.param_groups[0].items() if k != "params"}


@pytest.mark.parametrize("case", ["weight decay differs", "tensor lr in the second group",
                                  "multi-element tensor setting", "tensor lr in the first group"])
def test_groups_that_differ_or_hold_tensors_are_stepped_apart(case):
    if case == "weight decay differs":
        opt = _two_groups(weight_decay=0.01)
    elif case == "tensor lr in the second group":
        opt = _two_groups(fused=None, lr=torch.tensor(1e-2))
    elif case == "multi-element tensor setting":
        opt = _two_groups()
        opt.param_groups[1]["custom"] = torch.ones(3)
        opt.param_groups[0]["custom"] = 1.0
    else:
        opt = _two_groups(fused=None)
        opt.param_groups[0]["lr"] = torch.tensor(1e-2)
    assert step_groups_at_once(opt) is None


def test_hooks_optimizers_and_single_groups_are_not_merged():
    opt = _two_groups()
    handle = opt.register_step_pre_hook(lambda *a: None)
    assert step_groups_at_once(opt) is None
    handle.remove()
    handle = register_optimizer_step_post_hook(lambda *a: None)
    try:
        assert step_groups_at_once(opt) is None
    finally:
        handle.remove()
    assert step_groups_at_once(opt) is not None
    sgd = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.ones(1))]},
                           {"params": [torch.nn.Parameter(torch.ones(1))]}], lr=0.1)
    assert step_groups_at_once(sgd) is None
    single = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])
    assert step_groups_at_once(single) is None


@pytest.mark.parametrize("schedule", sorted(_SCHEDULES))
def test_shared_lambda_schedule_sets_the_same_rates_as_lambda_lr(schedule):
    fn = partial(_SCHEDULES[schedule], warmup=7, total=60)
    reference, shared = _two_groups(), _two_groups()
    reference.param_groups[1]["lr"] = shared.param_groups[1]["lr"] = 3e-3  # another base rate
    torch_lr, ours = LambdaLR(reference, fn), SharedLambdaLR(shared, fn)
    for _ in range(70):
        reference.step()
        shared.step()
        torch_lr.step()
        ours.step()
        assert ours.get_last_lr() == torch_lr.get_last_lr()
        assert [g["lr"] for g in shared.param_groups] == [g["lr"] for g in reference.param_groups]
    assert ours.state_dict() == torch_lr.state_dict()


def test_shared_lambda_schedule_with_tensor_rates_takes_torchs_step():
    fn = partial(_SCHEDULES["linear"], warmup=0, total=10)
    opt = _two_groups(fused=None)
    for group in opt.param_groups:
        group["lr"] = torch.tensor(1e-2)
    lr_tensor = opt.param_groups[0]["lr"]
    sched = SharedLambdaLR(opt, fn)
    for _ in range(3):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] is lr_tensor  # filled in place, as torch does
    assert math.isclose(float(lr_tensor), 1e-2 * 7 / 10, rel_tol=1e-6)


def test_a_batch_already_on_the_device_keeps_its_tensors_and_any_other_is_moved():
    cpu = torch.device("cpu")
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.zeros(2, 3)}
    kept = to_device(batch, cpu)
    assert kept == batch and all(kept[k] is batch[k] for k in batch)
    kept.pop("labels")  # an override that pops the labels leaves the loader's batch whole
    assert "labels" in batch
    mixed = {"input_ids": torch.ones(2), "meta": [torch.zeros(1), 3], "n": 4}
    moved = to_device(mixed, cpu)
    assert moved is not mixed and moved["n"] == 4 and moved["meta"][1] == 3
    assert torch.equal(moved["input_ids"], mixed["input_ids"])
    elsewhere = to_device(batch, torch.device("meta"))
    assert elsewhere is not batch and {t.device.type for t in elsewhere.values()} == {"meta"}
    assert to_device({}, cpu) == {}


def test_callback_dispatch_follows_edits_of_the_callback_list_in_place():
    seen = []

    class Probe(TrainerCallback):
        def __init__(self, name):
            self.name = name

        def on_step_end(self, args, state, control, **kwargs):
            seen.append((self.name, sorted(kwargs)))

    handler = CallbackHandler([TrainerCallback(), Probe("a")], model="m")
    state, control = TrainerState(max_steps=10), TrainerControl()
    handler.on_step_end(None, state, control)
    handler.callbacks.append(Probe("b"))  # edited in place, as HF code does
    handler.on_step_end(None, state, control)
    del handler.callbacks[1]
    handler.on_step_end(None, state, control, extra=1)
    assert seen == [("a", ["model"]), ("a", ["model"]), ("b", ["model"]), ("b", ["extra", "model"])]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_logged_losses_are_the_means_of_the_step_losses(tiny_gpt, tokens, make_args, accumulation):
    steps = []
    trainer = Trainer(model=tiny_gpt(dropout=0.0), args=make_args(max_steps=6, logging_steps=3, save_strategy="no",
                                                                  gradient_accumulation_steps=accumulation),
                      train_dataset=tokens(48))
    original = trainer.training_step

    def recording_step(model, inputs, num_items_in_batch=None):
        loss = original(model, inputs)
        steps.append(loss.item())
        return loss

    trainer.training_step = recording_step
    out = trainer.train()
    # A step's loss is the sum of its micro-batches' (each divided by their count), in float32.
    per_step = [float(torch.tensor(steps[i:i + accumulation], dtype=torch.float32).sum())
                for i in range(0, len(steps), accumulation)]
    assert len(per_step) == 6
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged == pytest.approx([sum(per_step[:3]) / 3, sum(per_step[3:6]) / 3], rel=1e-6)
    assert out.training_loss == pytest.approx(sum(per_step) / 6, rel=1e-6)
