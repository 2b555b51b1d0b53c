"""Issue 13's house rule: one job per module, and no module over 450 lines in operator/, trainer_image/
and testbed/. A module that outgrows it is split by job (as plan.py, api.py, launch.py, sync.py,
storage.py, kueue.py and the testbed's cluster.py were), not trimmed of its docstrings."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 450
MODULES = sorted(p for top in ("operator", "trainer_image", "testbed") for p in (ROOT / top).rglob("*.py"))


def test_there_are_modules_to_check() -> None:
    assert len(MODULES) > 40


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_fits_the_limit(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= LIMIT, f"{path.relative_to(ROOT)} has {lines} lines (limit {LIMIT}): split it by job"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_says_its_job_first(path: Path) -> None:
    text = path.read_text()
    if not text.strip():
        return
    assert text.lstrip().startswith(('"""', "'''")), f"{path.relative_to(ROOT)}: no module docstring"
