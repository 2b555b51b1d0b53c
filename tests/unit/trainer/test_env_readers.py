"""The trainer reads its environment in two places only: workerenv.py (a worker) and launch_config.py (the launcher).

An AST scan of kubetrain_trainer finds every `os.environ`, `os.getenv`,
`os.environb` and `from os import environ/getenv`; and a table test of
`WorkerEnv.from_environ` pins its defaults, each variable and its error.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kubetrain_trainer import contract, launch_config
from kubetrain_trainer.launch import worker_env
from kubetrain_trainer.launch_config import LaunchConfig
from kubetrain_trainer.workerenv import WorkerEnv, WorkerEnvError

PACKAGE = Path(__file__).resolve().parents[3] / "trainer_image" / "kubetrain_trainer"
READERS = {
    "workerenv.py": "the worker side's one read",
    "launch_config.py": "the launcher's one read (pod_environ)",
    "storage_errors.py": "reads the AWS keys only to mask them in error messages",
}
ENV_NAMES = {"environ", "environb", "getenv", "getenvb"}


def env_reads(source: str) -> list[int]:
    """Line numbers where `source` touches the process environment."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ENV_NAMES \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(a.name in ENV_NAMES for a in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_scan_finds_every_spelling() -> None:
    src = "import os\nos.environ.get('A')\nx = os.getenv('B')\nfrom os import environ\nos.environb\nos.path.join('a')\n"
    assert env_reads(src) == [2, 3, 4, 5]


def test_only_workerenv_and_launch_config_read_the_environment() -> None:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        lines = env_reads(path.read_text())
        if lines and rel not in READERS:
            found[rel] = lines
    assert not found, f"read the environment through workerenv.WorkerEnv or launch_config instead: {found}"
    assert (PACKAGE / "workerenv.py").is_file() and env_reads((PACKAGE / "workerenv.py").read_text())


DEFAULTS = WorkerEnv(rank=0, local_rank=0, local_rank_set=False, world_size=1, local_world_size=1, attempt=None,
                     incarnation=0, strategy="ddp", checkpoint_uri=None, sync_by_launcher=False,
                     local_checkpoint_dir=None, resume_from=None, progress_file=None, test_hold_at_step="",
                     test_hf_hold="", test_hold_seconds="")

CASES = [
    ({}, {}),
    ({contract.RANK: "3"}, {"rank": 3}),
    ({contract.LOCAL_RANK: "1"}, {"local_rank": 1, "local_rank_set": True}),
    ({contract.LOCAL_RANK: ""}, {"local_rank": 0, "local_rank_set": True}),
    ({contract.WORLD_SIZE: "8"}, {"world_size": 8}),
    ({contract.LOCAL_WORLD_SIZE: "4"}, {"local_world_size": 4}),
    ({contract.ATTEMPT: "2"}, {"attempt": 2}),
    ({contract.ATTEMPT: ""}, {"attempt": None}),
    ({contract.JOB_INCARNATION: "1700000000"}, {"incarnation": 1700000000}),
    ({contract.STRATEGY: "fsdp"}, {"strategy": "fsdp"}),
    ({contract.CHECKPOINT_URI: "s3://b/p"}, {"checkpoint_uri": "s3://b/p"}),
    ({contract.CHECKPOINT_URI: ""}, {"checkpoint_uri": None}),
    ({contract.SYNC_BY_LAUNCHER: "1"}, {"sync_by_launcher": True}),
    ({contract.SYNC_BY_LAUNCHER: "0"}, {"sync_by_launcher": False}),
    ({contract.LOCAL_CHECKPOINT_DIR: "/ckpt"}, {"local_checkpoint_dir": Path("/ckpt")}),
    ({contract.RESUME_FROM: "/ckpt/checkpoint-4"}, {"resume_from": Path("/ckpt/checkpoint-4")}),
    ({contract.PROGRESS_FILE: "/run/p.json"}, {"progress_file": Path("/run/p.json")}),
    ({"TENSORBOARD_LOGGING_DIR": "~/tb"}, {"tensorboard_logging_dir": Path("~/tb")}),
    ({contract.RESTORE_OUTCOME_FD: "7"}, {"restore_outcome_fd": 7}),
    ({contract.TEST_HOLD_AT_STEP: "2"}, {"test_hold_at_step": "2"}),
    ({contract.TEST_HF_HOLD: "1:save:10"}, {"test_hf_hold": "1:save:10"}),
    ({contract.TEST_HOLD_SECONDS: "0.5"}, {"test_hold_seconds": "0.5"}),
]


@pytest.mark.parametrize("environ,changed", CASES, ids=[",".join(e) or "defaults" for e, _ in CASES])
def test_from_environ(environ, changed) -> None:
    got = WorkerEnv.from_environ(environ)
    assert got == WorkerEnv(**{**DEFAULTS.__dict__, **changed})
    assert dict(got.environ) == environ


@pytest.mark.parametrize("name", [contract.RANK, contract.LOCAL_RANK, contract.WORLD_SIZE, contract.LOCAL_WORLD_SIZE,
                                  contract.ATTEMPT, contract.JOB_INCARNATION, contract.RESTORE_OUTCOME_FD])
def test_a_bad_integer_names_its_variable(name) -> None:
    with pytest.raises(WorkerEnvError, match=rf"^{name}: 'two' is not a whole number$"):
        WorkerEnv.from_environ({name: "two"})


def test_reads_this_process_environment_on_every_call(monkeypatch) -> None:
    monkeypatch.setenv(contract.RANK, "5")
    assert WorkerEnv.from_environ().rank == 5
    monkeypatch.setenv(contract.RANK, "6")
    assert WorkerEnv.from_environ().rank == 6
    snapshot = WorkerEnv.from_environ()
    monkeypatch.setenv(contract.RANK, "7")
    assert snapshot.environ[contract.RANK] == "6"  # a copy, not the live environment


def test_a_worker_reads_what_the_launcher_wrote_for_it(tmp_path) -> None:
    cfg = LaunchConfig.from_env({contract.NNODES: "2", contract.NODE_RANK: "1", contract.NPROC_PER_NODE: "2",
                                 contract.MASTER_ADDR: "x", contract.MASTER_PORT: "29500", contract.ATTEMPT: "3",
                                 contract.LOCAL_CHECKPOINT_DIR: str(tmp_path)}, [])
    pod = launch_config.pod_environ()
    got = WorkerEnv.from_environ(worker_env(cfg, 1, {**pod, contract.ATTEMPT: "3"}, tmp_path / "checkpoint-5"))
    assert (got.rank, got.local_rank, got.local_rank_set, got.world_size, got.local_world_size) == (3, 1, True, 4, 2)
    assert (got.attempt, got.sync_by_launcher) == (3, True)
    assert (got.local_checkpoint_dir, got.resume_from) == (tmp_path, tmp_path / "checkpoint-5")
