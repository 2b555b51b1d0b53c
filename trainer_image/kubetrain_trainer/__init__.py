"""kubetrain's in-pod training runtime: an HF-Trainer-style API that resumes exactly.

Only what users need is re-exported here; everything else is an implementation
detail of its module.
"""

import os as _os

from .args import ConfigError, TrainingArguments
from .callbacks import EarlyStoppingCallback, PrinterCallback, ProgressCallback, TrainerCallback, TrainerControl
from .state import (EvalPrediction, NonFiniteLossError, PredictionOutput, TrainerState, TrainingPreempted,
                    TrainOutput)

from .contract import EXIT_INVALID_CONFIG as _EXIT_INVALID_CONFIG, SYNC_BY_LAUNCHER as _SYNC_BY_LAUNCHER
from .exiting import exit_82_on_config_error as _exit_82_on_config_error

if _os.environ.get(_SYNC_BY_LAUNCHER) == "1":  # a worker of the launcher (docs/contract.md, exit codes)
    _exit_82_on_config_error(ConfigError, _EXIT_INVALID_CONFIG)


def __getattr__(name: str):
    # The Trainer pulls in torch (seconds to import). Loading it lazily keeps
    # `python -m kubetrain_trainer.launch` light: the launcher must install its
    # SIGTERM handler at once and never needs torch itself.
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "EarlyStoppingCallback",
    "PrinterCallback",
    "ProgressCallback",
    "EvalPrediction",
    "NonFiniteLossError",
    "PredictionOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "TrainingPreempted",
    "TrainOutput",
]
