"""kubetrain's in-pod training runtime: an HF-Trainer-style API that resumes exactly.

Only what users need is re-exported here; everything else is an implementation
detail of its module.
"""

from .args import ConfigError, TrainingArguments
from .callbacks import EarlyStoppingCallback, TrainerCallback, TrainerControl
from .state import (EvalPrediction, NonFiniteLossError, PredictionOutput, TrainerState, TrainingPreempted,
                    TrainOutput)
from .trainer import Trainer

__all__ = [
    "ConfigError",
    "EarlyStoppingCallback",
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
