"""`--help` of the training arguments lists them all, with their docstrings (args_help.py).

A user's script reading its flags with `TrainingArguments.from_cli` (examples/train_custom.py) and the built-in
entrypoint refused `--help` as "unknown argument 'help'" (a ConfigError traceback; exit 82 for the built-in), where
HF's `HfArgumentParser` prints the arguments; and the built-in tasks' own keys were written down nowhere.
"""

from __future__ import annotations

import dataclasses

import pytest

from kubetrain_trainer import TrainingArguments, builtin
from kubetrain_trainer.args_help import field_docs


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--max_steps", "5", "--help"]])
def test_from_cli_prints_every_argument_with_its_docstring_and_exits_0(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        TrainingArguments.from_cli(argv)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(TrainingArguments):
        assert f"  --{f.name} " in out
    assert "--save_total_limit int | None (default: None)" in out
    assert "Keep at most this many checkpoints; the best and the newest are never deleted." in out
    assert "--save_strategy {no,steps,epoch,best} (default: 'steps')" in out
    assert "--report_to str | list[str] (default: ['jsonl'])" in out


def test_every_training_argument_has_a_docstring():
    missing = [f.name for f in dataclasses.fields(TrainingArguments) if not field_docs(TrainingArguments).get(f.name)]
    assert missing == []


@dataclasses.dataclass
class MyArguments(TrainingArguments):
    lora_rank: int = 8
    """Rank of the adapters."""


def test_a_subclass_lists_its_own_arguments_too(capsys):
    with pytest.raises(SystemExit):
        MyArguments.from_cli(["--help"])
    out = capsys.readouterr().out
    assert "--lora_rank int (default: 8)\n      Rank of the adapters." in out and "--max_steps int" in out


def test_the_builtin_entrypoint_prints_the_arguments_and_every_tasks_keys(capsys):
    with pytest.raises(SystemExit) as exit_:
        builtin.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--learning_rate float (default: 5e-05)" in out
    for name, task in builtin.TASKS.items():
        assert f"  {name}: {task.__doc__}" in out
        for f in dataclasses.fields(task):
            assert f"    --{f.name} (default: {f.default!r}) {field_docs(task)[f.name]}" in out
