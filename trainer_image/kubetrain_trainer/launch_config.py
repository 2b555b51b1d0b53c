"""The pod contract's environment for the launcher, read and validated once (docs/contract.md).

`pod_environ()` is the launcher's one read of its environment (the worker side's is
`workerenv.py`); `LaunchConfig.from_env` is the only parser of the variables the operator sets on a training
pod (`builders.get_env` on the operator side); a bad value raises `ConfigError` naming the
variable, and the launcher exits 82 (invalid configuration) without starting anything.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from kubetrain_trainer.contract import (
    ATTEMPT,
    CHECKPOINT_COMMIT,
    CHECKPOINT_SETTLE,
    CHECKPOINT_URI,
    JOB_INCARNATION,
    JOB_NAME,
    LOCAL_CHECKPOINT_DIR,
    LOG_LEVEL,
    METRICS_PORT,
    NAMESPACE,
    POD_NAME,
    RESTORE_TIMEOUT,
    S3_AUTH_RETRY,
    S3_SSE,
    S3_SSE_KMS_KEY_ID,
    S3_SSE_VALUES,
    STRATEGY,
    TERMINATION_GRACE_SECONDS,
    TERMINATION_LOG,
    TEST_UPLOAD_RATE,
    TRAINER_ARGS,
    UPLOAD_TIMEOUT,
)
from kubetrain_trainer.command import shown_command
from kubetrain_trainer.decisions import RetentionPolicy
from kubetrain_trainer.metrics import DEFAULT_PORT
from kubetrain_trainer.readiness import COMMIT_MODES, CommitMode
from kubetrain_trainer.storage_config import StorageConfig

STRATEGIES = ("ddp", "fsdp", "zero3")
BUILTIN_COMMAND = (sys.executable, "-m", "kubetrain_trainer.builtin")


def pod_environ() -> dict[str, str]:
    """A copy of this process's environment: what `LaunchConfig.from_env` parses, what the storage
    configuration is read from and what the workers inherit."""
    return dict(os.environ)


def log_level(env: Mapping[str, str]) -> str:
    """KUBETRAIN_LOG_LEVEL, upper-cased (INFO when unset or empty); ConfigError naming it for a name `logging`
    does not know (which `logging.basicConfig` would raise as a ValueError: exit 1, retried until backoffLimit)."""
    raw = env.get(LOG_LEVEL) or "INFO"
    level = raw.strip().upper()
    if level not in logging.getLevelNamesMapping():
        raise ConfigError(f"{LOG_LEVEL}: unknown level {raw!r}; allowed: debug, info, warning, error, critical")
    return level


class ConfigError(ValueError):
    """The pod environment is invalid; the message names the variable. Never retried (exit 82)."""


@dataclass(frozen=True)
class LaunchConfig:
    """The pod contract's environment, validated."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    attempt: int
    incarnation: int
    """KUBETRAIN_JOB_INCARNATION (the job's creation time; 0 when not given)."""
    strategy: str
    checkpoint_uri: str | None
    """None: the job has no checkpoint storage (nothing restored or uploaded)."""
    trainer_args: Mapping[str, object]
    local_dir: Path
    """Where checkpoints are restored to and watched: the trainer's output_dir."""
    command: tuple[str, ...]
    builtin: bool
    job_name: str = ""
    namespace: str = ""
    pod_name: str = ""
    grace_s: float = 30.0
    """The pod's terminationGracePeriodSeconds (KUBETRAIN_TERMINATION_GRACE_SECONDS)."""
    upload_wait_s: float = 1800.0
    """How long a finished run waits for pending uploads (KUBETRAIN_UPLOAD_TIMEOUT_SECONDS)."""
    restore_timeout_s: float = 600.0
    """How long S3 may stay unreachable before the start gives up (KUBETRAIN_RESTORE_TIMEOUT_SECONDS)."""
    access_retry_s: float = 120.0
    """How long refused access or a missing bucket (S3 401/403/404) is retried at start before exit 82
    (KUBETRAIN_S3_AUTH_RETRY_SECONDS): a Secret, IAM policy or bucket may still be propagating."""
    settle_s: float = 30.0
    """How long an unmarked in-place checkpoint folder must stay unchanged before it is committed
    (KUBETRAIN_CHECKPOINT_SETTLE_SECONDS, see readiness.py)."""
    commit_mode: CommitMode = "auto"
    """KUBETRAIN_CHECKPOINT_COMMIT: `auto` (ready markers, else quiescence) or `marker` (only marked folders)."""
    metrics_port: int = DEFAULT_PORT
    """KUBETRAIN_METRICS_PORT: where /metrics and /progress are served; 0: not at all."""
    termination_log: Path = Path("/dev/termination-log")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @classmethod
    def from_env(cls, env: Mapping[str, str], argv: Sequence[str]) -> "LaunchConfig":
        nnodes = _int(env, "NNODES", 1, minimum=1)
        node_rank = _int(env, "NODE_RANK", 0, minimum=0)
        if node_rank >= nnodes:
            raise ConfigError(f"NODE_RANK: {node_rank} is not below NNODES={nnodes}")
        strategy = env.get(STRATEGY) or "ddp"
        if strategy not in STRATEGIES:
            raise ConfigError(f"KUBETRAIN_STRATEGY: unknown value {strategy!r}; allowed: {', '.join(STRATEGIES)}")
        uri = env.get(CHECKPOINT_URI) or None
        if uri is not None and (not uri.startswith("s3://") or len(uri) <= len("s3://")):
            raise ConfigError(f"KUBETRAIN_CHECKPOINT_URI: must look like s3://bucket/prefix, got {uri!r}")
        raw_args = env.get(TRAINER_ARGS) or "{}"
        try:
            trainer_args = json.loads(raw_args)
        except ValueError as e:
            raise ConfigError(f"KUBETRAIN_TRAINER_ARGS: not valid JSON ({e})") from None
        if not isinstance(trainer_args, dict):
            raise ConfigError("KUBETRAIN_TRAINER_ARGS: must be a JSON object")
        command = tuple(argv)
        if command and command[0] == "--":
            command = command[1:]
            if not command:
                raise ConfigError("command: nothing after '--'")
        elif command:
            raise ConfigError(f"command: expected '-- <command...>', got {shown_command(command, env)!r}")
        builtin = not command
        local_dir = Path(env.get(LOCAL_CHECKPOINT_DIR) or "/tmp/kubetrain/checkpoints")
        if builtin and trainer_args.get("output_dir"):
            local_dir = Path(str(trainer_args["output_dir"]))
        port = _int(env, "MASTER_PORT", 29500, minimum=1)
        commit_mode = env.get(CHECKPOINT_COMMIT) or "auto"
        if commit_mode not in COMMIT_MODES:
            raise ConfigError(f"{CHECKPOINT_COMMIT}: unknown value {commit_mode!r}; allowed: auto, marker")
        metrics_port = _int(env, METRICS_PORT, DEFAULT_PORT, minimum=0)
        _int(env, TEST_UPLOAD_RATE, 0, minimum=0)  # checked here (exit 82); storage reads it
        sse = env.get(S3_SSE, "").strip()  # as TEST_UPLOAD_RATE: checked here, read by storage
        if sse and sse not in S3_SSE_VALUES:
            raise ConfigError(f"{S3_SSE}: unknown value {sse!r}; allowed: {', '.join(S3_SSE_VALUES)}")
        if env.get(S3_SSE_KMS_KEY_ID, "").strip() and not sse.startswith("aws:kms"):
            raise ConfigError(f"{S3_SSE_KMS_KEY_ID}: needs {S3_SSE}=aws:kms (or aws:kms:dsse)")
        if uri is not None:
            try:  # what storage would refuse once the checkpoint session starts (addressing, endpoint): exit 82 now
                StorageConfig.from_env(env)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        for name, value in (("MASTER_PORT", port), ("KUBETRAIN_METRICS_PORT", metrics_port)):
            if value > 65535:
                raise ConfigError(f"{name}: {value} is not a TCP port")
        return cls(
            nnodes=nnodes,
            node_rank=node_rank,
            nproc_per_node=_int(env, "NPROC_PER_NODE", 1, minimum=1),
            master_addr=env.get("MASTER_ADDR") or ("127.0.0.1" if nnodes == 1 else _missing("MASTER_ADDR")),
            master_port=port,
            attempt=_int(env, ATTEMPT, 1, minimum=1),
            incarnation=_int(env, JOB_INCARNATION, 0, minimum=0),
            strategy=strategy,
            checkpoint_uri=uri,
            trainer_args=trainer_args,
            local_dir=local_dir,
            command=command or BUILTIN_COMMAND,
            builtin=builtin,
            job_name=env.get(JOB_NAME, ""),
            namespace=env.get(NAMESPACE, ""),
            pod_name=env.get(POD_NAME, ""),
            grace_s=_float(env, TERMINATION_GRACE_SECONDS, 30.0),
            upload_wait_s=_float(env, UPLOAD_TIMEOUT, 1800.0),
            restore_timeout_s=_float(env, RESTORE_TIMEOUT, 600.0),
            access_retry_s=_float(env, S3_AUTH_RETRY, 120.0),
            settle_s=_float(env, CHECKPOINT_SETTLE, 30.0),
            commit_mode=commit_mode,
            metrics_port=metrics_port,
            termination_log=Path(env.get(TERMINATION_LOG) or "/dev/termination-log"),
        )

    def make_local_dir(self) -> None:
        """Create `local_dir`; ConfigError when it cannot be or, already there (a folder the image holds), cannot be
        written to (a read-only root file system, a file in the way): no retry changes that. Other errors (a full
        disk) propagate."""
        doing = "create"
        try:
            self.local_dir.mkdir(parents=True, exist_ok=True)
            doing = "write to"
            with tempfile.TemporaryFile(dir=self.local_dir):  # where a checkpoint goes: on the first save, too late
                pass
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST):
                raise
            name = "KUBETRAIN_TRAINER_ARGS output_dir" if self.builtin and self.trainer_args.get("output_dir") \
                else LOCAL_CHECKPOINT_DIR
            raise ConfigError(f"{name}: cannot {doing} {str(self.local_dir)!r} ({e.strerror}): use a folder under "
                              "/tmp or on a writable volume (a kubetrain pod's root file system is read-only)") from None

    def retention(self) -> RetentionPolicy:
        """Remote retention from the trainer's own arguments (HF defaults for the best metric)."""
        a = self.trainer_args
        metric = a.get("metric_for_best_model") or ("loss" if a.get("load_best_model_at_end") else None)
        limit = a.get("save_total_limit")
        greater = a.get("greater_is_better")
        return RetentionPolicy(
            save_total_limit=limit if isinstance(limit, int) and not isinstance(limit, bool) else None,
            metric_for_best_model=metric if isinstance(metric, str) else None,
            greater_is_better=greater if isinstance(greater, bool) else None,
        )


def _missing(name: str) -> str:
    raise ConfigError(f"{name}: required when NNODES > 1")


def _int(env: Mapping[str, str], name: str, default: int, *, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}: must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {value}")
    return value


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}: must be a number of seconds, got {raw!r}") from None
    if not value > 0 or value == math.inf:  # NaN compares false: a wait that never ends, a rule never met
        raise ConfigError(f"{name}: must be a finite number of seconds > 0, got {raw!r}")
    return value
