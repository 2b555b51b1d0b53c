"""A one-weight model that records the `x` of every training row it sees: the tests of which rows reach the
model (iterable sets, dispatching, dataloader workers) read `model.seen`. The multi-process scripts of those
tests import it too; their subprocesses get tests/ on PYTHONPATH (`env_with_tests`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

TESTS = str(Path(__file__).resolve().parent)


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            self.seen += [int(v) for v in x.tolist()]
        return {"loss": (self.w * x).mean()}


def env_with_tests(env: dict[str, str]) -> dict[str, str]:
    """`env` with tests/ first on PYTHONPATH, for a subprocess script that imports this module."""
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH")) if p)}
