"""Reading argument values: command-line flags, YAML/JSON files, and each value coerced to its field's type.

Every problem is a `ConfigError` naming the argument and what is allowed (re-exported by `args`, where the
arguments themselves are).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Sequence, Union


class ConfigError(ValueError):
    """A setting that can never work. Raised before training; the message says what to change."""


class MetricNotFound(ConfigError, KeyError):
    """`metric_for_best_model` names no metric the evaluation returns: a KeyError as in HF, and a ConfigError
    (exit 82 in a pod: every retry would evaluate the same metrics)."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0]) if self.args else ""


def did_you_mean(name: str, valid: Sequence[str]) -> str:
    """"; did you mean 'x'?" for the valid name nearest `name`, or "" when none is near."""
    near = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f"; did you mean {near[0]!r}?" if near else ""


def unknown_name_message(name: str, valid: Sequence[str]) -> str:
    return f"unknown argument {name!r}{did_you_mean(name, valid)}"


def unknown_choices(name: str, values: Sequence[str], known: Sequence[str]) -> list[str]:
    """A message for each of an argument's list `values` that is not one of `known`."""
    return [f"{name}: {v!r} is not one of {', '.join(known)}" for v in values if v not in known]


def _refusing_unknown_names(init: Any) -> Any:
    """The dataclass's __init__, refusing an argument it has not with the nearest valid name (a ConfigError, exit 82
    in a pod), as `from_dict` does: HF's `TrainingArguments(do_sample=...)` or an HF argument kubetrain lacks gave a
    bare TypeError (exit 1, retried until backoffLimit)."""
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        names = [f.name for f in dataclasses.fields(type(self))]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise ConfigError("; ".join(unknown_name_message(k, names) for k in unknown)
                              + " (docs/trainer.md lists the HF arguments kubetrain has not)")
        init(self, *args, **kwargs)
    return __init__


def load_mapping_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML or JSON file that holds one mapping."""
    import yaml  # JSON is a subset of YAML, so one parser serves both

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read arguments file {str(path)!r}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"arguments file {str(path)!r} is not valid YAML/JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"arguments file {str(path)!r} must hold a mapping of argument names to values")
    return data


def parse_cli(argv: Sequence[str]) -> dict[str, Any]:
    """`--name value`, `--name=value` and bare boolean `--name`; values stay strings for `_coerce`."""
    out: dict[str, Any] = {}
    items = list(argv)
    i = 0
    while i < len(items):
        token = items[i]
        if not token.startswith("--"):
            raise ConfigError(f"unexpected command-line token {token!r}: arguments look like --name value")
        name, eq, value = token[2:].partition("=")
        name = name.replace("-", "_")
        if not eq:
            if i + 1 < len(items) and not items[i + 1].startswith("--"):
                value, i = items[i + 1], i + 1
            else:
                value = "true"
        out[name] = value
        i += 1
    if "config" in out:
        base = load_mapping_file(out.pop("config"))
        out = {**base, **out}
    return out


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Convert `value` (possibly a command-line string) to the annotated type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and type(None) in options):
            if type(None) in options:
                return None
        errors = []
        # Try the most specific choices first so that "5" stays an int for `float | None`.
        for option in sorted((o for o in options if o is not type(None)), key=_specificity):
            try:
                return _coerce(value, option, name)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{name}: invalid value {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        near = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(map(repr, choices))}{hint}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()] if not value.startswith("[") else _json(value, name)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return [_coerce(v, item, name) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        number = value if isinstance(value, (int, float)) else None
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        try:
            finite = math.isfinite(number)  # "nan", "inf", or JSON's NaN / Infinity
        except OverflowError:  # an integer past any float (10**400)
            finite = False
        if not finite:
            raise ConfigError(f"{name}: expected a finite number, got {str(value)[:40]!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    if tp is dict:
        if isinstance(value, str):
            value = _json(value, name)
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {value!r}")
        return value
    return value


def _specificity(tp: Any) -> int:
    order = {bool: 0, int: 1, float: 2, dict: 3, str: 4}
    return order.get(tp, 5)


def _json(text: str, name: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name}: not valid JSON: {exc}") from exc
