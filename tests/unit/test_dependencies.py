"""Every runtime dependency pyproject.toml declares is used by the package whose image installs it.

A pinned dependency that nothing imports is a defect (issue 13, item 10): it costs image size, install
time and a cold cache on every bump, and it suggests an engine the code does not have. The check reads
the imports of operator/ and trainer_image/ (every `import`, lazy ones inside functions too) with `ast`:

- `[project] dependencies` must be imported by either package;
- the `operator` extra by operator/ (the operator image installs only it), the `trainer` extra by
  trainer_image/ (likewise).

Two trainer dependencies are used without a direct import, each for a reason this test keeps true:
tensorboard through `torch.utils.tensorboard`, and accelerate through the transformers `Trainer` that
"bring your HF script" jobs run in the trainer image (examples/hf_trainer_script.py): transformers
refuses to build its `TrainingArguments` without accelerate. kubetrain's own strategies do not use
accelerate; benchmarks/accelerate_overhead.py measured why (docs/trainer.md, "Why accelerate is not
the engine").
"""

from __future__ import annotations

import ast
import re
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

IMPORT_NAME = {"pyyaml": "yaml", "prometheus-client": "prometheus_client"}
"""Distribution name -> import name, where they differ beyond '-' -> '_'."""

USED_THROUGH_MODULE = {"tensorboard": "torch.utils.tensorboard"}
"""Used by importing another package's module that needs it: the product must import that module."""

REQUIRED_BY_USER_SCRIPTS = {"accelerate": ("transformers", "examples/hf_trainer_script.py")}
"""Installed for user scripts: (the declared package that requires it, the example script that shows the use)."""


def _name(requirement: str) -> str:
    return re.split(r"[=<>!~\[; ]", requirement, maxsplit=1)[0].lower()


def imported_modules(*roots: Path) -> set[str]:
    """Every module the .py files at or under `roots` import (dotted names, and each of their parents)."""
    found: set[str] = set()
    for root in roots:
        for path in [root] if root.is_file() else root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                else:
                    continue
                for name in names:
                    parts = name.split(".")
                    found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return found


def unused(requirements: list[str], imports: set[str]) -> list[str]:
    """The requirements in `requirements` that nothing in `imports` uses, and that no recorded reason covers."""
    out = []
    for requirement in requirements:
        name = _name(requirement)
        module = IMPORT_NAME.get(name, name.replace("-", "_"))
        if module in imports or USED_THROUGH_MODULE.get(name) in imports:
            continue
        if name in REQUIRED_BY_USER_SCRIPTS:
            continue  # checked by test_accelerate_is_installed_for_hf_trainer_scripts_only
        out.append(requirement)
    return out


OPERATOR = imported_modules(ROOT / "operator")
TRAINER = imported_modules(ROOT / "trainer_image")


def test_every_declared_runtime_dependency_is_used_by_the_image_that_installs_it() -> None:
    extras = PROJECT["optional-dependencies"]
    assert unused(PROJECT["dependencies"], OPERATOR | TRAINER) == []
    assert unused(extras["operator"], OPERATOR) == [], "declared in the operator extra, imported by no operator module"
    assert unused(extras["trainer"], TRAINER) == [], "declared in the trainer extra, imported by no trainer module"


def test_accelerate_is_installed_for_hf_trainer_scripts_only() -> None:
    trainer_extra = {_name(r) for r in PROJECT["optional-dependencies"]["trainer"]}
    for name, (requirer, script) in REQUIRED_BY_USER_SCRIPTS.items():
        assert name in trainer_extra, f"{name}: no longer declared; drop it from REQUIRED_BY_USER_SCRIPTS"
        # The reason holds: the example script runs the transformers Trainer ...
        assert {"transformers.Trainer", "transformers.TrainingArguments"} <= imported_modules(ROOT / script)
        # ... whose torch extra (what `pip install transformers[torch]` adds for the Trainer) requires it.
        torch_extra = [r for r in metadata.requires(requirer) or [] if 'extra == "torch"' in r]
        assert name in {_name(r) for r in torch_extra}, f"{requirer} no longer needs {name}: remove the pin"
        # ... and kubetrain's own code never imports it: the strategies are written on torch and DeepSpeed.
        assert name not in OPERATOR | TRAINER, f"{name} is imported now: move it out of REQUIRED_BY_USER_SCRIPTS"


def test_the_check_flags_a_dependency_that_nothing_imports() -> None:
    trainer = PROJECT["optional-dependencies"]["trainer"]
    assert unused([*trainer, "left-pad==1.0"], TRAINER) == ["left-pad==1.0"]
    assert unused(["kopf==1.45.2"], TRAINER) == ["kopf==1.45.2"]  # the operator's, not the trainer's
