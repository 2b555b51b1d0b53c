"""DDP on CPU with 2 processes (gloo): stop or preempt, resume in new processes, end bitwise equal.

The resume-equivalence test of issue 4: train N steps straight; train k steps,
stop, start new processes, resume, continue to N; compare parameters and the
loss history with `torch.equal` / exact float equality. Also: SIGTERM on ONE
rank stops both at the same step with one emergency checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kubetrain_testbed import free_port

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("ddp_worker.py")
STEPS = 10


def launch(spec: dict, world: int = 2, timeout: int = 400) -> list[int]:
    port = free_port()
    procs = []
    for rank in range(world):
        local = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"} if spec.get("nodes") else {"LOCAL_RANK": str(rank)}
        env = {**os.environ, "RANK": str(rank), **local, "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    codes = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        codes.append(p.returncode)
        if p.returncode not in (0, 83):
            print(out)
    return codes


def _result(folder: Path, rank: int):
    params = load_file(str(folder / f"params_{rank}.safetensors"))
    history = [(e["step"], e["loss"], e["grad_norm"], e["learning_rate"])
               for e in json.loads((folder / f"history_{rank}.json").read_text()) if "loss" in e]
    return params, history


def _assert_equal_runs(a: Path, b: Path):
    for rank in (0, 1):
        pa, ha = _result(a, rank)
        pb, hb = _result(b, rank)
        assert pa.keys() == pb.keys()
        for k in pa:
            assert torch.equal(pa[k], pb[k]), f"rank {rank}: {k} differs"
        assert ha == hb and len(ha) == STEPS
    p0, _ = _result(b, 0)
    p1, _ = _result(b, 1)
    assert all(torch.equal(p0[k], p1[k]) for k in p0)  # replicas agree


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    assert launch({"out": str(root / "out"), "max_steps": STEPS, "result": str(root / "res")}) == [0, 0]
    return root / "res"


def test_ddp_stop_and_resume_is_bitwise_equal(straight, tmp_path):
    out = str(tmp_path / "out")
    assert launch({"out": out, "max_steps": STEPS, "stop_at": 6, "result": str(tmp_path / "r1")}) == [0, 0]
    assert launch({"out": out, "max_steps": STEPS, "resume": True, "init_seed": 99,
                   "result": str(tmp_path / "r2")}) == [0, 0]
    _assert_equal_runs(straight, tmp_path / "r2")


def test_sigterm_on_one_rank_preempts_both_at_the_same_step(straight, tmp_path):
    out = tmp_path / "out"
    codes = launch({"out": str(out), "max_steps": STEPS, "sigterm_at": {"rank": 1, "step": 5},
                    "result": str(tmp_path / "r1")})
    assert codes == [83, 83]
    ck = out / "checkpoint-5"
    assert (ck / "trainer_state.json").is_file()
    assert (ck / "rng_state_0.pth").is_file() and (ck / "rng_state_1.pth").is_file()
    assert not (ck / "rng_state.pth").exists()  # HF's name for one process's state
    assert json.loads((ck / "trainer_state.json").read_text())["global_step"] == 5
    assert launch({"out": str(out), "max_steps": STEPS, "resume": True, "init_seed": 5,
                   "result": str(tmp_path / "r2")}) == [0, 0]
    _assert_equal_runs(straight, tmp_path / "r2")


def test_async_saves_commit_after_training_moved_on_and_resume_bitwise(straight, tmp_path):
    """async_save: checkpoint-3 is written only after the loop reached step 6 (held), yet holds step 3's state."""
    out = tmp_path / "out"
    assert launch({"out": str(out), "max_steps": STEPS, "stop_at": 6, "async_save": True, "hold_writes": True,
                   "result": str(tmp_path / "r1")}) == [0, 0]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "checkpoint-6"]
    assert (out / "checkpoint-3" / ".kubetrain-ready").is_file()
    assert launch({"out": str(out), "max_steps": STEPS, "resume": str(out / "checkpoint-3"), "init_seed": 99,
                   "async_save": True, "result": str(tmp_path / "r2")}) == [0, 0]
    _assert_equal_runs(straight, tmp_path / "r2")


def test_async_save_in_flight_then_sigterm_commits_both_and_resumes_bitwise(straight, tmp_path):
    out = tmp_path / "out"
    codes = launch({"out": str(out), "max_steps": STEPS, "sigterm_at": {"rank": 1, "step": 5}, "async_save": True,
                    "hold_writes": True, "result": str(tmp_path / "r1")})
    assert codes == [83, 83]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "checkpoint-5"]
    for step in (3, 5):
        assert json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())["global_step"] == step
    assert launch({"out": str(out), "max_steps": STEPS, "resume": True, "init_seed": 5, "async_save": True,
                   "result": str(tmp_path / "r2")}) == [0, 0]
    _assert_equal_runs(straight, tmp_path / "r2")


def test_nodes_sharing_no_disk_rotate_their_folders_and_load_the_best_model_at_the_end(tmp_path):
    """Each rank its own node and output_dir: world rank 0 writes the model, optimizer and trainer state; node 1's
    folders hold only its RNG state. save_total_limit applies on both nodes, and load_best_model_at_end gives
    every rank the best checkpoint's weights (from rank 0), where node 1 crashed after training before."""
    out = tmp_path / "out"
    assert launch({"out": str(out), "max_steps": 12, "best": True, "nodes": True,
                   "result": str(tmp_path / "res")}) == [0, 0]
    node0, node1 = sorted(p.name for p in (out / "node0").iterdir()), sorted(p.name for p in (out / "node1").iterdir())
    state = json.loads((out / "node0" / "checkpoint-12" / "trainer_state.json").read_text())
    best = Path(state["best_model_checkpoint"]).name
    assert node0 == node1 == sorted({best, "checkpoint-12"})  # the newest and the best, on either node
    assert not (out / "node1" / "checkpoint-12" / "model.safetensors").exists()  # node 1's share only
    weights = load_file(str(out / "node0" / best / "model.safetensors"))
    for rank in (0, 1):
        params, _ = _result(tmp_path / "res", rank)
        assert all(torch.equal(params[k], weights[k]) for k in weights), f"rank {rank} did not load {best}"


def test_a_resume_that_only_some_nodes_can_make_is_refused_on_every_rank_not_hung(tmp_path):
    """Without a shared disk node 1 holds no complete checkpoint (no trainer_state.json): it would start over
    while node 0 resumed, and the gang would hang at the first collective that differs. Both ranks refuse."""
    out = str(tmp_path / "out")
    assert launch({"out": out, "max_steps": 6, "nodes": True, "result": str(tmp_path / "r1")}) == [0, 0]
    assert launch({"out": out, "max_steps": 9, "nodes": True, "resume": True, "result": str(tmp_path / "r2")},
                  timeout=120) == [2, 2]
