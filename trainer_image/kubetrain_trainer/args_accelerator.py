"""`accelerator_config`: HF's `AcceleratorConfig`, the Trainer's settings for accelerate, read by kubetrain itself.

HF's `TrainingArguments(accelerator_config=...)` takes a dict, a JSON string, a path to a JSON file or an
`AcceleratorConfig`; its Trainer hands the settings to accelerate's `Accelerator`. kubetrain has no accelerate:
it does what each setting asks itself where it can, and refuses by name (a `ConfigError`) every value it does
not implement, never ignoring it:

- `dispatch_batches`: null (HF's default) or true: an `IterableDataset` on several ranks is read by rank 0,
  which sends each rank its batch (`data.DispatchedLoader`); false: every rank reads the stream itself and keeps
  its own batches (`data.IterableShard`, accelerate's `IterableDatasetShard`). True for a map-style training set
  on several ranks is refused when the loader is made (kubetrain's sampler shards it by index).
- `gradient_accumulation_kwargs`: `num_steps` (taken as `gradient_accumulation_steps` when that is 1, as in HF)
  and `sync_each_batch` (gradients synchronised on every micro-batch).
- `non_blocking`: either value: batches are always copied to the GPU with `non_blocking` (true's behaviour).
- `split_batches`, `even_batches`, `use_seedable_sampler`, `use_configured_state`: HF's defaults only.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .args_values import ConfigError, _coerce, did_you_mean

NAME = "accelerator_config"
GRADIENT_ACCUMULATION_KEYS = {"num_steps": int, "sync_each_batch": bool}


@dataclass(frozen=True)
class AcceleratorConfig:
    """HF's `AcceleratorConfig` (transformers.trainer_pt_utils), with HF's defaults; see the module's docstring."""

    split_batches: bool = False
    """Only false: each rank's batch is `per_device_train_batch_size` rows."""
    dispatch_batches: bool | None = None
    """An iterable training set on several ranks: read by rank 0, which deals the batches (null, true), or by
    every rank, each keeping its own batches (false)."""
    even_batches: bool = True
    """Only true: the last round of batches is completed from the first rows, so every rank has as many."""
    use_seedable_sampler: bool = True
    """Only true: the training order is a function of `data_seed` and the epoch (an exact resume needs it)."""
    non_blocking: bool = False
    """Either: batches are copied to the GPU with `non_blocking` whatever it is (true's behaviour)."""
    gradient_accumulation_kwargs: dict | None = None
    """`num_steps` (the accumulation steps, when `gradient_accumulation_steps` is 1) and `sync_each_batch`."""
    use_configured_state: bool = False
    """Only false: the process group comes from the pod's environment; there is no accelerate state to reuse."""

    @property
    def num_steps(self) -> int | None:
        return (self.gradient_accumulation_kwargs or {}).get("num_steps")

    @property
    def sync_each_batch(self) -> bool:
        return bool((self.gradient_accumulation_kwargs or {}).get("sync_each_batch"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls, value: Any) -> "AcceleratorConfig":
        """From what HF's `accelerator_config` takes; every problem is a ConfigError naming the key."""
        config, errors = cls._parse(value)
        if errors:
            raise ConfigError("; ".join(errors))
        return config

    @classmethod
    def _parse(cls, value: Any) -> tuple["AcceleratorConfig", list[str]]:
        if value is None or isinstance(value, cls):
            return value or cls(), []
        try:
            mapping = _mapping(value)
        except ConfigError as exc:
            return cls(), [str(exc)]
        known = [f.name for f in dataclasses.fields(cls)]
        errors = [_unknown(k, known) for k in mapping if k not in known]
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for key in [k for k in known if k in mapping]:
            try:
                values[key] = _coerce(mapping[key], hints[key], f"{NAME}.{key}")
            except ConfigError as exc:
                errors.append(str(exc))
        if values.get("gradient_accumulation_kwargs"):
            values["gradient_accumulation_kwargs"] = _gradient_kwargs(values["gradient_accumulation_kwargs"], errors)
        if errors:
            return cls(), errors
        config = cls(**values)
        return config, config._unsupported()

    def _unsupported(self) -> list[str]:
        """A message for each value kubetrain does not implement, saying what it does instead."""
        e = []
        if self.split_batches:
            e.append(f"{NAME}.split_batches: only false: each rank's batch is per_device_train_batch_size rows "
                     f"(set per_device_train_batch_size to your batch size divided by the number of processes)")
        if not self.even_batches:
            e.append(f"{NAME}.even_batches: only true: kubetrain pads the training data with its first rows so that "
                     f"every rank has as many batches (for a map-style set dataloader_drop_last drops the rest "
                     f"instead)")
        if not self.use_seedable_sampler:
            e.append(f"{NAME}.use_seedable_sampler: only true: the training order is always a function of "
                     f"data_seed and the epoch (an exact resume depends on it)")
        if self.use_configured_state:
            e.append(f"{NAME}.use_configured_state: only false: kubetrain sets up the process group from the "
                     f"pod's environment; there is no accelerate state to reuse")
        return e


def apply(args: Any) -> list[str]:
    """`args.accelerator_config` as an `AcceleratorConfig`, and its `num_steps` as `gradient_accumulation_steps`
    (HF: taken when that is 1, refused when it is another number); the problems, each a message."""
    config, errors = AcceleratorConfig._parse(args.accelerator_config)
    if errors:
        return errors
    args.accelerator_config = config
    steps = config.num_steps
    if steps is not None and args.gradient_accumulation_steps in (1, steps):
        args.gradient_accumulation_steps = steps
    elif steps is not None:
        return [f"{NAME}.gradient_accumulation_kwargs.num_steps ({steps}) and gradient_accumulation_steps "
                f"({args.gradient_accumulation_steps}) are both set: set one of them"]
    return []


def _gradient_kwargs(given: dict, errors: list[str]) -> dict:
    """A copy of `gradient_accumulation_kwargs` with its values coerced; its problems appended to `errors`."""
    where, out = f"{NAME}.gradient_accumulation_kwargs", {}
    for key, value in given.items():
        if key == "adjust_scheduler":  # accelerate's plugin: true (its default) is what the Trainer does anyway
            try:
                if not _coerce(value, bool, f"{where}.adjust_scheduler"):
                    errors.append(f"{where}.adjust_scheduler: only true: the Trainer steps the learning-rate "
                                  "schedule once per optimizer step")
            except ConfigError as exc:
                errors.append(str(exc))
            continue
        if key not in GRADIENT_ACCUMULATION_KEYS:
            errors.append(_unknown(key, list(GRADIENT_ACCUMULATION_KEYS), where))
            continue
        try:
            out[key] = _coerce(value, GRADIENT_ACCUMULATION_KEYS[key], f"{where}.{key}")
        except ConfigError as exc:
            errors.append(str(exc))
    if out.get("num_steps", 1) < 1:
        errors.append(f"{where}.num_steps must be >= 1, got {out['num_steps']}")
    return out


def _unknown(key: Any, known: list[str], where: str = NAME) -> str:
    return f"{where}: unknown key {key!r}{did_you_mean(str(key), known)} (the keys are {', '.join(known)})"


def _mapping(value: Any) -> Mapping[str, Any]:
    """The settings as a mapping: a mapping, an `AcceleratorConfig`-like dataclass (HF's), or a string holding a
    JSON object or the path of a JSON (or YAML) file holding one."""
    if isinstance(value, type):
        raise ConfigError(f"{NAME}: got the class {value.__name__}; pass an instance of it (or a dict)")
    if dataclasses.is_dataclass(value):
        return value.to_dict() if callable(getattr(value, "to_dict", None)) else dataclasses.asdict(value)
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{NAME}: not valid JSON: {exc}") from exc
    elif isinstance(value, str):
        value = _file(value)
    if not isinstance(value, Mapping):
        raise ConfigError(f"{NAME}: expected a mapping, a JSON object, the path of a JSON file holding one or an "
                          f"AcceleratorConfig, got {value!r}")
    return dict(value)


def _file(path: str) -> Any:
    import yaml  # JSON is a subset of YAML, so one parser serves both

    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{NAME}: cannot read the file {path!r}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{NAME}: the file {path!r} is not valid JSON: {exc}") from exc
