"""Fixtures of the sharded-strategy tests.

`zero3_ready`: on a CPU-only machine DeepSpeed JIT-compiles its shared-memory
communication op (`deepspeed_shm_comm`) the first time an engine starts
(minutes on 2 cores; cached under ~/.cache/torch_extensions afterwards).
Building it once here, before any test spawns ranks, keeps that cost out of
the per-run timeouts and stops two ranks from racing for the build lock.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def zero3_ready() -> None:
    import torch

    if torch.cuda.is_available():
        return  # the CUDA accelerator uses NCCL: nothing to build
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        builder.load()
