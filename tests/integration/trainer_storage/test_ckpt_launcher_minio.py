"""The launcher end to end on one node with 2 workers, the built-in task and a real MinIO.

Train -> SIGTERM mid-run -> exit 83 with an emergency checkpoint committed to
S3 -> relaunch as attempt 2 on a fresh local disk (a new pod) -> it restores
that checkpoint, resumes from it and finishes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kubetrain_trainer.storage import CheckpointStore, StorageConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_STEPS = 400
ARGS = {"max_steps": MAX_STEPS, "save_steps": 50, "save_total_limit": 2, "use_cpu": True,
        "per_device_train_batch_size": 8, "logging_steps": 50}


def _launch(ckpt_env: dict, tmp: Path, attempt: int, log: Path, **extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBETRAIN_")}
    env.update(ckpt_env)
    env.update(NNODES="1", NODE_RANK="0", NPROC_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + attempt),
               OMP_NUM_THREADS="1", KUBETRAIN_ATTEMPT=str(attempt), KUBETRAIN_STRATEGY="ddp",
               KUBETRAIN_BUILTIN_TASK="regression", KUBETRAIN_TRAINER_ARGS=json.dumps(ARGS),
               KUBETRAIN_LOCAL_CHECKPOINT_DIR=str(tmp / f"pod-a{attempt}" / "ckpt"),
               KUBETRAIN_TERMINATION_LOG=str(tmp / f"termination-log-a{attempt}"),
               KUBETRAIN_TERMINATION_GRACE_SECONDS="60")
    env.update(extra)
    return subprocess.Popen([sys.executable, "-m", "kubetrain_trainer.launch"], env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _committed(store: CheckpointStore) -> dict[int, object]:
    return {c.step: c.manifest for c in store.list_checkpoints() if c.complete}


def test_sigterm_commits_an_emergency_checkpoint_and_attempt_2_resumes_from_it(ckpt_env, tmp_path: Path):
    store = CheckpointStore(StorageConfig.from_env(ckpt_env))
    log1 = tmp_path / "attempt1.log"
    # The test hook holds training after checkpoint-50 until the SIGTERM (docs/contract.md, "Test hooks"):
    # the SIGTERM lands mid-run however fast this machine trains, never after the last step.
    p = _launch(ckpt_env, tmp_path, 1, log1, KUBETRAIN_TEST_HOLD_AT_STEP="50")
    try:
        deadline = time.monotonic() + 300
        while not _committed(store):  # the first periodic checkpoint is in S3: we are mid-run
            assert p.poll() is None, f"attempt 1 ended early ({p.returncode}):\n{log1.read_text()[-4000:]}"
            assert time.monotonic() < deadline, log1.read_text()[-4000:]
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=180)  # a safety net: the launcher's own bound is its 60 s grace
    finally:
        if p.poll() is None:
            p.kill()
    text = log1.read_text()
    assert code == 83, text[-4000:]
    committed = _committed(store)
    last = max(committed)
    assert last < MAX_STEPS, "SIGTERM came too late to test a resume"
    assert committed[last].attempt == 1 and committed[last].world_size == 2
    report = json.loads((tmp_path / "termination-log-a1").read_text())
    assert report["step"] == last and report["uri"].endswith(f"/checkpoint-{last}")
    assert "SIGTERM: stopped after step" in text  # the trainer took the emergency checkpoint

    log2 = tmp_path / "attempt2.log"
    p = _launch(ckpt_env, tmp_path, 2, log2)
    try:
        code = p.wait(timeout=400)
    finally:
        if p.poll() is None:
            p.kill()
    text = log2.read_text()
    assert code == 0, text[-4000:]
    assert f"restored checkpoint-{last} (attempt 1)" in text
    # The built-in trainer started while the launcher restored, and trained only on its word (handoff.py).
    assert text.index("started 2 worker(s) (they wait for the restore)") < text.index(f"restored checkpoint-{last}")
    assert "restore outcome after" in text, text[-4000:]  # rank 0 logs at info
    assert f"resuming from {tmp_path / 'pod-a2' / 'ckpt' / f'checkpoint-{last}'}" in text
    # Both ranks print a result line to one shared stdout: read each object, however the lines interleave.
    results = [json.loads(m) for m in re.findall(r'\{"task": [^{}]*\}', text)]
    assert results and all(r["global_step"] == MAX_STEPS for r in results)
    committed = _committed(store)
    assert max(committed) == MAX_STEPS and committed[MAX_STEPS].attempt == 2
    assert len(committed) <= 3  # save_total_limit=2 (+ the best, when it differs) on the remote too
    report = json.loads((tmp_path / "termination-log-a2").read_text())
    assert report["step"] == MAX_STEPS
    final = store.read_named_manifest("final")  # the from_pretrained layout, uploaded after success
    assert final is not None and final.attempt == 2
    assert {"model.safetensors", "config.json"} <= {f.path for f in final.files}


def test_a_sigterm_after_the_run_finished_while_its_uploads_lag_exits_83_within_the_grace_period(
        ckpt_env, tmp_path: Path):
    # The run is done but its checkpoints and final model are still going out (slowly) when the node is
    # drained: the pod must leave within its grace period (not be SIGKILLed mid-upload, 137), as preempted
    # (83, no backoffLimit spent), and the next attempt stores what this one could not.
    store = CheckpointStore(StorageConfig.from_env(ckpt_env))
    args = {"max_steps": 20, "save_steps": 10, "use_cpu": True, "per_device_train_batch_size": 8,
            "in_features": 256, "hidden": 2048}  # ~6 MB per checkpoint, at 1 MB/s: many seconds of uploads
    log1 = tmp_path / "attempt1.log"
    p = _launch(ckpt_env, tmp_path, 1, log1, KUBETRAIN_TRAINER_ARGS=json.dumps(args),
                KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND=str(1 << 20), KUBETRAIN_TERMINATION_GRACE_SECONDS="8")
    try:
        deadline = time.monotonic() + 300
        while "workers finished after" not in log1.read_text():
            assert p.poll() is None, f"attempt 1 ended early ({p.returncode}):\n{log1.read_text()[-4000:]}"
            assert time.monotonic() < deadline, log1.read_text()[-4000:]
            time.sleep(0.1)
        signalled = time.monotonic()
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=120)
        took = time.monotonic() - signalled
    finally:
        if p.poll() is None:
            p.kill()
    text = log1.read_text()
    assert "workers finished after" in text and "outcome exit code 0" in text
    assert code == 83, text[-4000:]
    assert took < 8 + 1.0, f"{took:.1f}s after SIGTERM (grace 8 s):\n{text[-3000:]}"
    assert "exiting as preempted" in text
    assert store.read_named_manifest("final") is None  # never half a final model: its manifest goes last

    log2 = tmp_path / "attempt2.log"
    p = _launch(ckpt_env, tmp_path, 2, log2, KUBETRAIN_TRAINER_ARGS=json.dumps(args))
    try:
        code = p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert code == 0, log2.read_text()[-4000:]
    assert max(_committed(store)) == 20
    final = store.read_named_manifest("final")
    assert final is not None and final.attempt == 2


def _two_nodes(ckpt_env: dict, tmp: Path, args: dict, *, attempt: int = 1, tag: str = "", port: int = 29650,
               **extra: str) -> list[str]:
    """Attempt `attempt` of a 2-node job (1 worker per node, separate local disks under `tmp/<tag>node<r>`,
    one machine) to its end, both nodes exiting 0; their logs. `extra`: more of the pods' environment."""
    procs, logs = [], []
    for node in (0, 1):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBETRAIN_")}
        env.update(ckpt_env)
        env.update(NNODES="2", NODE_RANK=str(node), NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", KUBETRAIN_ATTEMPT=str(attempt),
                   KUBETRAIN_BUILTIN_TASK="regression", KUBETRAIN_TRAINER_ARGS=json.dumps(args),
                   KUBETRAIN_LOCAL_CHECKPOINT_DIR=str(tmp / f"{tag}node{node}" / "ckpt"),
                   KUBETRAIN_TERMINATION_LOG=str(tmp / f"termination-log-{tag}n{node}"), **extra)
        logs.append(tmp / f"{tag}node{node}.log")
        procs.append(subprocess.Popen([sys.executable, "-m", "kubetrain_trainer.launch"], env=env,
                                      stdout=open(logs[-1], "w"), stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
    return texts


def test_two_shared_nothing_nodes_commit_one_manifest_with_both_nodes_files(ckpt_env, tmp_path: Path):
    """NNODES=2 on one machine, separate local disks: each node uploads its own files and part record;
    node rank 0 commits one manifest holding both (here: each node's rng_state_<rank>.pth)."""
    _two_nodes(ckpt_env, tmp_path, dict(ARGS, max_steps=60, save_steps=20))
    store = CheckpointStore(StorageConfig.from_env(ckpt_env))
    committed = _committed(store)
    assert 60 in committed, committed
    paths = {f.path for f in committed[60].files}
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= paths
    assert committed[60].world_size == 2
    # only node rank 0 reports
    assert json.loads((tmp_path / "termination-log-n0").read_text())["step"] == 60
    assert not (tmp_path / "termination-log-n1").exists()


def test_each_node_of_an_fsdp_job_restores_only_its_own_shards_and_the_job_finishes(ckpt_env, tmp_path: Path):
    """Attempt 1 of a 2-node FSDP job commits checkpoint-40; attempt 2 (a longer run) restores it, each
    node fetching only its own rank's shards (rank_files.py), resumes and finishes."""
    args = dict(ARGS, max_steps=40, save_steps=20, logging_steps=20)
    fsdp = dict(KUBETRAIN_STRATEGY="fsdp", KUBETRAIN_JOB_INCARNATION="3")
    _two_nodes(ckpt_env, tmp_path, args, attempt=1, tag="a1-", port=29661, **fsdp)
    store = CheckpointStore(StorageConfig.from_env(ckpt_env))
    assert max(_committed(store)) == 40
    texts = _two_nodes(ckpt_env, tmp_path, dict(args, max_steps=60), attempt=2, tag="a2-", port=29662, **fsdp)
    for node, text in enumerate(texts):
        assert "the other ranks' shards stay in storage" in text, text[-3000:]
        restored = tmp_path / f"a2-node{node}" / "ckpt" / "checkpoint-40"
        for sub in ("pytorch_model_fsdp_0", "optimizer_0"):  # kept locally: save_total_limit 2 (40 and 60)
            names = {p.name for p in (restored / sub).iterdir()}
            assert f"__{node}_0.distcp" in names and f"__{1 - node}_0.distcp" not in names, names
        results = [json.loads(m) for m in re.findall(r'\{"task": [^{}]*\}', text)]
        assert results and all(r["global_step"] == 60 for r in results), text[-3000:]
    assert max(_committed(store)) == 60
