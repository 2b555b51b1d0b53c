"""A transformers LM's step over micro-batches and ranks weighs every label token alike (HF 5.x's
`num_items_in_batch`): one batch of 4 rows, 4 accumulated micro-batches of 1 row, and 2 DDP ranks with 2
micro-batches each give the same update and the same logged loss, with rows of 1 to 24 label tokens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kubetrain_testbed import free_port

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")
WORKER = Path(__file__).with_name("token_weighting_worker.py")


def _run(batch: int, accumulation: int, out: Path, world: int = 1) -> dict:
    port, procs = free_port(), []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(batch), str(accumulation), str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output[-3000:]
    return torch.load(out)


def test_one_batch_accumulated_micro_batches_and_ranks_give_one_update(tmp_path):
    whole = _run(4, 1, tmp_path / "whole.pt")
    accumulated = _run(1, 4, tmp_path / "accumulated.pt")
    ranks = _run(1, 2, tmp_path / "ranks.pt", world=2)
    for other in (accumulated, ranks):
        assert torch.allclose(other["weight"], whole["weight"], rtol=0, atol=1e-6)
        assert other["loss"] == pytest.approx(whole["loss"], rel=1e-6)
