"""The default optimizer and learning-rate schedules (overridable on the Trainer).

Weight decay is applied to weight matrices only: biases and the weights of
normalisation layers are left undecayed (as in the HF Trainer), because
shrinking them towards zero only fights the normalisation.
"""

from __future__ import annotations

import logging
import math
from functools import partial
from operator import itemgetter

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer
from torch.optim.lr_scheduler import LambdaLR

from .args import TrainingArguments

logger = logging.getLogger("kubetrain_trainer")

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._BatchNorm, nn.LocalResponseNorm)


def decay_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters that get weight decay: not biases, not normalisation weights."""
    names: set[str] = set()
    for module_name, module in model.named_modules():
        is_norm = isinstance(module, _NORMS) or "norm" in type(module).__name__.lower()
        for param_name, _ in module.named_parameters(recurse=False):
            if is_norm or param_name == "bias":
                continue
            names.add(f"{module_name}.{param_name}" if module_name else param_name)
    return names


def create_optimizer(model: nn.Module, args: TrainingArguments) -> torch.optim.Optimizer:
    decay = decay_parameter_names(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in params if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if args.optim == "sgd":
        return torch.optim.SGD(groups, lr=args.learning_rate)
    fused = args.optim == "adamw_torch_fused"
    if fused and args.strategy == "fsdp" and (args.fp16 or (args.fsdp_config or {}).get("mixed_precision") == "fp16"):
        # FSDP's ShardedGradScaler hands the fused kernel a found_inf of shape [1], which torch 2.13's fused
        # AdamW cannot subtract from its 0-dim step counts (it fails on the first step).
        logger.warning("fp16 with strategy fsdp: using the multi-tensor AdamW (adamw_torch); the fused kernel "
                       "does not work with FSDP's gradient scaler")
        fused = False
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, fused=True if fused else None)


def step_groups_at_once(optimizer: torch.optim.Optimizer) -> list[dict] | None:
    """The optimizer's groups as one group for `step`, where that changes no bit of the update; else None.

    The decay and no-decay groups stay two groups (the optimizer state in checkpoints keeps its layout),
    but with `weight_decay: 0` (the default) they differ in nothing else, and two groups cost two kernel
    calls per step. Adam/AdamW update each parameter from its own state and its group's settings alone, so
    one call over both groups gives the same result bit for bit. Only for the plain torch classes and
    without step hooks, which could observe the merged group while the step runs.
    """
    groups = optimizer.param_groups
    if (len(groups) < 2 or type(optimizer) not in _MERGEABLE or optimizer._optimizer_step_pre_hooks
            or optimizer._optimizer_step_post_hooks or torch_optimizer._global_optimizer_pre_hooks
            or torch_optimizer._global_optimizer_post_hooks):
        return None
    # Runs every step: the settings are compared as whole dicts (one C-level comparison per group), and only
    # plain numbers, flags, strings and tuples are merged (a tensor learning rate compares as a tensor).
    first = groups[0]
    settings = {**first, "params": None}
    if not _PLAIN_SETTINGS.issuperset(map(type, settings.values())):
        return None
    params = first["params"]
    for group in groups[1:]:
        other = {**group, "params": None}
        if not _PLAIN_SETTINGS.issuperset(map(type, other.values())) or other != settings:
            return None
        params = params + group["params"]
    return [{**first, "params": params}]


_MERGEABLE = (torch.optim.AdamW, torch.optim.Adam)
_PLAIN_SETTINGS = frozenset((float, int, bool, str, tuple, type(None)))


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def _constant_with_warmup(step: int, *, warmup: int, total: int) -> float:
    return step / max(1, warmup) if step < warmup else 1.0


def _constant(step: int, *, warmup: int, total: int) -> float:
    return 1.0


_SCHEDULES = {"linear": _linear, "cosine": _cosine, "constant": _constant,
              "constant_with_warmup": _constant_with_warmup}


class SharedLambdaLR(LambdaLR):
    """A `LambdaLR` whose parameter groups all follow one lambda (the Trainer's schedules).

    Its `step` evaluates the lambda once and sets each group's learning rate to `base_lr * factor`, the
    same expression and so the same bits as `LambdaLR.get_lr`; torch's own `step` (a context manager, a
    list per group, the lambda per group) costs a few µs more every training step. The first steps, a
    step to a given epoch, and tensor learning rates go through torch's `step` unchanged.
    """

    def step(self, epoch: int | None = None) -> None:
        groups, base_lrs = self.optimizer.param_groups, self.base_lrs
        if (epoch is not None or self._step_count <= 1 or len(groups) != len(base_lrs)
                or torch.Tensor in map(type, base_lrs) or torch.Tensor in map(type, map(_LR, groups))):
            return super().step(epoch)
        self._step_count += 1
        self.last_epoch += 1
        factor = self.lr_lambdas[0](self.last_epoch)
        for group, base_lr in zip(groups, base_lrs):
            group["lr"] = base_lr * factor
        self._last_lr = list(map(_LR, groups))


_LR = itemgetter("lr")


def create_scheduler(optimizer: torch.optim.Optimizer, args: TrainingArguments, num_training_steps: int) -> LambdaLR:
    warmup = args.warmup_for(num_training_steps)
    fn = partial(_SCHEDULES[args.lr_scheduler_type], warmup=warmup, total=num_training_steps)
    return SharedLambdaLR(optimizer, fn)
