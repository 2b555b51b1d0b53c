"""The restore's outcome handed to workers started before it (handoff.py, docs/contract.md "Command").

The built-in trainer starts while the launcher restores, and trains only on the launcher's word:
the folder it restored, or "start fresh". A failed restore, a SIGTERM first, or a launcher that is
gone must never read as "start fresh". The pipe tests run in this process; the `slow` ones start
real workers through `launch.Workers` and the launcher itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kubetrain_trainer import handoff
from kubetrain_trainer.handoff import HandoffError
from kubetrain_trainer.launch import Workers, worker_env
from kubetrain_trainer.launch_config import LaunchConfig


def _handed(resume_from: Path | None) -> Path | None:
    read_fd, write_fd = handoff.open_pipe()
    assert handoff.send(write_fd, resume_from)
    return handoff.receive(read_fd, timeout_s=5)


def test_the_worker_resumes_from_the_folder_the_launcher_restored_or_starts_fresh(tmp_path: Path):
    assert _handed(tmp_path / "checkpoint-40") == tmp_path / "checkpoint-40"
    assert _handed(None) is None


def test_a_launcher_that_gives_up_or_is_gone_is_an_error_never_a_fresh_start():
    read_fd, write_fd = handoff.open_pipe()
    handoff.withhold(write_fd)  # the restore failed, or SIGTERM came first
    with pytest.raises(HandoffError, match="without an outcome"):
        handoff.receive(read_fd)


def test_no_outcome_in_time_and_an_unreadable_one_are_clear_errors():
    read_fd, write_fd = handoff.open_pipe()
    try:
        with pytest.raises(HandoffError, match="within 0s"):
            handoff.receive(read_fd, timeout_s=0.05)
    finally:
        os.close(write_fd)
    for line in (b"fresh\n", b"{}\n", b'{"resume_from": 7}\n', b'{"resume_from": ""}\n'):
        with pytest.raises(HandoffError, match="unreadable"):
            handoff.decode(line)


def test_handing_over_to_a_worker_that_already_exited_is_not_an_error():
    read_fd, write_fd = handoff.open_pipe()
    os.close(read_fd)
    assert handoff.send(write_fd, None) is False


def test_the_worker_environment_names_the_pipe_instead_of_a_folder(tmp_path: Path):
    cfg = LaunchConfig.from_env({"KUBETRAIN_LOCAL_CHECKPOINT_DIR": str(tmp_path)}, [])
    env = worker_env(cfg, 0, {"KUBETRAIN_RESUME_FROM": "stale", "KUBETRAIN_RESTORE_OUTCOME_FD": "9"}, None, 5)
    assert env["KUBETRAIN_RESTORE_OUTCOME_FD"] == "5" and "KUBETRAIN_RESUME_FROM" not in env
    assert "KUBETRAIN_RESTORE_OUTCOME_FD" not in worker_env(cfg, 0, {"KUBETRAIN_RESTORE_OUTCOME_FD": "9"}, None)


# ---------------------------------------------------------------- real processes

WAITER = r"""
import json, os, pathlib, sys
from kubetrain_trainer.handoff import HandoffError, receive
from kubetrain_trainer.workerenv import WorkerEnv
out, env = pathlib.Path(os.environ["TEST_OUT"]), WorkerEnv.from_environ()
(out / f"waiting-{env.rank}").write_text("x")
try:
    folder = receive(env.restore_outcome_fd)
except HandoffError as e:
    (out / f"refused-{env.rank}").write_text(str(e))
    sys.exit(1)
(out / f"trains-{env.rank}.json").write_text(json.dumps(str(folder) if folder else None))
"""


def _workers(tmp_path: Path) -> Workers:
    cfg = LaunchConfig.from_env({"NPROC_PER_NODE": "2", "KUBETRAIN_LOCAL_CHECKPOINT_DIR": str(tmp_path / "ckpt")},
                                ["--", sys.executable, "-c", WAITER])
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KUBETRAIN_", "AWS_"))}
    workers = Workers.spawn(cfg, base | {"TEST_OUT": str(tmp_path)}, None, before_restore=True)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("waiting-*"))) < 2:  # up and waiting while the "restore" runs
        assert time.monotonic() < deadline and not workers.poll(), "the workers did not start"
        time.sleep(0.05)
    return workers


@pytest.mark.slow
def test_workers_started_before_the_restore_train_from_what_it_restored(tmp_path: Path):
    workers = _workers(tmp_path)
    assert not list(tmp_path.glob("trains-*")), "no worker may go on before the outcome"
    workers.hand_over(tmp_path / "ckpt" / "checkpoint-8")
    for p in workers.procs:
        p.wait(timeout=60)
    assert workers.all_ok
    got = [json.loads((tmp_path / f"trains-{r}.json").read_text()) for r in range(2)]
    assert got == [str(tmp_path / "ckpt" / "checkpoint-8")] * 2


@pytest.mark.slow
def test_workers_started_before_a_failed_restore_never_train(tmp_path: Path):
    workers = _workers(tmp_path)
    workers.stop_before_training(wait_s=30)
    assert all(p.returncode is not None for p in workers.procs)
    assert not list(tmp_path.glob("trains-*"))


@pytest.mark.slow
def test_the_launcher_reports_an_unreachable_store_as_before_and_stops_the_waiting_trainer(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBETRAIN_", "AWS_"))}
    env.update(NNODES="1", NODE_RANK="0", NPROC_PER_NODE="1", MASTER_PORT="29512", KUBETRAIN_BUILTIN_TASK="regression",
               KUBETRAIN_LOCAL_CHECKPOINT_DIR=str(tmp_path / "ckpt"), KUBETRAIN_CHECKPOINT_URI="s3://bucket/job",
               AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
               AWS_REGION="us-east-1", KUBETRAIN_RESTORE_TIMEOUT_SECONDS="3", KUBETRAIN_METRICS_PORT="0",
               KUBETRAIN_TERMINATION_LOG=str(tmp_path / "termination-log"))
    p = subprocess.run([sys.executable, "-m", "kubetrain_trainer.launch"], env=env, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 84, p.stderr[-3000:]
    assert "started 1 worker(s) (they wait for the restore)" in p.stderr
    assert "unreachable" in p.stderr and "restore outcome" not in p.stderr and "step 1" not in p.stderr
    assert not list((tmp_path / "ckpt").glob("checkpoint-*")), "the worker never trained"
