"""The launcher without storage: env contract parsing, worker environment, exit codes, signals.

Process tests run `python -m kubetrain_trainer.launch -- <tiny python worker>`
for real (no S3: KUBETRAIN_CHECKPOINT_URI is empty). They are marked `slow`:
each pays the launcher's interpreter start (seconds on a loaded machine).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kubetrain_trainer.contract import EXIT_INVALID_CONFIG, EXIT_PREEMPTED
from kubetrain_trainer.launch import exit_code_for, worker_env
from kubetrain_trainer.launch_config import ConfigError, LaunchConfig

BASE = {"NNODES": "2", "NODE_RANK": "1", "NPROC_PER_NODE": "3", "MASTER_ADDR": "job-n0.job.ns.svc",
        "MASTER_PORT": "29500", "KUBETRAIN_ATTEMPT": "4", "KUBETRAIN_STRATEGY": "fsdp"}


def test_env_contract_is_read():
    cfg = LaunchConfig.from_env(BASE | {"KUBETRAIN_TRAINER_ARGS": '{"save_total_limit": 2, "max_steps": 5}'}, [])
    assert (cfg.nnodes, cfg.node_rank, cfg.nproc_per_node, cfg.world_size) == (2, 1, 3, 6)
    assert (cfg.attempt, cfg.strategy, cfg.master_port, cfg.builtin) == (4, "fsdp", 29500, True)
    assert cfg.checkpoint_uri is None
    assert cfg.retention().save_total_limit == 2
    assert cfg.local_dir == Path("/tmp/kubetrain/checkpoints")
    cfg = LaunchConfig.from_env(BASE | {"KUBETRAIN_TRAINER_ARGS": '{"output_dir": "/data/out"}'}, [])
    assert cfg.local_dir == Path("/data/out")  # the built-in trainer writes there: watch it
    cfg = LaunchConfig.from_env(BASE, ["--", "accelerate", "launch", "train.py"])
    assert cfg.command == ("accelerate", "launch", "train.py") and not cfg.builtin


@pytest.mark.parametrize(
    "override, argv, variable",
    [
        ({"NNODES": "two"}, [], "NNODES"),
        ({"NNODES": "0"}, [], "NNODES"),
        ({"NODE_RANK": "2"}, [], "NODE_RANK"),
        ({"NPROC_PER_NODE": "-1"}, [], "NPROC_PER_NODE"),
        ({"MASTER_PORT": "70000"}, [], "MASTER_PORT"),
        ({"MASTER_ADDR": ""}, [], "MASTER_ADDR"),
        ({"KUBETRAIN_ATTEMPT": "0"}, [], "KUBETRAIN_ATTEMPT"),
        ({"KUBETRAIN_STRATEGY": "zero2"}, [], "KUBETRAIN_STRATEGY"),
        ({"KUBETRAIN_CHECKPOINT_URI": "gs://bucket/x"}, [], "KUBETRAIN_CHECKPOINT_URI"),
        ({"KUBETRAIN_TRAINER_ARGS": "{not json"}, [], "KUBETRAIN_TRAINER_ARGS"),
        ({"KUBETRAIN_TRAINER_ARGS": "[1]"}, [], "KUBETRAIN_TRAINER_ARGS"),
        ({"KUBETRAIN_TERMINATION_GRACE_SECONDS": "soon"}, [], "KUBETRAIN_TERMINATION_GRACE_SECONDS"),
        ({"KUBETRAIN_CHECKPOINT_COMMIT": "sometimes"}, [], "KUBETRAIN_CHECKPOINT_COMMIT"),
        ({"KUBETRAIN_CHECKPOINT_SETTLE_SECONDS": "0"}, [], "KUBETRAIN_CHECKPOINT_SETTLE_SECONDS"),
        ({"KUBETRAIN_CHECKPOINT_SETTLE_SECONDS": "nan"}, [], "KUBETRAIN_CHECKPOINT_SETTLE_SECONDS"),
        ({"KUBETRAIN_UPLOAD_TIMEOUT_SECONDS": "inf"}, [], "KUBETRAIN_UPLOAD_TIMEOUT_SECONDS"),
        ({"KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND": "1MB"}, [], "KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND"),
        ({}, ["--"], "command"),
        ({}, ["train.py"], "command"),
    ],
)
def test_invalid_configuration_names_the_variable(override, argv, variable):
    with pytest.raises(ConfigError, match=f"^{variable}:"):
        LaunchConfig.from_env(BASE | override, argv)


def test_worker_env_sets_torch_distributed_variables_and_resume(tmp_path: Path):
    cfg = LaunchConfig.from_env(BASE | {"KUBETRAIN_LOCAL_CHECKPOINT_DIR": str(tmp_path),
                                        "KUBETRAIN_TRAINER_ARGS": '{"max_steps": 3}'}, [])
    env = worker_env(cfg, 2, {"PATH": "/bin", "KUBETRAIN_RESUME_FROM": "stale", "KUBETRAIN_TRAINER_ARGS": "{}"}, tmp_path / "checkpoint-7")
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")} == {
        "RANK": "5", "LOCAL_RANK": "2", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "1"}
    assert env["MASTER_ADDR"] == "job-n0.job.ns.svc" and env["MASTER_PORT"] == "29500"
    assert env["KUBETRAIN_RESUME_FROM"] == str(tmp_path / "checkpoint-7")
    assert env["KUBETRAIN_SYNC_BY_LAUNCHER"] == "1"
    assert env["KUBETRAIN_LOCAL_CHECKPOINT_DIR"] == str(tmp_path)
    assert env["KUBETRAIN_TRAINER_ARGS"] == "{}"  # passed through untouched
    env = worker_env(cfg, 0, {"KUBETRAIN_RESUME_FROM": "stale"}, None)
    assert "KUBETRAIN_RESUME_FROM" not in env


@pytest.mark.parametrize(
    "first_failure, signalled, all_ok, code",
    [
        (None, False, True, 0),
        (None, True, True, 0),  # finished just as SIGTERM came: done is done
        (83, False, False, 83),
        (82, True, False, 82),
        (1, True, False, 83),  # killed while being preempted
        (1, False, False, 1),
        (-9, False, False, 137),
        (-15, False, False, 143),
    ],
)
def test_exit_codes(first_failure, signalled, all_ok, code):
    assert exit_code_for(first_failure=first_failure, signalled=signalled, all_ok=all_ok) == code


# ---------------------------------------------------------------- real processes

WORKER = r"""
import os, signal, sys, time, json, pathlib
out = pathlib.Path(os.environ["TEST_OUT"])
rank = os.environ["RANK"]
(out / f"env-{rank}.json").write_text(json.dumps({k: os.environ.get(k) for k in
    ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")}))
mode = os.environ["TEST_MODE"]
def on_term(*_):
    (out / f"sigterm-{rank}").write_text("x")
    sys.exit(83)
if mode == "trap":
    signal.signal(signal.SIGTERM, on_term)
elif mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
(out / f"ready-{rank}").write_text("x")
if mode == "ok":
    sys.exit(0)
if mode == "fail" and rank == "1":
    # Fail only once rank 0 runs (a loaded machine may start it later): the test is that it gets stopped.
    deadline = time.monotonic() + 60
    while not (out / "ready-0").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(int(os.environ["TEST_CODE"]))
time.sleep(60)
"""


def _launch(tmp_path: Path, mode: str, *, nproc: int = 2, extra=None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBETRAIN_", "AWS_"))}
    env.update(NNODES="1", NODE_RANK="0", NPROC_PER_NODE=str(nproc), MASTER_PORT="29511",
               KUBETRAIN_LOCAL_CHECKPOINT_DIR=str(tmp_path / "ckpt"), TEST_OUT=str(tmp_path), TEST_MODE=mode,
               KUBETRAIN_TERMINATION_LOG=str(tmp_path / "termination-log"))
    env.update(extra or {})
    return subprocess.Popen([sys.executable, "-m", "kubetrain_trainer.launch", "--", sys.executable, "-c", WORKER],
                            env=env, stderr=subprocess.PIPE, text=True)


def _wait_ready(tmp_path: Path, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while len(list(tmp_path.glob("ready-*"))) < n:
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.05)


@pytest.mark.slow
def test_workers_get_ranks_and_success_exits_0(tmp_path: Path):
    p = _launch(tmp_path, "ok")
    assert p.wait(timeout=120) == 0, p.stderr.read()
    envs = [json.loads((tmp_path / f"env-{r}.json").read_text()) for r in range(2)]
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert all(e["WORLD_SIZE"] == "2" and e["LOCAL_WORLD_SIZE"] == "2" and e["GROUP_RANK"] == "0" for e in envs)
    assert envs[1]["MASTER_ADDR"] == "127.0.0.1" and envs[1]["MASTER_PORT"] == "29511"
    assert not (tmp_path / "termination-log").exists()  # nothing committed: nothing to report


@pytest.mark.slow
@pytest.mark.parametrize("code", [3, EXIT_INVALID_CONFIG, EXIT_PREEMPTED])
def test_first_failing_worker_decides_and_the_others_are_stopped(tmp_path: Path, code: int):
    p = _launch(tmp_path, "fail", extra={"TEST_CODE": str(code)})
    assert p.wait(timeout=120) == code, p.stderr.read()
    # rank 0 would sleep 60 s: it was stopped soon after rank 1 failed
    assert time.time() - (tmp_path / "ready-1").stat().st_mtime < 30, "the sleeping worker was not stopped"
    assert (tmp_path / "ready-0").exists()


@pytest.mark.slow
def test_sigterm_is_forwarded_and_reported_as_preempted(tmp_path: Path):
    p = _launch(tmp_path, "trap")
    _wait_ready(tmp_path, 2)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == EXIT_PREEMPTED, p.stderr.read()
    assert sorted(f.name for f in tmp_path.glob("sigterm-*")) == ["sigterm-0", "sigterm-1"]


@pytest.mark.slow
def test_workers_ignoring_sigterm_are_killed_within_the_grace_period(tmp_path: Path):
    p = _launch(tmp_path, "ignore", extra={"KUBETRAIN_TERMINATION_GRACE_SECONDS": "3"})
    _wait_ready(tmp_path, 2)
    start = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == EXIT_PREEMPTED
    assert time.monotonic() - start < 10  # grace 3 s, not the workers' 60 s sleep


@pytest.mark.slow
def test_invalid_environment_exits_82_naming_the_variable(tmp_path: Path):
    p = _launch(tmp_path, "ok", extra={"NPROC_PER_NODE": "many"})
    assert p.wait(timeout=60) == EXIT_INVALID_CONFIG
    assert "NPROC_PER_NODE" in p.stderr.read()


def test_prebuilt_torch_extensions_in_a_read_only_folder_are_copied_where_torch_can_lock_them(tmp_path):
    import os

    from kubetrain_trainer.launch import writable_extensions

    image = tmp_path / "opt" / "torch_extensions"
    (image / "deepspeed_shm_comm").mkdir(parents=True)
    (image / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"\x7fELF")
    image.chmod(0o555)
    try:
        env = writable_extensions({"TORCH_EXTENSIONS_DIR": str(image)}, tmp_path / "scratch")
        if os.access(image, os.W_OK):  # root ignores the mode bits: the folder counts as writable
            assert env["TORCH_EXTENSIONS_DIR"] == str(image)
        else:
            assert env["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "scratch")
            assert (tmp_path / "scratch" / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").read_bytes() == b"\x7fELF"
    finally:
        image.chmod(0o755)
    writable = tmp_path / "w"
    writable.mkdir()
    assert writable_extensions({"TORCH_EXTENSIONS_DIR": str(writable)}, tmp_path / "s2")["TORCH_EXTENSIONS_DIR"] == str(writable)
    assert "TORCH_EXTENSIONS_DIR" not in writable_extensions({}, tmp_path / "s3")


def test_a_missing_torch_extensions_folder_on_a_read_only_root_moves_where_torch_can_build(tmp_path, monkeypatch):
    """An image built without the prebuilt ops (PREBUILD_DEEPSPEED_CPU_OPS=0, the GPU images) still names
    /opt/torch_extensions: a JIT-built DeepSpeed op (CPU Adam for offload, fused Adam) failed with
    'Read-only file system' creating it."""
    from kubetrain_trainer import launch

    root = tmp_path / "root"  # stands for the pod's read-only root file system
    root.mkdir()
    real_access = os.access
    monkeypatch.setattr(launch.os, "access", lambda p, mode: False if Path(p) == root else real_access(p, mode))
    env = launch.writable_extensions({"TORCH_EXTENSIONS_DIR": str(root / "opt" / "torch_extensions")}, tmp_path / "s")
    assert env["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "s") and (tmp_path / "s").is_dir()
    volume = tmp_path / "volume"  # a writable volume where the folder does not exist yet: torch creates it there
    volume.mkdir()
    assert launch.writable_extensions({"TORCH_EXTENSIONS_DIR": str(volume / "ext")}, tmp_path / "s2") == {
        "TORCH_EXTENSIONS_DIR": str(volume / "ext")}


@pytest.mark.parametrize("builtin_output_dir, variable", [
    (True, "KUBETRAIN_TRAINER_ARGS output_dir"), (False, "KUBETRAIN_LOCAL_CHECKPOINT_DIR")])
def test_a_local_checkpoint_folder_that_cannot_be_created_is_invalid_configuration(tmp_path, monkeypatch,
                                                                                   builtin_output_dir, variable):
    """`output_dir: "results"` resolved under the image's working directory, on the pod's read-only root: the
    launcher died with a traceback and exit 1, and the job was retried until backoffLimit for a mistake no
    retry fixes."""
    import errno

    monkeypatch.chdir(tmp_path)
    env = {"KUBETRAIN_TRAINER_ARGS": '{"output_dir": "results"}'} if builtin_output_dir else {
        "KUBETRAIN_LOCAL_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    cfg = LaunchConfig.from_env(env, [] if builtin_output_dir else ["--", "python", "train.py"])

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ConfigError, match=f"^{variable}: cannot create .*Read-only file system"):
        cfg.make_local_dir()
    monkeypatch.setattr(Path, "mkdir", lambda self, *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(OSError, match="full"):  # a full disk is no configuration mistake
        cfg.make_local_dir()


def test_the_launcher_exits_82_when_the_local_checkpoint_folder_cannot_be_created(tmp_path, monkeypatch):
    from kubetrain_trainer import launch

    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(launch, "pod_environ", lambda: {
        "KUBETRAIN_LOCAL_CHECKPOINT_DIR": str(tmp_path / "file" / "ckpt"), "KUBETRAIN_METRICS_PORT": "0"})
    assert launch.main(["--", "true"]) == EXIT_INVALID_CONFIG


@pytest.mark.parametrize("value, level", [("", "INFO"), ("debug", "DEBUG"), (" Warning ", "WARNING"), ("ERROR", "ERROR")])
def test_the_launchers_log_level_is_read_case_blind(value, level):
    from kubetrain_trainer.launch_config import log_level

    assert log_level({"KUBETRAIN_LOG_LEVEL": value}) == level and log_level({}) == "INFO"


@pytest.mark.parametrize("value", ["verbose", "trace", "5"])
def test_an_unknown_log_level_exits_82_naming_the_variable(tmp_path, monkeypatch, caplog, value):
    """`KUBETRAIN_LOG_LEVEL: verbose` in spec.env: logging.basicConfig raised ValueError('Unknown level') before
    anything was validated, so the launcher died with a traceback and exit 1, an application failure retried until
    backoffLimit, where every other bad variable of the pod exits 82 naming it."""
    from kubetrain_trainer import launch

    monkeypatch.setattr(launch, "pod_environ", lambda: {
        "KUBETRAIN_LOG_LEVEL": value, "KUBETRAIN_LOCAL_CHECKPOINT_DIR": str(tmp_path), "KUBETRAIN_METRICS_PORT": "0"})
    assert launch.main(["--", "true"]) == EXIT_INVALID_CONFIG
    assert f"KUBETRAIN_LOG_LEVEL: unknown level {value!r}" in caplog.text


def test_a_local_checkpoint_folder_the_image_holds_that_cannot_be_written_is_invalid_configuration(tmp_path,
                                                                                                 monkeypatch):
    """`output_dir: "checkpoints"` where the image's working directory already holds that folder (a repository's
    checkpoints/.gitkeep), on the pod's read-only root: it exists, so creating it succeeded, and the run trained
    until its first save failed with 'Read-only file system', then again on every retry until backoffLimit."""
    import errno
    import tempfile

    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    cfg = LaunchConfig.from_env({"KUBETRAIN_TRAINER_ARGS": '{"output_dir": "checkpoints"}'}, [])

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    with pytest.raises(ConfigError, match="^KUBETRAIN_TRAINER_ARGS output_dir: cannot write to .*Read-only file"):
        cfg.make_local_dir()
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    cfg.make_local_dir()  # a writable one passes, and is left as it was
    assert list((tmp_path / "checkpoints").iterdir()) == []
