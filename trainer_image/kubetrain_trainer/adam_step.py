"""A fused Adam/AdamW step called straight: torch's own kernel and arguments, without the Python around it.

`torch.optim.AdamW(fused=True).step()` spends much of a small model's step outside its kernel: a profiler
range, the hook loops, dynamo's guards, `_init_group` walking every parameter of every group to build six
lists, and the grouping of those lists by device and dtype. Measured inside a training step on 2 CPU cores
(a 1-layer GPT, ~30 tensors): 0.35 ms for `optimizer.step()`, 0.22 ms for the two calls it ends in; more
than all of the Trainer's own bookkeeping per step. Every list but the gradients holds the same tensors
every step (the state is updated in place), so `DirectAdamStep` builds them once, after the optimizer's own
first step has created the state, and then makes the calls `torch.optim.adam._fused_adam` makes:
`torch._foreach_add_` on the step counts and `torch._fused_adamw_` (`_fused_adam_` for Adam), under no_grad.
The same kernel on the same tensors with the same arguments: the same bits (tests/unit/trainer/test_adam_step.py).

It steps only where the result is certainly the optimizer's own; otherwise `step` returns False and the caller
calls `optimizer.step()`, which is always right:
- the plain torch `Adam`/`AdamW` class with `fused=True`, its `step` replaced neither on the instance nor on
  the class (the LR scheduler's step-tracking wrapper is torch's own and allowed);
- no optimizer hook (per optimizer or global), no gradient scaler's `grad_scale`/`found_inf`, no profiler
  recording (its trace keeps the `Optimizer.step` range);
- every parameter has a gradient this step (torch skips one without, and leaves its step count behind) and
  state from an earlier step; one device and dtype; no complex parameter;
- no amsgrad, capturable or differentiable; settings of plain types (checked each step: a tensor equal to
  the number it replaced compares equal); and nothing changed since the lists were built: the same
  `param_groups` and `state` objects, the same parameters in the same lists, the same state dict and tensors
  per parameter (identity checks at C speed), the same kernel-choosing settings (`_STRUCTURE`). `lr`, `betas`,
  `eps`, `weight_decay` and `maximize` are read each step, as torch reads them (schedules change them every
  step: OneCycleLR sets `betas`). A `load_state_dict`, a new group or a reset state rebuilds the lists from
  the next step of the optimizer's own.
Groups whose settings are all equal this step are updated in one call (elementwise: the same bits).
"""

from __future__ import annotations

import inspect
from itertools import chain, compress, repeat
from operator import eq, is_, is_not, itemgetter
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

_CLASSES = (torch.optim.AdamW, torch.optim.Adam)
_NUMBER = (float, int)
_NUMBERS = frozenset(_NUMBER)
_PLAIN = frozenset((float, int, bool, str, tuple, type(None)))


def _torch_wrapper_codes() -> tuple:
    probe = torch.optim.Optimizer.profile_hook_step(torch_optimizer._use_grad_for_differentiable(lambda self: None))
    return probe.__code__, probe.__wrapped__.__code__


_HOOK_CODE, _USE_GRAD_CODE = _torch_wrapper_codes()  # torch's profiler/hook wrapper and its no_grad wrapper
_ADAM_STEP_CODE = inspect.unwrap(torch.optim.Adam.step).__code__


def _runs_torch_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` runs torch's own `Adam.step` in torch's own wrappers, through the class or the
    LR scheduler's step counter (which calls the function it wrapped): no step patched on the instance or class."""
    own = vars(optimizer).get("step")
    if own is None:
        step = type(optimizer).step
    elif getattr(own, "_wrapped_by_lr_sched", False):
        step = getattr(own, "__wrapped__", None)
    else:
        return False
    inner = getattr(step, "__wrapped__", None)
    return (getattr(step, "__code__", None) is _HOOK_CODE and getattr(inner, "__code__", None) is _USE_GRAD_CODE
            and getattr(getattr(inner, "__wrapped__", None), "__code__", None) is _ADAM_STEP_CODE)


def _settings(group: dict) -> dict:
    """A group's settings (all but `params`, and the names torch keeps beside them for `named_parameters()`
    groups, which the step does not read): groups whose settings are equal are updated in one call."""
    return {**group, "params": None, "param_names": None}


_STRUCTURE = itemgetter("fused", "amsgrad", "capturable", "differentiable", "decoupled_weight_decay")
"""The settings that choose the kernel and its lists: they must not change. The others (`lr`, `betas`, `eps`,
`weight_decay`, `maximize`) are read each step, as torch's step reads them (schedules change them every step)."""
_KEYS = frozenset(("lr", "betas", "eps", "weight_decay", "maximize", "foreach", "fused", "amsgrad", "capturable",
                   "differentiable", "decoupled_weight_decay"))


class _Lists:
    """The optimizer's tensors as its fused step hands them to the kernel, built once."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.groups = optimizer.param_groups
        self.state = optimizer.state
        self.n_state = len(optimizer.state)
        self.step_attr = vars(optimizer).get("step")
        self.class_step = type(optimizer).step
        self.params = [group["params"] for group in self.groups]
        self.lengths = [len(params) for params in self.params]
        self.structure = [_STRUCTURE(group) for group in self.groups]
        per_group = [[optimizer.state[p] for p in params] for params in self.params]
        self.exp_avgs = [[s["exp_avg"] for s in states] for states in per_group]
        self.exp_avg_sqs = [[s["exp_avg_sq"] for s in states] for states in per_group]
        self.steps = [[s["step"] for s in states] for states in per_group]
        self.all_params = [p for params in self.params for p in params]
        self.all_exp_avgs = [t for ts in self.exp_avgs for t in ts]
        self.all_exp_avg_sqs = [t for ts in self.exp_avg_sqs for t in ts]
        self.all_steps = [t for ts in self.steps for t in ts]
        self.state_dicts = [optimizer.state[p] for p in self.all_params]
        self.kernel = torch._fused_adamw_ if self.groups[0]["decoupled_weight_decay"] else torch._fused_adam_


def _blocks(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    """Whether parameter `p` keeps `optimizer` from a direct step: no gradient this step (torch skips it), no
    state yet, or a kind the kernel call is not certain for."""
    state = optimizer.state.get(p)
    return (p.grad is None or not isinstance(state, dict) or not {"step", "exp_avg", "exp_avg_sq"} <= state.keys()
            or type(p) not in (torch.nn.Parameter, torch.Tensor) or p.is_complex())


def _eligible(optimizer: torch.optim.Optimizer) -> bool | tuple:
    """True where `optimizer`, as it stands after one step of its own, can be stepped straight (see the module);
    else False, or what keeps it from that as long as `_still_blocks` says so, looked at alone instead of by a walk
    of every parameter every step: the first parameter that `_blocks` it (a frozen one in the optimizer, for good),
    or two of different devices or dtypes (a bf16 model with fp32 norms: torch's step groups its lists by them)."""
    groups = optimizer.param_groups
    if (type(optimizer) not in _CLASSES or not groups or not _runs_torch_step(optimizer)
            or not all(map(_fits, groups)) or len({bool(group["decoupled_weight_decay"]) for group in groups}) != 1):
        return False
    first = place = None
    for group in groups:
        for p in group["params"]:
            if _blocks(optimizer, p):
                return (p,)
            if first is None:
                first, place = p, (p.device, p.dtype)
            elif (p.device, p.dtype) != place:
                return (first, p)
    return first is not None


def _fits(group: dict) -> bool:
    """A group's settings allow the direct step (`_usable`, and the kernel's flags as the lists are built)."""
    return (_KEYS <= group.keys() and group["fused"] is True and not group["amsgrad"] and not group["capturable"]
            and not group["differentiable"] and _usable(_settings(group)))


def _still_blocks(optimizer: torch.optim.Optimizer, found: tuple) -> bool:
    """Whether what `_eligible` found still keeps `optimizer` from a direct step. Where it no longer could (a
    parameter left the optimizer) it may answer True: then only torch's own step is made, which is always right."""
    if len(found) == 1:
        return _blocks(optimizer, found[0])
    a, b = found
    return a.device != b.device or a.dtype != b.dtype


def _usable(settings: dict) -> bool:
    """Settings of plain types (a tensor equal to the number it replaced compares equal: types are checked)."""
    return (type(settings["lr"]) in _NUMBER and _PLAIN.issuperset(map(type, settings.values()))
            and type(settings["betas"]) is tuple and _NUMBERS.issuperset(map(type, settings["betas"])))


class DirectAdamStep:
    """`step(optimizer)`: one fused Adam/AdamW step made straight, or False where only `optimizer.step()` is
    certainly right (then the caller makes it; the next call looks again)."""

    def __init__(self) -> None:
        self._lists: _Lists | None = None
        self._of: Any = None
        self._blocked: tuple | None = None  # (optimizer, what `_eligible` found in the way)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        if type(optimizer) not in _CLASSES:  # before any attribute: an engine's wrapper may have none of them
            self.forget()
            return False
        own = vars(optimizer)
        if ("grad_scale" in own or "found_inf" in own or optimizer._optimizer_step_pre_hooks
                or optimizer._optimizer_step_post_hooks or torch_optimizer._global_optimizer_pre_hooks
                or torch_optimizer._global_optimizer_post_hooks or torch._C._autograd._profiler_enabled()):
            return False  # torch's step for as long as they are there; the lists stay right (none rebuilt)
        blocked = self._blocked
        if blocked is not None:
            if blocked[0] is optimizer and _still_blocks(optimizer, blocked[1]):
                return False  # still blocked (frozen, two dtypes): no walk or check of every parameter every step
            self._blocked = None
        lists = self._lists
        alike = None if lists is None or self._of is not optimizer else self._check(optimizer, lists)
        if alike is None:
            self.forget()
            found = _eligible(optimizer)
            if found is True:  # after the optimizer's own step: its state exists
                self._lists, self._of = _Lists(optimizer), optimizer
            elif found is not False:
                self._blocked = (optimizer, found)
            return False
        grads = [p.grad for p in lists.all_params]
        if not all(map(is_not, grads, repeat(None))):
            # torch skips a parameter without a gradient: only its own step does the same. One frozen after its
            # state was made is looked at alone from now on (the lists are checked again once it has one).
            self._blocked = (optimizer, (next(compress(lists.all_params, map(is_, grads, repeat(None)))),))
            return False
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            groups = lists.groups
            if alike:
                self._call(lists, groups[0], lists.all_params, grads, lists.all_exp_avgs, lists.all_exp_avg_sqs,
                           lists.all_steps)
            else:
                start = 0
                for i, group in enumerate(groups):
                    end = start + lists.lengths[i]
                    if end > start:  # torch's `_fused_adam` returns at once for an empty group (foreach ops refuse it)
                        self._call(lists, group, lists.params[i], grads[start:end], lists.exp_avgs[i],
                                   lists.exp_avg_sqs[i], lists.steps[i])
                    start = end
        finally:
            torch._C._set_grad_enabled(prev)
        return True

    def forget(self) -> None:
        """Hold no tensor of the optimizer's any more: after its `load_state_dict` the lists hold the state it
        replaced (twice the model's size), alive until the next step rebuilds them, or for good if none follows."""
        self._lists = self._of = self._blocked = None

    @staticmethod
    def _call(lists: _Lists, group: dict, params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1)
        lists.kernel(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=group["lr"], beta1=beta1,
                     beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                     grad_scale=None, found_inf=None)

    @staticmethod
    def _check(optimizer: torch.optim.Optimizer, lists: _Lists) -> bool | None:
        """None where the lists may no longer be right; else whether all groups have equal settings (one call)."""
        own = vars(optimizer)
        if (optimizer.param_groups is not lists.groups or optimizer.state is not lists.state
                or len(lists.state) != lists.n_state or own.get("step") is not lists.step_attr
                or type(optimizer).step is not lists.class_step or len(lists.groups) != len(lists.params)):
            return None
        settings = []
        for group, params, length, structure in zip(lists.groups, lists.params, lists.lengths, lists.structure):
            current = _settings(group)
            try:
                if (group["params"] is not params or len(params) != length or _STRUCTURE(group) != structure
                        or not _usable(current)):
                    return None
            except KeyError:  # a setting deleted: torch's step says what is wrong
                return None
            settings.append(current)
        # One parameter's entry or state replaced (a layer's moments or step count reset, a parameter swapped
        # in its list): the lists would step tensors the optimizer no longer holds. Identity, at C speed.
        dicts = lists.state_dicts
        if not (all(map(is_, chain.from_iterable(lists.params), lists.all_params))
                and all(map(is_, map(lists.state.get, lists.all_params), dicts))
                and all(map(is_, map(dict.get, dicts, repeat("step")), lists.all_steps))
                and all(map(is_, map(dict.get, dicts, repeat("exp_avg")), lists.all_exp_avgs))
                and all(map(is_, map(dict.get, dicts, repeat("exp_avg_sq")), lists.all_exp_avg_sqs))):
            return None
        return all(map(eq, settings[1:], repeat(settings[0])))

