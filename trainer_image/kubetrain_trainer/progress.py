"""Training progress from the workers to their launcher: one small JSON file, rewritten at most once a second.

The launcher serves the pod's metrics and `/progress` (docs/contract.md, "Metrics
and progress endpoint"), but the numbers live in the worker processes, which
are plain subprocesses. They share one thing with the launcher: the local disk.
So the local main process of each node (the one that also writes the node's
checkpoint files) rewrites `$KUBETRAIN_PROGRESS_FILE` atomically (write, then
rename) after a step at most once a second, and at once after a save and at the
end; the launcher reads it only when it is scraped. No socket for the workers
to keep up, nothing that can block a step, nothing lost when the file is
overwritten: the step-time and save-time histograms travel as cumulative
counts.

Writers: `TrainProgressCallback` for kubetrain's own Trainer (added for every
run the launcher started), `kubetrain_trainer.hf.KubetrainCheckpointCallback`
for HF transformers scripts, and `ProgressTracker.from_env()` for a custom loop.
Outside the launcher (no variable) every writer is a no-op. Writing never
raises: a full disk costs the progress report, never the training run.

The writers of kubetrain's callbacks also say whether the training run ended (`run`): a
shell command that swallows its training process's crash (`python train.py; echo done`)
exits 0, and the launcher, seeing a run that began and never ended, fails the pod instead
of reporting success (`outcome.py`). A custom loop opts in with `train_begin(reports_end=True)`
and then must call `train_end()`.

The file's format is internal to the image (writer and reader are this module).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from .callbacks import TrainerCallback
from .contract import PROGRESS_FILE
from .layout import parse_checkpoint_dirname
from .workerenv import WorkerEnv

PROGRESS_FILE_ENV = PROGRESS_FILE
FORMAT = 1
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Upper bounds (seconds) of the step-time histogram; +Inf is implied."""
SAVE_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
"""Upper bounds (seconds) of the checkpoint-save histogram; +Inf is implied."""
RECENT_SAVES = 16
"""How many (step, seconds) of the latest saves the file carries (the launcher looks a step up at commit)."""
RunState = Literal["training", "finished", "preempted"]
RUN_STATES: tuple[RunState, ...] = ("training", "finished", "preempted")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Histogram:
    """Observations per bucket (one more than `bounds`: the last is +Inf), their sum and nothing else."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float = 0.0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> "Histogram":
        return cls(bounds, (0,) * (len(bounds) + 1))

    def observe(self, value: float) -> "Histogram":
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        counts = list(self.counts)
        counts[i] += 1
        return Histogram(self.bounds, tuple(counts), self.total + value)

    @property
    def count(self) -> int:
        return sum(self.counts)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs as Prometheus' histogram buckets want them, +Inf last."""
        out, running = [], 0
        for bound, n in zip((*(repr(float(b)) for b in self.bounds), "+Inf"), self.counts):
            running += n
            out.append((bound, running))
        return out

    def for_file(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sum": self.total}

    @classmethod
    def from_file(cls, bounds: tuple[float, ...], raw: Any) -> "Histogram":
        """The histogram in `raw`; an empty one when it is missing or does not fit these bounds."""
        if isinstance(raw, dict):
            counts, total = raw.get("counts"), raw.get("sum")
            if (isinstance(counts, list) and len(counts) == len(bounds) + 1 and _is_number(total)
                    and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)):
                return cls(bounds, tuple(counts), float(total))
        return cls.empty(bounds)


@dataclass(frozen=True)
class WorkerProgress:
    """One report of the worker's progress, as the launcher reads it from the file."""

    time: float
    """Wall-clock time (epoch seconds) of the report."""
    step: int
    max_steps: int | None = None
    epoch: float | None = None
    loss: float | None = None
    """The loss of the last log record (every `logging_steps`), as the trainer logged it."""
    learning_rate: float | None = None
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    eta_seconds: float | None = None
    step_seconds: Histogram = field(default_factory=lambda: Histogram.empty(STEP_BUCKETS))
    save_seconds: Histogram = field(default_factory=lambda: Histogram.empty(SAVE_BUCKETS))
    saves: tuple[tuple[int, float], ...] = ()
    """(step, seconds) of the latest saves, oldest first."""
    run: RunState | None = None
    """training: a run began and has not ended; finished: it ended (not by a SIGTERM); preempted: it stopped
    after its emergency checkpoint; None: the writer does not report the end of its run."""
    pid: int | None = None
    """The process whose run `run` is (the launcher's own worker, or a process behind a shell)."""

    def for_file(self) -> str:
        body = {"format": FORMAT, "time": self.time, "step": self.step, "maxSteps": self.max_steps,
                "epoch": self.epoch, "loss": self.loss, "learningRate": self.learning_rate,
                "samplesPerSecond": self.samples_per_second, "tokensPerSecond": self.tokens_per_second,
                "etaSeconds": self.eta_seconds, "stepSeconds": self.step_seconds.for_file(),
                "saveSeconds": self.save_seconds.for_file(), "saves": [list(s) for s in self.saves], "run": self.run,
                "pid": self.pid}
        return json.dumps({k: finite_or_none(v) for k, v in body.items()}, allow_nan=False)

    @classmethod
    def from_file(cls, text: str) -> "WorkerProgress":
        """Parse the file; ValueError when it is not a progress report of this format."""
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError("not a kubetrain progress file of format 1")
        step, when = raw.get("step"), raw.get("time")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0 or not _is_number(when):
            raise ValueError("progress file without a valid step and time")
        max_steps = raw.get("maxSteps")
        saves = tuple((s[0], float(s[1])) for s in raw.get("saves") or ()
                      if isinstance(s, list) and len(s) == 2 and isinstance(s[0], int) and _is_number(s[1]))
        def number(key: str) -> float | None:
            return float(raw[key]) if _is_number(raw.get(key)) else None

        return cls(time=float(when), step=step,
                   max_steps=max_steps if isinstance(max_steps, int) and not isinstance(max_steps, bool) else None,
                   epoch=number("epoch"), loss=number("loss"), learning_rate=number("learningRate"),
                   samples_per_second=number("samplesPerSecond"), tokens_per_second=number("tokensPerSecond"),
                   eta_seconds=number("etaSeconds"),
                   step_seconds=Histogram.from_file(STEP_BUCKETS, raw.get("stepSeconds")),
                   save_seconds=Histogram.from_file(SAVE_BUCKETS, raw.get("saveSeconds")), saves=saves,
                   run=raw["run"] if raw.get("run") in RUN_STATES else None,
                   pid=raw["pid"] if isinstance(raw.get("pid"), int) and not isinstance(raw["pid"], bool) else None)

    def save_seconds_of(self, step: int) -> float | None:
        return next((seconds for s, seconds in reversed(self.saves) if s == step), None)

    @property
    def slowest_recent_save(self) -> float | None:
        return max((seconds for _step, seconds in self.saves), default=None)


class ProgressTracker:
    """Worker side: fed with events by a trainer callback (or a custom loop), writes the progress file.

    Throughput is measured over the steps between two writes (so it includes
    data loading, and a save when one happened: what the run really achieves);
    a step's own time runs from `step_begin` to `step_end`; a save's time from
    the trainer's last event before it (step end, log, evaluation) to `saved`.
    `clock` and `wall` are injectable so that the rules are tested without waiting.
    """

    def __init__(self, path: Path, *, min_interval_s: float = 1.0, tokens_per_sample: int | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.path = path
        self.min_interval_s = min_interval_s
        self.tokens_per_sample = tokens_per_sample
        """Tokens in one sample, for trainers that do not count tokens themselves (None: unknown)."""
        self.clock, self.wall = clock, wall
        self.report = WorkerProgress(time=wall(), step=0)
        self.writes = 0
        self._last_write: float | None = None
        self._window: tuple[float, int, int | None] | None = None
        """(clock, step, tokens seen) where the current throughput window began."""
        self._step_began: float | None = None
        self._last_event = clock()
        self._samples_per_step: int | None = None
        self._tokens_seen: int | None = None
        self._learning_rate: Callable[[], float | None] | None = None
        self._failed = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> "ProgressTracker | NullTracker":
        path = WorkerEnv.from_environ(env).progress_file
        return cls(path, **kwargs) if path else NullTracker()

    # ------------------------------------------------------------ events
    def train_begin(self, *, step: int, max_steps: int | None, tokens_seen: int | None = None,
                    reports_end: bool = False) -> None:
        """A run begins; `reports_end`: the caller promises `train_end()` when it ends (kubetrain's callbacks do),
        so that a run that began and never ended fails its pod even when the command exits 0."""
        now = self.clock()
        self._window, self._tokens_seen = (now, step, tokens_seen), tokens_seen
        self._last_event = now
        self._update(step=step, max_steps=max_steps or None)
        if reports_end:
            self._update(run="training", pid=os.getpid())
        self.flush(force=True)

    def step_begin(self) -> None:
        self._step_began = self._last_event = self.clock()

    def step_end(self, *, step: int, max_steps: int | None, epoch: float | None, samples_per_step: int | None,
                 tokens_seen: int | None = None, learning_rate: Callable[[], float | None] | None = None) -> None:
        now = self.clock()
        self._last_event = now
        if self._step_began is not None:
            self._update(step_seconds=self.report.step_seconds.observe(now - self._step_began))
            self._step_began = None
        self._update(step=step, max_steps=max_steps or None, epoch=epoch)
        self._samples_per_step, self._tokens_seen, self._learning_rate = samples_per_step, tokens_seen, learning_rate
        self.flush()

    def event(self) -> None:
        """Any other trainer event (log, evaluation, epoch end): a save's time is measured from the last one."""
        self._last_event = self.clock()

    def logged(self, logs: Mapping[str, Any] | None) -> None:
        self.event()
        logs = logs or {}
        if _is_number(logs.get("loss")):
            self._update(loss=float(logs["loss"]))
        if _is_number(logs.get("learning_rate")):
            self._update(learning_rate=float(logs["learning_rate"]))

    def saved(self, step: int, seconds: float | None = None) -> None:
        """A checkpoint of `step` was saved; `seconds` (a background save's staging-to-commit time) or, by
        default, the time since the last trainer event (a synchronous save)."""
        seconds = max(0.0, self.clock() - self._last_event) if seconds is None else max(0.0, seconds)
        saves = (*self.report.saves, (step, round(seconds, 3)))[-RECENT_SAVES:]
        self._update(save_seconds=self.report.save_seconds.observe(seconds), saves=saves)
        self.flush(force=True)
        self._last_event = self.clock()

    def train_end(self, *, preempted: bool = False) -> None:
        """The run ended: finished, or `preempted` (stopped after its emergency checkpoint)."""
        if self.report.run is not None:
            self._update(run="preempted" if preempted else "finished")
        if not self.flush(force=True) and self.report.run is not None:
            try:  # a stale "training" would fail a finished run: no report says nothing
                self.path.unlink(missing_ok=True)
            except OSError:
                pass

    # ------------------------------------------------------------ writing
    def flush(self, *, force: bool = False) -> bool:
        """Write the report (atomically) if forced or due; False when skipped or it could not be written."""
        now = self.clock()
        if not force and not self._due(now):
            return False
        self._last_write = now
        self._measure(now)
        if self._learning_rate is not None:
            self._update(learning_rate=_safe(self._learning_rate))
        self._update(time=self.wall())
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(self.report.for_file())
            os.replace(tmp, self.path)
        except (OSError, ValueError) as e:
            if not self._failed:  # once: a full disk must not flood the log, nor stop training
                log.warning("cannot write the progress file %s (%s); progress is not reported", self.path, e)
            self._failed = True
            return False
        self.writes += 1
        return True

    def _due(self, now: float) -> bool:
        return self._last_write is None or now - self._last_write >= self.min_interval_s

    def _measure(self, now: float) -> None:
        """Throughput and ETA over the steps since the last write (nothing new: the last values stay)."""
        samples_per_step, tokens_seen = self._samples_per_step, self._tokens_seen
        if self._window is None:
            self._window = (now, self.report.step, tokens_seen)
            return
        began, first_step, first_tokens = self._window
        steps, dt = self.report.step - first_step, now - began
        if steps <= 0 or dt <= 0:
            return
        samples = steps * samples_per_step / dt if samples_per_step else None
        if tokens_seen is not None and first_tokens is not None and tokens_seen > first_tokens:
            tokens = (tokens_seen - first_tokens) / dt
        elif samples is not None and self.tokens_per_sample:
            tokens = samples * self.tokens_per_sample
        else:
            tokens = None
        max_steps = self.report.max_steps
        eta = (max_steps - self.report.step) * dt / steps if max_steps else None
        self._update(samples_per_second=samples, tokens_per_second=tokens,
                     eta_seconds=max(0.0, eta) if eta is not None else None)
        self._window = (now, self.report.step, tokens_seen)

    def _update(self, **changes: Any) -> None:
        self.report = replace(self.report, **changes)


class NullTracker:
    """The tracker outside the launcher: every event is a no-op (no `if enabled:` in the callbacks)."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class TrainProgressCallback(TrainerCallback):
    """Feeds a `ProgressTracker` from kubetrain's own Trainer, on each node's local main process."""

    def __init__(self, tracker: ProgressTracker | NullTracker | None = None) -> None:
        self.tracker = tracker if tracker is not None else ProgressTracker.from_env()

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_local_process_zero:
            self.tracker.train_begin(step=state.global_step, max_steps=state.max_steps, tokens_seen=_tokens(args, state),
                                     reports_end=True)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.is_local_process_zero:
            self.tracker.step_begin()

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        if state.is_local_process_zero:
            lr = (lambda: lr_scheduler.get_last_lr()[0]) if lr_scheduler is not None else None
            per_step = state.train_batch_size * args.gradient_accumulation_steps * state.world_size  # the global batch
            self.tracker.step_end(step=state.global_step, max_steps=state.max_steps, epoch=state.epoch,
                                  samples_per_step=per_step, tokens_seen=_tokens(args, state),
                                  learning_rate=lr)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_local_process_zero:
            self.tracker.logged(logs)

    def on_evaluate(self, args, state, control, **kwargs):
        if state.is_local_process_zero:
            self.tracker.event()

    def on_epoch_end(self, args, state, control, **kwargs):
        if state.is_local_process_zero:
            self.tracker.event()

    def on_save(self, args, state, control, checkpoint_dir=None, save_seconds=None, **kwargs):
        if state.is_local_process_zero:
            # With async_save the save is reported steps after it began: the folder names its step, and the
            # saver says how long it took from staging to commit (what an emergency checkpoint will need).
            step = parse_checkpoint_dirname(Path(checkpoint_dir).name) if checkpoint_dir else None
            self.tracker.saved(state.global_step if step is None else step, seconds=save_seconds)

    def on_train_end(self, args, state, control, preempted=False, **kwargs):
        if state.is_local_process_zero:
            self.tracker.train_end(preempted=bool(preempted))


def progress_callbacks(env: Mapping[str, str] | None = None) -> list[TrainerCallback]:
    """The progress reporter when the launcher asked for one (it sets KUBETRAIN_PROGRESS_FILE), else none."""
    tracker = ProgressTracker.from_env(env)
    return [TrainProgressCallback(tracker)] if isinstance(tracker, ProgressTracker) else []


def _tokens(args: Any, state: Any) -> int | None:
    """The tokens counted so far with `include_num_input_tokens_seen` (0 at a fresh start), else None (unknown)."""
    return state.num_input_tokens_seen if args.include_num_input_tokens_seen != "no" else None


def declare_tokens_per_sample(callbacks: list[TrainerCallback], tokens: int | None) -> None:
    """For a trainer that does not count tokens: a task with fixed-length samples says how many it has."""
    for cb in callbacks:
        if isinstance(cb, TrainProgressCallback) and isinstance(cb.tracker, ProgressTracker):
            cb.tracker.tokens_per_sample = tokens


def final_report(path: Path) -> WorkerProgress | None:
    """The workers' last report, read afresh once they exited (no cached copy); None when there is none."""
    try:
        return WorkerProgress.from_file(path.read_text())
    except (OSError, ValueError):
        return None


def finite_or_none(value: Any) -> Any:
    """JSON has no NaN or infinity: such a float is reported as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _safe(read: Callable[[], Any]) -> float | None:
    try:
        value = read()
    except Exception:  # noqa: BLE001 - a scheduler that cannot say its rate costs the gauge, not the run
        return None
    return float(value) if _is_number(value) else None
