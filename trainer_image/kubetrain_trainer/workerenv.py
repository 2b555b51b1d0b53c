"""The environment of a worker process, read in one place (docs/contract.md).

A worker is what the launcher (or torchrun, or accelerate) starts: the built-in
trainer, a user's `Trainer` script, an HF script with the kubetrain callbacks.
Every module of the worker side takes what it needs from `WorkerEnv` (or as an
argument) instead of reading `os.environ` itself; the launcher's own parse of
the pod contract is `launch_config.py`. tests/unit/trainer/test_env_readers.py
fails when another module reads the environment.

Variable names come from `contract.py`. Unset and empty variables take the
defaults below; a variable that must be a whole number and is not raises
`WorkerEnvError` naming it. The test hooks stay raw text: the hook that uses one
validates it with its own message (builtin.test_hooks, hf.parse_holds).

The environment is read on every `from_environ()` call, never cached: tests
and launchers set it per process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from kubetrain_trainer import contract


TENSORBOARD_LOGGING_DIR = "TENSORBOARD_LOGGING_DIR"
"""HF 5's variable for the TensorBoard reporter's folder (its `TensorBoardCallback` reads it; not the pod contract)."""


class WorkerEnvError(ValueError):
    """A variable of the worker's environment has a value of the wrong kind; the message names it."""


def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise WorkerEnvError(f"{name}: {raw!r} is not a whole number") from None


def _path(env: Mapping[str, str], name: str) -> Path | None:
    raw = env.get(name)
    return Path(raw) if raw else None


@dataclass(frozen=True)
class WorkerEnv:
    """What a worker process knows from its environment, typed."""

    rank: int = 0
    """RANK: this process's global rank (0 without a distributed launcher)."""
    local_rank: int = 0
    """LOCAL_RANK: this process's rank on its node."""
    local_rank_set: bool = False
    """Whether LOCAL_RANK was given at all (a distributed launcher started this process)."""
    world_size: int = 1
    """WORLD_SIZE: processes in the job."""
    local_world_size: int = 1
    """LOCAL_WORLD_SIZE: processes on this node."""
    attempt: int | None = None
    """KUBETRAIN_ATTEMPT (None: not run by kubetrain)."""
    incarnation: int = 0
    """KUBETRAIN_JOB_INCARNATION."""
    strategy: str = "ddp"
    """KUBETRAIN_STRATEGY."""
    checkpoint_uri: str | None = None
    """KUBETRAIN_CHECKPOINT_URI (None: no checkpoint storage)."""
    sync_by_launcher: bool = False
    """KUBETRAIN_SYNC_BY_LAUNCHER=1: the launcher uploads checkpoints, the worker must not."""
    local_checkpoint_dir: Path | None = None
    """KUBETRAIN_LOCAL_CHECKPOINT_DIR: the launcher's local output folder."""
    resume_from: Path | None = None
    """KUBETRAIN_RESUME_FROM: the restored checkpoint to resume from (None: none)."""
    restore_outcome_fd: int | None = None
    """KUBETRAIN_RESTORE_OUTCOME_FD: the pipe the launcher hands the restore's outcome through, when
    it started this worker before the restore ended (handoff.py; None: RESUME_FROM says it)."""
    progress_file: Path | None = None
    """KUBETRAIN_PROGRESS_FILE: where to write the progress report (None: nowhere)."""
    tensorboard_logging_dir: Path | None = None
    """TENSORBOARD_LOGGING_DIR (HF 5's, not the pod contract's): the TensorBoard reporter's folder, `~` expanded
    (None: a folder per run under `logging_dir`, reporting.py)."""
    test_hold_at_step: str = ""
    """KUBETRAIN_TEST_HOLD_AT_STEP, raw (test hook of the built-in trainer)."""
    test_hf_hold: str = ""
    """KUBETRAIN_TEST_HF_HOLD, raw (test hook of the HF callback)."""
    test_hold_seconds: str = ""
    """KUBETRAIN_TEST_HOLD_SECONDS, raw (how long either hook holds; each defaults to 600)."""
    environ: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    """A copy of the whole environment, for the parsers that take a mapping (StorageConfig.from_env,
    the built-in trainer's load_config) - never the live os.environ."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "WorkerEnv":
        """Parse `environ` (this process's environment when None); WorkerEnvError names a bad variable."""
        env = dict(os.environ if environ is None else environ)
        return cls(
            rank=_int(env, contract.RANK, 0),
            local_rank=_int(env, contract.LOCAL_RANK, 0),
            local_rank_set=contract.LOCAL_RANK in env,
            world_size=_int(env, contract.WORLD_SIZE, 1),
            local_world_size=_int(env, contract.LOCAL_WORLD_SIZE, 1),
            attempt=_int(env, contract.ATTEMPT, None),
            incarnation=_int(env, contract.JOB_INCARNATION, 0),
            strategy=env.get(contract.STRATEGY, "ddp"),
            checkpoint_uri=env.get(contract.CHECKPOINT_URI) or None,
            sync_by_launcher=env.get(contract.SYNC_BY_LAUNCHER) == "1",
            local_checkpoint_dir=_path(env, contract.LOCAL_CHECKPOINT_DIR),
            resume_from=_path(env, contract.RESUME_FROM),
            restore_outcome_fd=_int(env, contract.RESTORE_OUTCOME_FD, None),
            progress_file=_path(env, contract.PROGRESS_FILE),
            tensorboard_logging_dir=_path(env, TENSORBOARD_LOGGING_DIR),
            test_hold_at_step=env.get(contract.TEST_HOLD_AT_STEP, ""),
            test_hf_hold=env.get(contract.TEST_HF_HOLD, ""),
            test_hold_seconds=env.get(contract.TEST_HOLD_SECONDS, ""),
            environ=env,
        )


def unwatched_output_dir(output_dir: str | os.PathLike, env: "WorkerEnv") -> str | None:
    """Why `output_dir` cannot hold this worker's checkpoints, or None. Under the launcher with checkpoint storage,
    only `KUBETRAIN_LOCAL_CHECKPOINT_DIR` is watched and uploaded: checkpoints anywhere else are never stored, and
    a preempted attempt starts over (an HF script's `output_dir="my_model"` did exactly that, silently)."""
    local = env.local_checkpoint_dir
    if not (env.sync_by_launcher and env.checkpoint_uri and local):
        return None
    if Path(output_dir).resolve() == Path(local).resolve():  # the watcher looks at its checkpoint-N children only
        return None
    return (f"output_dir {str(output_dir)!r} is not the folder the launcher uploads to checkpoint storage "
            f"({local}, {contract.LOCAL_CHECKPOINT_DIR}): its checkpoints would never be stored and a preempted "
            f"attempt would start over; use output_dir=os.environ[{contract.LOCAL_CHECKPOINT_DIR!r}] itself "
            "(or save_strategy 'no' for a Trainer that only evaluates)")
