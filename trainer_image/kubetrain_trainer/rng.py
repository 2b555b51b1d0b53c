"""Seeding and per-rank RNG state, so that a resumed run draws the same random numbers.

Dropout, NEFTune noise and anything the user's code draws come from the
global generators (python, numpy, torch CPU, CUDA). Each rank saves its own
state as `rng_state_<rank>.pth`; the data order never uses these generators
(the sampler has its own seeded generator), so restoring them is enough.

The HF Trainer names the file `rng_state.pth` when it runs one process, and
saves one device's CUDA state there unless it runs distributed. A 1-process
run writes that name too (the same state) and reads it when its own is
missing, so checkpoints resume either way between the two.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger("kubetrain_trainer")

HF_SINGLE_PROCESS = "rng_state.pth"
"""The HF Trainer's name for the state of its one process."""


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rng_state_{rank}.pth"


def capture() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, torch.Tensor):  # one device's (an HF Trainer that did not run distributed)
            torch.cuda.set_rng_state(cuda)
        else:
            torch.cuda.set_rng_state_all(cuda)


def save(directory: str | Path, rank: int, world_size: int = 1) -> None:
    state = capture()
    torch.save(state, rng_file(directory, rank))
    if world_size == 1:  # HF's name too: the HF Trainer resumes a 1-process checkpoint from it
        if "cuda" in state:  # as HF saves it when not distributed: the current device's state
            state = {**state, "cuda": torch.cuda.get_rng_state()}
        torch.save(state, Path(directory) / HF_SINGLE_PROCESS)


def load(directory: str | Path, rank: int, world_size: int = 1) -> bool:
    """Restore this rank's RNG state; False (and a warning) when the checkpoint has none for it."""
    path = rng_file(directory, rank)
    if not path.is_file() and world_size == 1:  # an HF Trainer's 1-process checkpoint
        path = Path(directory) / HF_SINGLE_PROCESS
    if not path.is_file():
        logger.warning("no RNG state for rank %d in %s: the resumed run will not be bitwise reproducible",
                       rank, directory)
        return False
    # weights_only=False: the python/numpy states are tuples with numpy arrays (written by us, or by HF).
    restore(torch.load(path, weights_only=False))
    return True
