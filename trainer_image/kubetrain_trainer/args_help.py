"""`--help` of the training arguments: every argument's flag, type, default and docstring.

`TrainingArguments.from_cli` (a user's script, `python train.py --help`) and the built-in entrypoint
print it, as HF's `HfArgumentParser` does, instead of refusing `help` as an unknown argument. The
text comes from the dataclass itself: each field's docstring (the string literal below it in the
class's source, for `TrainingArguments` and a user's dataclass subclass alike), so the help never
drifts from the arguments.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
import typing
from typing import Any, Literal, Sequence

HELP_FLAGS = frozenset({"-h", "--help"})


def wants_help(argv: Sequence[str]) -> bool:
    return any(a in HELP_FLAGS for a in argv)


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring, from the source of `cls` and its bases (a subclass's own wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):  # defined where no source is kept (an interactive session)
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                    and isinstance(after.value.value, str):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _type_name(hint: Any, written: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "{" + ",".join(str(v) for v in typing.get_args(hint)) + "}"
    return str(written) if isinstance(written, str) else getattr(hint, "__name__", str(hint))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "required"


def usage(cls: type, *, prog: str, extra: str = "") -> str:
    """The help text of `cls`'s arguments (`extra`: more text after them, e.g. a built-in task's keys)."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):
        hints = {}
    docs = field_docs(cls)
    lines = [f"usage: {prog} [--name value | --name=value | --flag ...] [--config args.yaml]", "",
             "Training arguments (Hugging Face TrainingArguments names; docs/trainer.md). A bare --flag sets a",
             "boolean true; --config reads a YAML/JSON mapping of them, flags win. An unknown name is refused.", ""]
    for f in dataclasses.fields(cls):
        lines.append(f"  --{f.name} {_type_name(hints.get(f.name, f.type), f.type)} (default: {_default(f)})")
        if docs.get(f.name):
            lines += textwrap.wrap(docs[f.name], width=100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines + ([extra] if extra else [])) + "\n"


def print_help_and_exit(cls: type, *, prog: str | None = None, extra: str = "") -> typing.NoReturn:
    sys.stdout.write(usage(cls, prog=prog or sys.argv[0] or "train.py", extra=extra))
    sys.stdout.flush()
    raise SystemExit(0)
