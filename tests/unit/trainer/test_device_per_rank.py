"""A worker whose local rank has no GPU of its own stops with a configuration error naming procsPerNode."""

from __future__ import annotations

import pytest
import torch

from kubetrain_trainer import distributed
from kubetrain_trainer.args_values import ConfigError


def test_a_local_rank_beyond_the_pods_gpus_is_a_configuration_error(monkeypatch) -> None:
    # The boundary is torch's device count (this machine has no GPU): faked around the pure decision.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.device_for(use_cpu=False) == torch.device("cuda", 1)
    assert distributed.device_for(use_cpu=True) == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(ConfigError, match=r"procsPerNode.*local rank 3.*2 GPU"):
        distributed.device_for(use_cpu=False)
