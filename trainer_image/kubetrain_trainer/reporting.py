"""Reporters named by `report_to`: TensorBoard and a JSON-lines log; and the launcher's progress report.

Both are callbacks that act on `on_log` on the main process only. An empty
`report_to` simply adds none, so the loop never checks whether reporting is on.
They close their files when training ends and reopen them (appending) for a
record logged later, e.g. by a `trainer.evaluate()` after `train()`.
With `disable_tqdm` (no progress bar to print the log dicts above) the
`PrinterCallback` prints them, as in HF.
Under the launcher (it sets KUBETRAIN_PROGRESS_FILE) every run also reports its
progress to it, whatever `report_to` says (`progress.py`): that feeds the pod's
/metrics and /progress, not a user-facing log.
The JSON-lines log (`<logging_dir>/log.jsonl`, one record per line) is the
machine-readable history: easy to tail from a pod and to parse in tests.
TensorBoard writes where HF 5's `TensorBoardCallback` does: `$TENSORBOARD_LOGGING_DIR`,
else a folder per run, `<logging_dir>/<Mon DD_HH-MM-SS>_<hostname>` (with the
default `logging_dir`, HF's `<output_dir>/runs/...`), so each run or attempt is
a run of its own in `tensorboard --logdir <output_dir>/runs`.
"""

from __future__ import annotations

import json
import math
import socket
import time
from datetime import datetime
from pathlib import Path

from .args import TrainingArguments
from .callbacks import PrinterCallback, TrainerCallback
from .progress import progress_callbacks
from .workerenv import WorkerEnv


class JsonLinesCallback(TrainerCallback):
    """Appends each log record, with step and wall time, to `<logging_dir>/log.jsonl`."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else None
        self._file = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self._file is None:
            self._open(args)

    def _open(self, args) -> None:
        self.path = self.path or Path(args.logging_dir) / "log.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)  # line-buffered: a killed pod keeps whole lines

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        if self._file is None:  # logged outside train(), or after it (closed at its end)
            self._open(args)
        record = {"step": state.global_step, "time": time.time(),
                  **{k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in logs.items()}}
        self._file.write(json.dumps(record) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        if self._file is not None:
            self._file.close()
            self._file = None


def tensorboard_dir(args: TrainingArguments, env: WorkerEnv) -> Path:
    """The TensorBoard reporter's folder as HF 5 chooses it (see the module docstring)."""
    if env.tensorboard_logging_dir is not None:
        return env.tensorboard_logging_dir.expanduser()
    return Path(args.logging_dir) / f"{datetime.now().strftime('%b%d_%H-%M-%S')}_{socket.gethostname()}"


class TensorBoardCallback(TrainerCallback):
    """Writes numeric log values as TensorBoard scalars in `tensorboard_dir` (chosen once: a record logged after
    training, e.g. by `trainer.evaluate()`, goes to the same run)."""

    def __init__(self):
        self.writer = None
        self.logging_dir: Path | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.writer is None:
            self._open(args)
        self.writer.add_text("args", args.to_json_string())

    def _open(self, args) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported lazily: it is slow to import

        self.logging_dir = self.logging_dir or tensorboard_dir(args, WorkerEnv.from_environ())
        self.writer = SummaryWriter(log_dir=str(self.logging_dir))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        if self.writer is None:  # logged outside train(), or after it (closed at its end): a new event file
            self._open(args)
        for key, value in logs.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                tag = key if key.startswith("eval_") else f"train/{key}"
                self.writer.add_scalar(tag.replace("eval_", "eval/", 1), value, state.global_step)
        self.writer.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


_REPORTERS = {"tensorboard": TensorBoardCallback, "jsonl": JsonLinesCallback}


def reporters_for(args: TrainingArguments) -> list[TrainerCallback]:
    printer = [PrinterCallback()] if args.disable_tqdm else []  # with the bar, ProgressCallback prints the logs
    return [*(_REPORTERS[name]() for name in args.report_to), *printer, *progress_callbacks()]
