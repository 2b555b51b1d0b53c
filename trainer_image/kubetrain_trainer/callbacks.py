"""Callbacks: the hooks users know from the HF Trainer, and the built-in ones.

The loop raises events; callbacks read `TrainerState` and flip
`TrainerControl` flags (log / evaluate / save / stop). Deciding *when* to log,
evaluate and save is itself a callback (`DefaultFlowCallback`), so the loop
never hard-codes a schedule. Callbacks with state worth resuming implement
`state()` / `load_state()`; their state travels in `trainer_state.json`
(`stateful_callbacks`, laid out as HF lays it out). HF callbacks run as they
are: a plain `transformers.TrainerCallback` has no state, and HF's stateful
ones (`ExportableState`: `state()` returns {"args": ..., "attributes": ...})
are rebuilt from it on resume, as HF's Trainer does.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from dataclasses import dataclass
from typing import Any

from .args import TrainingArguments
from .layout import metric_key
from .state import TrainerState

logger = logging.getLogger("kubetrain_trainer")


CONTROL = "TrainerControl"
"""`stateful_callbacks`' entry for the loop's control flags, as HF names it."""


@dataclass
class TrainerControl:
    """Flags callbacks set to steer the loop; the loop resets them after acting."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_step(self) -> None:
        self.should_save = self.should_evaluate = self.should_log = False


class TrainerCallback:
    """Base class: override the events you need. kwargs carry model, optimizer, lr_scheduler, metrics, logs..."""

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs): ...
    def on_train_begin(self, args, state, control, **kwargs): ...
    def on_train_end(self, args, state, control, **kwargs): ...
    def on_epoch_begin(self, args, state, control, **kwargs): ...
    def on_epoch_end(self, args, state, control, **kwargs): ...
    def on_step_begin(self, args, state, control, **kwargs): ...
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """After the gradients are clipped, before the optimizer step (HF's)."""
    def on_optimizer_step(self, args, state, control, **kwargs):
        """After the optimizer step, before the gradients are zeroed (HF's; after ZeRO-3's engine zeroed them)."""
    def on_substep_end(self, args, state, control, **kwargs): ...
    def on_step_end(self, args, state, control, **kwargs): ...
    def on_evaluate(self, args, state, control, **kwargs): ...
    def on_predict(self, args, state, control, **kwargs): ...
    def on_save(self, args, state, control, **kwargs):
        """After a checkpoint is committed: `state.last_checkpoint_dir` (and kwarg `checkpoint_dir`) is its folder."""
    def on_log(self, args, state, control, **kwargs): ...
    def on_prediction_step(self, args, state, control, **kwargs):
        """After each batch of `evaluate` and `predict` (HF's)."""

    # Resumable callbacks return a JSON-able dict here and accept it back.
    def state(self) -> dict[str, Any] | None:
        return None

    def load_state(self, state: dict[str, Any]) -> None: ...


_EVENTS = [name for name in vars(TrainerCallback) if name.startswith("on_")]


def _empty_handlers(event: str) -> tuple:
    """The do-nothing `event` methods of the callback base classes: kubetrain's, and HF's once it is imported."""
    empty = [vars(TrainerCallback)[event]]
    hf = sys.modules.get("transformers.trainer_callback")
    if hf is not None and event in vars(hf.TrainerCallback):
        empty.append(vars(hf.TrainerCallback)[event])
    return tuple(empty)


class CallbackHandler:
    """Dispatches each event to every callback in order; the control object is shared."""

    def __init__(self, callbacks: list[TrainerCallback], **objects: Any):
        self.callbacks: list[TrainerCallback] = []
        self._dispatch: dict[str, tuple[list, list]] = {}
        for cb in callbacks:
            self.add_callback(cb)
        self.objects = objects  # model, optimizer, ... handed to callbacks as kwargs

    def add_callback(self, callback: TrainerCallback | type) -> None:
        cb = callback() if isinstance(callback, type) else callback
        if any(type(existing) is type(cb) for existing in self.callbacks):
            logger.warning("callback %s added twice", type(cb).__name__)
        self.callbacks.append(cb)

    def pop_callback(self, callback: TrainerCallback | type) -> TrainerCallback | None:
        for cb in self.callbacks:
            if cb is callback or (isinstance(callback, type) and type(cb) is callback):
                self.callbacks.remove(cb)
                return cb
        return None

    def remove_callback(self, callback: TrainerCallback | type) -> None:
        self.pop_callback(callback)

    def call(self, event: str, args: TrainingArguments, state: TrainerState, control: TrainerControl,
             **kwargs: Any) -> TrainerControl:
        return getattr(self, event)(args, state, control, **kwargs)

    def _rebuild_handlers(self, event: str) -> list:
        """The callbacks' methods for `event`, leaving out the base classes' empty ones (they return None).

        Kept per event with a copy of the callback list; each event's dispatch rebuilds them when the list
        changes (compared item by item: it may be edited in place), so a step pays for the callbacks that
        handle its events, not for every callback times every event.
        """
        callbacks = list(self.callbacks)
        handlers = [method for cb in callbacks
                    if getattr(method := getattr(cb, event), "__func__", None) not in _empty_handlers(event)]
        self._dispatch[event] = (callbacks, handlers)
        return handlers

    def save_states(self, state: TrainerState, control: TrainerControl | None = None) -> None:
        """Each callback's `state()` under its class name (a list where several share a class), as in HF, and the
        loop's `control` under "TrainerControl" in HF's layout (the HF Trainer resuming the checkpoint reads it:
        without it, its first save raised KeyError). A resume here keeps its own control.

        Callbacks without a `state` method (HF's plain `TrainerCallback`s) or whose `state()` is None have none.
        """
        groups: dict[str, list] = {}
        for cb in self.callbacks:
            export = getattr(cb, "state", None)
            if callable(export) and (saved := export()) is not None:
                groups.setdefault(type(cb).__name__, []).append(saved)
        state.stateful_callbacks = {name: saved[0] if len(saved) == 1 else saved for name, saved in groups.items()}
        if control is not None:
            state.stateful_callbacks[CONTROL] = {"args": dataclasses.asdict(control), "attributes": {}}

    def load_states(self, state: TrainerState) -> None:
        """Give the callbacks their saved states back, matched by class name and then by order (as HF does)."""
        missing = []
        for name, saved in state.stateful_callbacks.items():
            if name == CONTROL:
                continue
            same = [i for i, cb in enumerate(self.callbacks) if type(cb).__name__ == name]
            if not same:
                missing.append(name)
            for index, data in zip(same, saved if isinstance(saved, list) else [saved]):
                self._restore(index, data)
        if missing:
            logger.warning("the checkpoint has the state of callbacks this run does not have: %s; ignored",
                           ", ".join(missing))

    def _restore(self, index: int, data: Any) -> None:
        """A kubetrain callback takes `data` through `load_state`. Any other (HF's `ExportableState` ones) is
        replaced, as HF's Trainer restores it, by one built from the saved "args" and given the saved
        "attributes"; state in another layout (kubetrain's EarlyStoppingCallback before it used HF's, under
        HF's class name) is left out with a warning: the callback starts afresh, the resume goes on."""
        cb = self.callbacks[index]
        load = getattr(cb, "load_state", None)
        if callable(load):
            load(data)
            return
        name = type(cb).__name__
        if not isinstance(data, dict) or not ({"args", "attributes"} & data.keys()):
            logger.warning("callback %s: its saved state is not in HF's {args, attributes} layout; it starts afresh",
                           name)
            return
        try:
            restored = type(cb)(**(data.get("args") or {}))
            for attribute, value in (data.get("attributes") or {}).items():
                setattr(restored, attribute, value)
        except Exception as exc:  # noqa: BLE001 - a callback that cannot be rebuilt must not stop the resume
            logger.warning("callback %s: its saved state could not be restored (%s); it starts afresh", name, exc)
            return
        self.callbacks[index] = restored  # the handlers cached per event see the new list item


def _dispatcher(event: str):
    """`CallbackHandler.<event>`: calls each callback's handler for `event` in order (they run every step)."""
    def dispatch(self: CallbackHandler, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                 **kwargs: Any) -> TrainerControl:
        cached = self._dispatch.get(event)  # runs several times every step
        handlers = cached[1] if cached is not None and cached[0] == self.callbacks else self._rebuild_handlers(event)
        if handlers:
            objects = {**self.objects, **kwargs} if kwargs else self.objects
            for handler in handlers:
                result = handler(args, state, control, **objects)
                if result is not None:  # HF callbacks may return a control object
                    control = result
        return control

    dispatch.__name__ = dispatch.__qualname__ = event
    return dispatch


for _event in _EVENTS:  # handler.on_log(args, state, control, logs=...) etc.
    setattr(CallbackHandler, _event, _dispatcher(_event))


class DefaultFlowCallback(TrainerCallback):
    """Decides when to log, evaluate, save and stop from the `*_strategy` / `*_steps` arguments."""

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step == 1 and args.logging_first_step:
            control.should_log = True
        if args.logging_strategy == "steps" and state.logging_steps and step % state.logging_steps == 0:
            control.should_log = True
        if args.eval_strategy == "steps" and state.eval_steps and step % state.eval_steps == 0:
            control.should_evaluate = True
        if args.save_strategy == "steps" and state.save_steps and step % state.save_steps == 0:
            control.should_save = True
        if step >= state.max_steps:  # as in HF 5.x: the last step is evaluated, and saved with "steps" only
            control.should_training_stop = True
            if args.eval_strategy == "steps":
                control.should_evaluate = True
            if args.save_strategy == "steps":
                control.should_save = True
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch":
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control


def _printable(logs: dict[str, Any], max_str_len: int | None = None) -> dict[str, Any]:
    """A log dict as HF's ProgressCallback / PrinterCallback print it: floats to 4 significant digits, no
    total_flos, strings over `max_str_len` replaced by a note. The logged dict itself is left as it is."""
    shown = {}
    for key, value in logs.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif max_str_len is not None and isinstance(value, str) and len(value) > max_str_len:
            value = (f"[String too long to display, length: {len(value)} > {max_str_len}. "
                     "Consider increasing `max_str_len` if needed.]")
        shown[key] = value
    shown.pop("total_flos", None)
    return shown


class ProgressCallback(TrainerCallback):
    """A tqdm bar of optimizer steps with each log dict printed above it (as HF), on the main process only."""

    def __init__(self, max_str_len: int = 100):
        self.bar = None
        self._last = 0
        self.max_str_len = max_str_len

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(total=state.max_steps, initial=state.global_step, dynamic_ncols=True)
        self._last = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self._last)
            self._last = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs:  # while training, as HF's (a later evaluate() prints nothing)
            self.bar.write(str(_printable(logs, self.max_str_len)))

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class PrinterCallback(TrainerCallback):
    """Prints each log dict on the main process: HF's output with `disable_tqdm` (reporting.py adds it then)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            print(_printable(logs), flush=True)


class LoggingCallback(TrainerCallback):
    """Writes every log record to the `kubetrain_trainer` logger (main process only)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            logger.info("step %d: %s", state.global_step, logs)


class EarlyStoppingCallback(TrainerCallback):
    """Stops training when `metric_for_best_model` has not improved for `early_stopping_patience` evaluations."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0):
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold
        self.early_stopping_patience_counter = 0  # evaluations in a row without improvement (HF's name)
        self.best: float | None = None

    @property
    def patience_counter(self) -> int:
        """`early_stopping_patience_counter` under its earlier kubetrain name."""
        return self.early_stopping_patience_counter

    @patience_counter.setter
    def patience_counter(self, value: int) -> None:
        self.early_stopping_patience_counter = value

    def on_train_begin(self, args, state, control, **kwargs):
        if not args.metric_for_best_model or args.eval_strategy == "no":
            from .args import ConfigError

            raise ConfigError("EarlyStoppingCallback needs metric_for_best_model and an eval_strategy")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        name = args.metric_for_best_model
        key = metric_key(name)
        value = (metrics or {}).get(key)
        if value is None or not math.isfinite(value):
            logger.warning("early stopping: metric %s missing or not finite; not counted", key)
            return
        best = self.best if self.best is not None else state.best_metric  # resumed from HF's callback: its best
        better = (value > best + self.early_stopping_threshold if args.greater_is_better
                  else value < best - self.early_stopping_threshold) if best is not None else True
        if better:
            self.best, self.early_stopping_patience_counter = value, 0
        else:
            self.early_stopping_patience_counter += 1
            if self.early_stopping_patience_counter >= self.early_stopping_patience:
                logger.info("early stopping at step %d: %s did not improve for %d evaluations",
                            state.global_step, key, self.early_stopping_patience_counter)
                control.should_training_stop = True

    def state(self):
        """HF's layout, under HF's class name: HF's EarlyStoppingCallback resumes from it, and this one from HF's;
        plus the earlier kubetrain keys (`patience_counter`, `best`), so that an older image still resumes."""
        return {"args": {"early_stopping_patience": self.early_stopping_patience,
                         "early_stopping_threshold": self.early_stopping_threshold},
                "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter,
                               "best": self.best},
                "patience_counter": self.early_stopping_patience_counter, "best": self.best}

    def load_state(self, state):
        """The counter (and best value) from HF's layout or from kubetrain's older {patience_counter, best};
        the patience and threshold stay this run's. HF's own callback saves no best value: it compares with
        `state.best_metric`, and so does this one until it has one of its own."""
        saved = (state.get("attributes") or {}) if "args" in state or "attributes" in state else state
        self.early_stopping_patience_counter = saved.get("early_stopping_patience_counter",
                                                         saved.get("patience_counter", 0))
        self.best = saved.get("best")
