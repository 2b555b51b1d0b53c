"""Helpers for the trainer unit tests: tiny models, tiny data, one CPU thread.

Everything here trains for real (a few steps of a tiny model on CPU); the
fixtures only keep the sizes small enough for the tests to take seconds.
"""

from __future__ import annotations

import socket

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def tiny_gpt():
    """Factory: a seeded TinyGPT small enough to train in milliseconds per step."""
    from kubetrain_trainer.models import TinyGPT, TinyGPTConfig
    from kubetrain_trainer.rng import set_seed

    def make(seed: int = 0, dropout: float = 0.1) -> TinyGPT:
        set_seed(seed)
        return TinyGPT(TinyGPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2, dropout=dropout))

    return make


@pytest.fixture
def tokens():
    from kubetrain_trainer.models import SyntheticTokens

    return lambda n=30, seed=0: SyntheticTokens(n, 8, 32, seed=seed)


@pytest.fixture
def make_args(tmp_path):
    """Factory: TrainingArguments for a quiet tiny run in a temporary output_dir."""
    from kubetrain_trainer import TrainingArguments

    def make(**overrides) -> TrainingArguments:
        base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, learning_rate=1e-2,
                    logging_steps=1, save_steps=3, disable_tqdm=True, report_to=["none"], max_steps=6)
        return TrainingArguments(**{**base, **overrides})

    return make


@pytest.fixture
def master_port() -> str:
    """A free port for a test's two gloo processes: a fixed one fails when another run holds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])
