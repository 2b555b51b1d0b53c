"""`DirectAdamStep` gives torch's own fused Adam/AdamW step bit for bit, and hands every other case back.

Each test drives two copies of one optimizer through the same gradients: the reference with
`optimizer.step()` only, the other as the DDP strategy does (`DirectAdamStep.step`, and
`optimizer.step()` where it returns False). Parameters and every state tensor must end equal, and the
test counts how often the direct call was made, so a check that never lets it step fails too.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from functools import partial, wraps

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from kubetrain_trainer import Trainer, adam_step
from kubetrain_trainer.adam_step import DirectAdamStep
from kubetrain_trainer.optim import _SCHEDULES, SharedLambdaLR, create_optimizer
from kubetrain_trainer.strategies.ddp import DDPStrategy


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((5, 3), (7,), (3,), (2, 2))]


def _optimizer(kind=torch.optim.AdamW, groups: tuple[dict, dict] | None = None, **kwargs) -> torch.optim.Optimizer:
    params = _params()
    if groups is None:
        return kind(params, lr=1e-2, fused=True, **kwargs)
    first, second = groups
    return kind([{"params": params[:2], **first}, {"params": params[2:], **second}], lr=1e-2, fused=True, **kwargs)


def _grads(opt: torch.optim.Optimizer, step: int, skip: int | None = None) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(q for group in opt.param_groups for q in group["params"]):
        p.grad = None if i == skip else torch.randn(p.shape, generator=gen).to(p.dtype)


class _Driven:
    """An optimizer stepped as the DDP strategy steps it; `direct` counts the steps made straight."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt, self.stepper, self.direct = opt, DirectAdamStep(), 0

    def step(self) -> None:
        if self.stepper.step(self.opt):
            self.direct += 1
        else:
            self.opt.step()


def _assert_same(reference: torch.optim.Optimizer, other: torch.optim.Optimizer) -> None:
    for a, b in zip(reference.param_groups, other.param_groups):
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q)
    sa, sb = reference.state_dict(), other.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for key, state in sa["state"].items():
        for name, value in state.items():
            assert torch.equal(value, sb["state"][key][name]), (key, name)


def _run(make, steps: int = 8, between=None, skip_at: dict | None = None) -> int:
    """`steps` steps of a reference and a driven copy of `make()`; `between(step, reference, driven)` may edit
    both the same way before each step. Returns how many steps were made straight."""
    reference, opt = make(), make()
    driven = _Driven(opt)
    for step in range(steps):
        if between is not None:
            between(step, reference, opt)
        skip = (skip_at or {}).get(step)
        _grads(reference, step, skip)
        _grads(opt, step, skip)
        reference.step()
        driven.step()
        _assert_same(reference, opt)
    return driven.direct


@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam], ids=["adamw", "adam"])
@pytest.mark.parametrize("case", ["one group", "two alike", "weight decay differs", "lr differs", "maximize",
                                  "weight decay"])
def test_the_direct_step_updates_bit_for_bit_like_the_optimizers_own(kind, case):
    groups = {"one group": None, "two alike": ({}, {}), "weight decay differs": ({"weight_decay": 0.1}, {}),
              "lr differs": ({}, {"lr": 3e-3}), "maximize": None, "weight decay": None}[case]
    kwargs = {"maximize": True} if case == "maximize" else {"weight_decay": 0.05} if case == "weight decay" else {}
    direct = _run(partial(_optimizer, kind, groups, **kwargs))
    assert direct == 6  # the first two steps are the optimizer's own (its state is made in the first)


@pytest.mark.parametrize("schedule", ["linear", "one cycle"])
def test_a_schedule_changing_the_rate_every_step_is_followed(schedule):
    # OneCycleLR (cycle_momentum, its default) sets each group's betas every step too.
    def make():
        opt = _optimizer(groups=({}, {}))
        opt.scheduler = (SharedLambdaLR(opt, partial(_SCHEDULES["linear"], warmup=3, total=12))  # wraps opt.step
                         if schedule == "linear" else OneCycleLR(opt, max_lr=1e-2, total_steps=12))
        return opt

    reference, opt = make(), make()
    driven = _Driven(opt)
    for step in range(12):
        _grads(reference, step)
        _grads(opt, step)
        reference.step()
        driven.step()
        reference.scheduler.step()
        opt.scheduler.step()
        _assert_same(reference, opt)
    assert driven.direct == 10


def test_betas_and_weight_decay_changed_every_step_are_followed():
    # A weight decay schedule (DINO's), a momentum schedule: the lists stay, the settings are read each step,
    # and groups are merged only while they are alike.
    def between(step, reference, opt):
        for o in (reference, opt):
            o.param_groups[0]["betas"] = (0.95 - 0.01 * step, 0.999)
            o.param_groups[1]["betas"] = (0.95 - 0.01 * (step % 3), 0.999)
            o.param_groups[1]["weight_decay"] = 0.01 * step

    assert _run(partial(_optimizer, groups=({}, {})), steps=8, between=between) == 6


def test_a_step_with_a_parameter_without_gradient_is_the_optimizers_own():
    # torch skips that parameter (its step count stays behind); only its own step does the same.
    assert _run(partial(_optimizer, groups=({}, {})), steps=8, skip_at={4: 1, 5: 3}) == 4


def test_an_empty_group_beside_one_with_other_settings_is_skipped_as_torch_skips_it():
    # HF-style decay / no-decay groups, unfiltered: a model without biases or norms (or LoRA) leaves one empty.
    def make():
        return torch.optim.AdamW([{"params": _params(), "weight_decay": 0.1}, {"params": [], "weight_decay": 0.0}],
                                 lr=1e-2, fused=True)

    assert _run(make) == 6


def test_a_frozen_parameter_in_the_optimizer_is_looked_at_alone(monkeypatch):
    # AdamW(model.parameters()) with a frozen layer: torch's step every time, without a walk of every parameter
    # every step to find that out again; the direct step once it is unfrozen.
    walks = []
    real = adam_step._eligible
    monkeypatch.setattr(adam_step, "_eligible", lambda optimizer: walks.append(1) or real(optimizer))
    assert _run(partial(_optimizer, groups=({}, {})), steps=11, skip_at=dict.fromkeys(range(8), 2)) == 1
    # Step 0 (no state yet) and step 1 (the frozen one found) walk; step 8 makes its state, step 9 builds.
    assert len(walks) == 3


def test_a_parameter_frozen_after_its_state_was_made_is_looked_at_alone(monkeypatch):
    # A layer frozen mid-training (its Adam state stays in the optimizer): torch's step every time, without the
    # checks of every parameter's lists every step on top of it; the direct step once it is unfrozen.
    checks = []
    real = DirectAdamStep._check
    monkeypatch.setattr(DirectAdamStep, "_check", staticmethod(lambda o, lists: checks.append(1) or real(o, lists)))
    assert _run(partial(_optimizer, groups=({}, {})), steps=12, skip_at=dict.fromkeys(range(4, 10), 2)) == 4
    assert len(checks) == 5  # steps 2-3 (straight), 4 (the gradient found missing), 10-11 (straight again)


def test_a_model_of_two_dtypes_is_looked_at_alone(monkeypatch):
    # A bf16 model with fp32 norms (HF's `_keep_in_fp32_modules`): torch's step every time (its lists are grouped
    # by dtype), without a walk of every parameter every step on top of it to find that out again.
    def make():
        params = _params()
        return torch.optim.AdamW([{"params": params[:2]},
                                  {"params": [torch.nn.Parameter(p.detach().bfloat16()) for p in params[2:]]}],
                                 lr=1e-2, fused=True)

    walks = []
    real = adam_step._eligible
    monkeypatch.setattr(adam_step, "_eligible", lambda optimizer: walks.append(1) or real(optimizer))
    assert _run(make, steps=8) == 0
    assert len(walks) == 2  # step 0 (no state yet), step 1 (the two dtypes found); then the two alone


@pytest.mark.parametrize("edit", ["betas", "new group", "load_state_dict", "lr as a tensor", "state cleared",
                                  "betas as tensors", "weight decay as a tensor"])
def test_an_edit_between_steps_hands_the_step_back_then_resumes(edit):
    extra = torch.nn.Parameter(torch.ones(4))

    def between(step, reference, opt):
        if step != 4:
            return
        for o in (reference, opt):
            if edit == "betas":
                o.param_groups[0]["betas"] = (0.8, 0.99)
            elif edit == "new group":
                o.add_param_group({"params": [copy.deepcopy(extra)]})
            elif edit == "load_state_dict":
                o.load_state_dict(copy.deepcopy(o.state_dict()))
            elif edit == "lr as a tensor":
                o.param_groups[1]["lr"] = torch.tensor(5e-3)
            elif edit == "betas as tensors":  # equal to the floats they replace (compared in float32)
                o.param_groups[1]["betas"] = (torch.tensor(0.9), torch.tensor(0.999))
            elif edit == "weight decay as a tensor":
                o.param_groups[1]["weight_decay"] = torch.tensor(1e-2)
            else:
                o.state.clear()

    direct = _run(partial(_optimizer, groups=({}, {})), steps=10, between=between)
    # Steps 2-3 straight, step 4 the optimizer's own (straight for new betas: read each step); then straight
    # again from step 5 where the state is there to rebuild from, from step 6 where step 4 had to make it (a new
    # group's, a cleared state), never with a tensor setting.
    assert direct == {"betas": 8, "load_state_dict": 7, "new group": 6, "state cleared": 6, "lr as a tensor": 2,
                      "betas as tensors": 2, "weight decay as a tensor": 2}[edit]


@pytest.mark.parametrize("edit", ["moments reset", "step count reset", "state replaced", "state cleared",
                                  "parameter swapped"])
def test_an_edit_of_one_parameters_state_or_list_entry_is_followed(edit):
    # What resetting one layer's Adam state (or replacing a parameter) does: the lists hold other tensors now.
    def between(step, reference, opt):
        if step != 4:
            return
        for o in (reference, opt):
            group = o.param_groups[1]
            p = group["params"][0]
            state = o.state[p]
            if edit == "moments reset":
                state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
            elif edit == "step count reset":
                state["step"] = torch.zeros((), dtype=torch.float32)
            elif edit == "state replaced":
                o.state[p] = {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            elif edit == "state cleared":
                state.clear()
            else:
                group["params"][0] = torch.nn.Parameter(p.detach() + 1)
                o.state[group["params"][0]] = o.state.pop(p)
                p.grad = torch.ones_like(p)  # the parameter left behind keeps a gradient: it must not be stepped

    direct = _run(partial(_optimizer, groups=({}, {})), steps=10, between=between)
    assert direct == (6 if edit == "state cleared" else 7)  # the optimizer's own step where the lists change


@pytest.mark.parametrize("case", ["step hook", "global pre hook", "global post hook", "profiler", "grad scaler"])
def test_hooks_the_profiler_and_a_scaler_get_the_optimizers_own_step(case):
    opt = _optimizer()
    driven = _Driven(opt)
    for step in range(3):
        _grads(opt, step)
        driven.step()
    assert driven.direct == 1
    _grads(opt, 3)
    if case == "step hook":
        calls = []
        handle = opt.register_step_post_hook(lambda *a: calls.append(1))
        driven.step()
        handle.remove()
        assert calls == [1]
    elif case in ("global pre hook", "global post hook"):
        calls = []
        register = register_optimizer_step_pre_hook if "pre" in case else register_optimizer_step_post_hook
        handle = register(lambda *a: calls.append(1))
        try:
            driven.step()
        finally:
            handle.remove()
        assert calls == [1]
    elif case == "profiler":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            driven.step()
        assert any("Optimizer.step#AdamW.step" in e.name for e in prof.events())
    else:
        opt.grad_scale = torch.tensor(1.0)  # what GradScaler lends a fused optimizer during its step
        try:
            assert driven.stepper.step(opt) is False
        finally:
            del opt.grad_scale
        driven.step()
    assert driven.direct == 1 + (case == "grad scaler")
    _grads(opt, 4)
    driven.step()  # nothing left in the way: straight again
    assert driven.direct == 2 + (case == "grad scaler")


@pytest.mark.parametrize("case", ["step hook", "global post hook", "profiler"])
def test_a_hook_or_profiler_kept_for_many_steps_costs_no_rebuild(case):
    # A hook a library keeps registered: every step is torch's, with nothing built and dropped on top of it.
    opt = _optimizer(groups=({}, {}))
    driven = _Driven(opt)
    for step in range(3):
        _grads(opt, step)
        driven.step()
    lists, calls = driven.stepper._lists, []
    with contextlib.ExitStack() as stack:
        if case == "profiler":
            stack.enter_context(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]))
        else:
            register = opt.register_step_post_hook if case == "step hook" else register_optimizer_step_post_hook
            stack.callback(register(lambda *a: calls.append(1)).remove)
        for step in range(3, 7):
            _grads(opt, step)
            driven.step()
            assert driven.stepper._lists is lists
    assert calls == ([] if case == "profiler" else [1] * 4)
    _grads(opt, 7)
    driven.step()
    assert driven.direct == 2


@pytest.mark.parametrize("case", ["not fused", "amsgrad", "a subclass", "step replaced", "sgd", "two dtypes"])
def test_optimizers_it_cannot_step_alike_are_always_stepped_by_their_own_step(case):
    def make():
        if case == "not fused":
            return torch.optim.AdamW(_params(), lr=1e-2)
        if case == "amsgrad":
            return _optimizer(amsgrad=True)
        if case == "a subclass":
            return type("MyAdamW", (torch.optim.AdamW,), {})(_params(), lr=1e-2, fused=True)
        if case == "step replaced":
            opt = _optimizer()
            own = opt.step
            opt.step = lambda *a, **k: own(*a, **k)
            return opt
        if case == "sgd":
            return torch.optim.SGD(_params(), lr=1e-2)
        params = _params()
        return torch.optim.AdamW([{"params": params[:2]}, {"params": [torch.nn.Parameter(p.detach().double()) for p in params[2:]]}],
                                 lr=1e-2, fused=True)

    assert _run(make, steps=5) == 0


@pytest.mark.parametrize("when", ["before", "after its first steps"])
def test_a_step_replaced_on_the_class_is_always_called(when, monkeypatch):
    # Instrumentation patching `AdamW.step` for every instance: torch's `opt.step()` runs it, so must we.
    calls = []
    own = torch.optim.AdamW.step

    @wraps(own)
    def patched(*args, **kwargs):
        calls.append(1)
        return own(*args, **kwargs)

    if when == "before":
        monkeypatch.setattr(torch.optim.AdamW, "step", patched)
    opt = _optimizer()
    driven = _Driven(opt)
    for step in range(6):
        if step == 3 and when != "before":
            monkeypatch.setattr(torch.optim.AdamW, "step", patched)
        _grads(opt, step)
        driven.step()
    assert len(calls) == (6 if when == "before" else 3)
    assert driven.direct == (0 if when == "before" else 1)


def test_loading_a_checkpoint_frees_the_state_it_replaces(tiny_gpt, tokens, make_args, tmp_path):
    """`load_best_model_at_end` loads the optimizer state last: nothing steps after it, so lists still holding
    the replaced moments would keep a second copy of them (twice the model's size) alive with the Trainer."""
    args = make_args()
    strategy = DDPStrategy()
    strategy.prepare(tiny_gpt(dropout=0.0), args=args, num_training_steps=4,
                     create_optimizer=partial(create_optimizer, args=args), create_scheduler=lambda optimizer: None)
    batch = {k: v.unsqueeze(0) for k, v in tokens(4)[0].items()}
    for _ in range(3):
        strategy.backward(strategy.unwrap()(**batch)["loss"])
        strategy.optimizer_step()
    assert strategy._direct._lists is not None  # the third step was made straight
    strategy.save_checkpoint(tmp_path)
    old = [weakref.ref(t) for state in strategy._optimizer.state.values() for t in state.values()]
    strategy.load_checkpoint(tmp_path)
    gc.collect()
    assert [t for t in old if t() is not None] == []


def test_an_object_that_is_no_torch_optimizer_is_handed_back():
    class Wrapped:  # a ready-made optimizer wrapper without torch's attributes (nor a __dict__)
        __slots__ = ("optimizer",)

    assert DirectAdamStep().step(Wrapped()) is False


def test_a_trainer_run_is_the_same_with_and_without_the_direct_step(tiny_gpt, tokens, make_args, monkeypatch,
                                                                   tmp_path):
    """A whole run (two groups, a linear schedule, clipping, a checkpoint) ends with the same weights and
    optimizer state either way, and the direct step made all but the first two steps."""
    made = []
    real = DirectAdamStep.step

    def counting(self, optimizer):
        stepped = real(self, optimizer)
        made.append(stepped)
        return stepped

    def train(direct: bool, out: str):
        out = str(tmp_path / out)
        monkeypatch.setattr(DirectAdamStep, "step", counting if direct else lambda self, optimizer: False)
        trainer = Trainer(model=tiny_gpt(dropout=0.0), args=make_args(output_dir=out, max_steps=8, weight_decay=0.1,
                                                                      save_steps=4),
                          train_dataset=tokens(64))
        assert trainer.args.optim == "adamw_torch_fused"
        trainer.train()
        return trainer

    straight, own = train(True, "straight"), train(False, "own")
    assert made == [False, False] + [True] * 6
    assert len(straight.optimizer.param_groups) == 2
    for (name, p), (_, q) in zip(straight.model.named_parameters(), own.model.named_parameters()):
        assert torch.equal(p, q), name
    _assert_same(own.optimizer, straight.optimizer)
    assert isinstance(straight.lr_scheduler, LambdaLR)


def test_an_optimizer_of_named_parameters_is_stepped_straight_too():
    def make():
        return torch.optim.AdamW([(f"p{i}", p) for i, p in enumerate(_params())], lr=1e-2, fused=True)

    assert "param_names" in make().param_groups[0]
    assert _run(make) == 6
