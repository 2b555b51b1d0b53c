"""kubetrain's in-pod training runtime: an HF-Trainer-style API that resumes exactly.

Only what users need is re-exported here; everything else is an implementation
detail of its module.
"""

from .args import ConfigError, TrainingArguments
from .callbacks import EarlyStoppingCallback, PrinterCallback, ProgressCallback, TrainerCallback, TrainerControl
from .state import (EvalPrediction, NonFiniteLossError, PredictionOutput, TrainerState, TrainingPreempted,
                    TrainOutput)


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
