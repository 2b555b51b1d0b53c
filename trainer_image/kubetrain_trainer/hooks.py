"""Forward-pass add-ons the arguments switch on: autocast (bf16/fp16) and NEFTune noise.

Kept apart from the loop because each is a small object the loop only enters
or removes: a context factory, and a forward hook with `.remove()` (a no-op
handle when NEFTune is off, so the loop has no `if enabled:` branch).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable

import torch
from torch import nn

from .args import TrainingArguments


def autocast_factory(args: TrainingArguments, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    if args.bf16:
        return functools.partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)
    if args.fp16:
        return functools.partial(torch.autocast, device_type=device.type, dtype=torch.float16)
    return contextlib.nullcontext


class NoHook:
    def remove(self) -> None: ...


def neftune_hook(model: nn.Module, alpha: float | None):
    """NEFTune noise on `model`'s input embeddings while training; returns a handle with `.remove()`."""
    if not alpha:
        return NoHook()
    embeddings = model.get_input_embeddings()

    def add_noise(module, inputs, output):
        if module.training:
            magnitude = alpha / math.sqrt(output.size(-2) * output.size(-1))
            output = output + torch.zeros_like(output).uniform_(-magnitude, magnitude)
        return output
    return embeddings.register_forward_hook(add_noise)
