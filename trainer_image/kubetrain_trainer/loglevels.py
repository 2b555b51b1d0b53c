"""Which log level each process uses: `log_level`, `log_level_replica`, `log_on_each_node`.

HF users set these three arguments and call `args.get_process_log_level()`
before building the Trainer (the guide's logging recipe), so the rules are the
HF Trainer's:

- the process that "should log" uses `log_level`; every other one uses
  `log_level_replica`;
- with `log_on_each_node` (the default) the local main process of every node
  should log; without it only the global main process (node 0's) does;
- "passive" leaves the level alone: the application's own setup (or the
  default) decides, and the Trainer sets nothing.

Ranks come from the environment (RANK, LOCAL_RANK: the launcher and torchrun
set both; read by `workerenv.py`), so the arguments answer before any process group exists and
without importing torch.
"""

from __future__ import annotations

import logging
from typing import Literal

from kubetrain_trainer.workerenv import WorkerEnv

LOGGER_NAME = "kubetrain_trainer"

LogLevel = Literal["debug", "info", "warning", "error", "critical", "passive"]

LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR, "critical": logging.CRITICAL}
"""Level names of `log_level` / `log_level_replica`; "passive" is the absence of one."""


class ProcessLogLevels:
    """The log-level part of `TrainingArguments` (a mixin: it adds no fields)."""

    log_level: str
    log_level_replica: str
    log_on_each_node: bool

    @property
    def process_index(self) -> int:
        """This process's global rank (0 without a distributed launcher)."""
        return WorkerEnv.from_environ().rank

    @property
    def local_process_index(self) -> int:
        """This process's rank on its node (0 without a distributed launcher)."""
        return WorkerEnv.from_environ().local_rank

    @property
    def should_log(self) -> bool:
        """Whether this process logs at `log_level` (else at `log_level_replica`)."""
        return self.local_process_index == 0 if self.log_on_each_node else self.process_index == 0

    def process_log_level_name(self) -> str:
        """The level name that applies to this process: `log_level` or `log_level_replica`."""
        return self.log_level if self.should_log else self.log_level_replica

    def get_process_log_level(self) -> int:
        """The level (a `logging` int) of this process; "passive" answers the level in effect now."""
        name = self.process_log_level_name()
        if name == "passive":
            return logging.getLogger(LOGGER_NAME).getEffectiveLevel()
        return LOG_LEVELS[name]


def apply_process_log_level(args: ProcessLogLevels, rank: int) -> None:
    """Set the trainer's logger to this process's level ("passive": untouched) and give it a handler.

    The handler is added only when neither the trainer's logger nor the root
    logger has one: an application that configured logging keeps its own.
    """
    logger = logging.getLogger(LOGGER_NAME)
    if args.process_log_level_name() != "passive":
        logger.setLevel(args.get_process_log_level())
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s"))
        logger.addHandler(handler)
