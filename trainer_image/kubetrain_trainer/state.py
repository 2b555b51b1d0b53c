"""What the loop knows about its own progress, saved as `trainer_state.json`.

`TrainerState` follows the Hugging Face fields (global_step, epoch,
log_history, best_metric, best_model_checkpoint, ...) and adds what an exact
resume needs: the data position (epoch and samples consumed in it) and the
running loss sums since the last log, so that a stopped and resumed run logs
bitwise the same losses as one that never stopped.

A checkpoint keeps the two apart: `trainer_state.json` holds HF's fields only
(the HF Trainer's `TrainerState.load_from_json` reads it, and refuses any
other key), `kubetrain_state.json` beside it the additions (`RESUME_FIELDS`).
Reading accepts both files and older checkpoints with the additions inline.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from .layout import KUBETRAIN_STATE

logger = logging.getLogger("kubetrain_trainer")


class TrainingPreempted(RuntimeError):
    """Training stopped on SIGTERM after an emergency checkpoint; the job should be resumed."""

    def __init__(self, step: int, checkpoint_dir: str | None):
        self.step = step
        self.checkpoint_dir = checkpoint_dir
        where = f"checkpoint {checkpoint_dir}" if checkpoint_dir else "no checkpoint"
        super().__init__(f"preempted at step {step}; {where}")


class NonFiniteLossError(RuntimeError):
    """A NaN/inf loss with `nan_inf_policy: stop`."""


@dataclass
class DataPosition:
    """Where the training data stands: the next batch is sample `samples` of epoch `epoch`."""

    epoch: int = 0
    samples: int = 0
    """Samples consumed in this epoch across all processes (independent of the world size)."""


@dataclass
class TrainerState:
    """Progress of a run; written into every checkpoint as `trainer_state.json`."""

    global_step: int = 0
    """Optimizer steps taken (skipped NaN steps included: their data was consumed)."""
    epoch: float = 0.0
    """Fractional epoch reached."""
    max_steps: int = 0
    num_train_epochs: int = 0
    logging_steps: int = 0
    eval_steps: int = 0
    save_steps: int = 0
    train_batch_size: int = 0
    """One process's micro-batch (`per_device_train_batch_size`), as HF writes it; the global batch of a step is
    this x `gradient_accumulation_steps` x `world_size`."""
    world_size: int = 1
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    """Step of the evaluation that set `best_metric`; only `checkpoint-<best_global_step>` is the best model."""
    best_model_checkpoint: str | None = None
    last_checkpoint_dir: str | None = None
    """Folder of the most recently committed local checkpoint (set before `on_save` fires)."""
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    total_flos: float = 0.0
    num_input_tokens_seen: int = 0
    """Input tokens trained on, over every rank, with `include_num_input_tokens_seen` (tokens_seen.py); else 0, as
    HF writes it then. Saved with HF's fields: a resumed run continues the count."""
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    """HF's hyperparameter-search fields (kubetrain runs none): written as HF writes them outside a search."""
    data_position: DataPosition = field(default_factory=DataPosition)
    loss_since_log: float = 0.0
    """Sum of step losses since the last log - in the checkpoint, so a resumed run logs the same average."""
    steps_since_log: int = 0
    loss_total: float = 0.0
    """Sum of all finite step losses (for `TrainOutput.training_loss`)."""
    loss_count: int = 0
    skipped_steps: int = 0
    """Steps whose update was dropped because the loss was NaN/inf."""
    epoch_end_pending: dict[str, float | None] | None = None
    """Set by a preemption right after an epoch's last step: the epoch's end (on_epoch_end, the "epoch"
    strategies' eval, save and log) had not run; the resumed run runs it first, logging this step's
    `grad_norm` and `learning_rate` (`data_position` is already the next epoch's start)."""
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)
    """Saved state of callbacks that have some (e.g. early stopping patience), by class name as in HF: one
    callback's dict, or a list of them where several callbacks share a class."""

    def save_to_json(self, path: str | Path) -> None:
        """HF's fields only (as HF writes `trainer_state.json`); `save_resume_fields` writes the rest."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in RESUME_FIELDS}
        Path(path).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")

    def save_resume_fields(self, folder: str | Path) -> None:
        """`kubetrain_state.json` in a checkpoint folder: the fields beyond HF's (`RESUME_FIELDS`)."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k in RESUME_FIELDS}
        fields["global_step"] = self.global_step  # ties it to its trainer_state.json (`read_saved`)
        (Path(folder) / KUBETRAIN_STATE).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")

    @classmethod
    def load_from_json(cls, path: str | Path) -> "TrainerState":
        """ValueError naming the entry when the file is not JSON, not an object, or holds a value of another type."""
        return cls.from_saved(read_saved(path))

    @classmethod
    def from_saved(cls, data: Any) -> "TrainerState":
        """The state a checkpoint's JSON holds; without `data_position` (HF's), the start of the data. ValueError
        naming the entry when it is not an object or holds a value of another type."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in known}  # tolerate HF's extra fields
        position = data.pop("data_position", None) or {}
        # The schedule fields are this run's (a resume takes them from its arguments): any number saved there will
        # do. The HF Trainer saves `logging_steps: 1.0` when its command line gave 1.
        _check_types(cls, {k: v for k, v in data.items()
                           if not (k in SCHEDULE_FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool))})
        _check_types(DataPosition, position if isinstance(position, dict) else {"data_position": position})
        return cls(**data, data_position=DataPosition(**position))


SCHEDULE_FIELDS = frozenset({"max_steps", "num_train_epochs", "logging_steps", "eval_steps", "save_steps",
                             "train_batch_size", "world_size"})
"""Saved fields a resume takes from its own arguments instead (`ResumingMixin._load_state`)."""
RESUME_FIELDS = frozenset({"world_size", "last_checkpoint_dir", "data_position", "loss_since_log", "steps_since_log",
                           "loss_total", "loss_count", "skipped_steps", "epoch_end_pending"})
"""kubetrain's `TrainerState` fields that HF's has not: saved in `kubetrain_state.json`."""


def read_saved(path: str | Path) -> Any:
    """A saved `trainer_state.json` with the `kubetrain_state.json` beside it, if any (an HF Trainer's
    checkpoint has none; an older kubetrain one holds those fields inline). ValueError when either is not
    JSON or the latter not an object (`from_saved` checks the rest)."""
    path = Path(path)
    data = json.loads(path.read_text())
    extra = path.with_name(KUBETRAIN_STATE)
    if isinstance(data, dict) and extra.is_file():
        try:
            more = json.loads(extra.read_text())
            if not isinstance(more, dict):
                raise ValueError(f"expected a JSON object, got {type(more).__name__}")
        except ValueError as exc:
            exc.add_note(f"while reading {extra}")
            raise
        step = more.pop("global_step", data.get("global_step"))
        if step != data.get("global_step"):
            # Another step's (the HF Trainer re-saved the folder in place over a kubetrain checkpoint): its data
            # position and loss sums are not this state's. Left out: the position is derived as HF derives it.
            logger.warning("%s is of step %s, %s of step %s: %s is not used", extra, step, path.name,
                           data.get("global_step"), extra.name)
            return data
        data = {**data, **more}
    return data


def _check_types(cls: type, data: dict[str, Any]) -> None:
    """Each of `data`'s values has its field's JSON type (an int is a float too, a bool is neither)."""
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        if name not in hints or not _fits(value, hints[name]):
            raise ValueError(f"{name}: {value!r} is not of type {hints.get(name, 'a field of ' + cls.__name__)}")


def _fits(value: Any, tp: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in typing.get_args(tp))
    tp = typing.get_origin(tp) or tp
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if isinstance(value, bool):
        return tp is bool
    return isinstance(value, (int, float) if tp is float else tp)


def defer_epoch_end(state: TrainerState, grad_norm: Any, lr: Any) -> None:
    """Preempted after an epoch's last step: the resumed run ends that epoch first (see `epoch_end_pending`)."""
    state.epoch_end_pending = {"grad_norm": None if grad_norm is None else float(grad_norm),
                               "learning_rate": None if lr is None else float(lr)}


def take_epoch_end(state: TrainerState) -> tuple[Any, float | None]:
    """(grad_norm, learning_rate) of the step before a deferred epoch end (see `defer_epoch_end`), else Nones."""
    import torch

    pending, state.epoch_end_pending = state.epoch_end_pending or {}, None
    norm = pending.get("grad_norm")
    return (None if norm is None else torch.tensor(norm)), pending.get("learning_rate")


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict[str, float]


class PredictionOutput(NamedTuple):
    predictions: Any
    label_ids: Any
    metrics: dict[str, float]


class EvalPrediction:
    """What `compute_metrics` receives, as HF's: `predictions` and `label_ids` and, with `include_for_metrics`,
    `inputs` (the model's main input of every sample) and `losses` (each sample's batch loss); it unpacks as
    the tuple of those it holds (`predictions, labels = eval_pred`)."""

    def __init__(self, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None) -> None:
        self.predictions, self.label_ids, self.inputs, self.losses = predictions, label_ids, inputs, losses
        self.elements = (predictions, label_ids, *(x for x in (inputs, losses) if x is not None))

    def __iter__(self):
        return iter(self.elements)

    def __getitem__(self, idx: int) -> Any:
        if idx < 0 or idx >= len(self.elements):
            raise IndexError("tuple index out of range")
        return self.elements[idx]
