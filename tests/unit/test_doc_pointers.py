"""Every file the docs and the tests' docstrings point a reader to exists.

A pointer is a path with a folder, written from the repository root
(`operator/kubetrain/plan.py`, `tests/unit/test_contract.py`, `scripts/test.sh`) or
from a package root (`kubetrain_trainer/failure.py`, `kubetrain/api.py`). Bare file
names (`sync.py`) are left alone: a reader finds them next to the pointer before.
Paths inside a container (`/etc/kubetrain/...`) are not pointers: a slash before
the first folder rules them out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"kubetrain": "operator", "kubetrain_trainer": "trainer_image", "kubetrain_testbed": "testbed"}
FOLDERS = ("operator", "trainer_image", "testbed", "tests", "docs", "scripts", "benchmarks", "charts",
           "examples", "images", ".ci")
POINTER = re.compile(r"(?<![\w/.-])((?:%s)/[\w./-]*\.(?:py|md|sh|ya?ml|toml|json))\b"
                     % "|".join(re.escape(f) for f in (*FOLDERS, *PACKAGES)))


def pointers(text: str) -> list[str]:
    return POINTER.findall(text)


def exists(pointer: str) -> bool:
    top = pointer.split("/", 1)[0]
    return (ROOT / pointer).exists() or (top in PACKAGES and (ROOT / PACKAGES[top] / pointer).exists())


def docstrings(path: Path) -> str:
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = (n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
    return "\n".join(d for n in nodes if (d := ast.get_docstring(n, clean=False)))


def documents() -> list[Path]:
    return sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("*/README.md")])


@pytest.mark.parametrize("text, found", [
    ("see `operator/kubetrain/plan.py` and tests/unit/test_contract.py.", ["operator/kubetrain/plan.py", "tests/unit/test_contract.py"]),
    ("(`kubetrain_trainer/failure.py` is the record)", ["kubetrain_trainer/failure.py"]),
    ("mounted at /etc/kubetrain/deepspeed/ds_config.json", []),
    ("`sync.py` and `python train.py`", []),
])
def test_what_counts_as_a_pointer(text, found):
    assert pointers(text) == found


def test_a_missing_file_is_caught():
    assert exists("kubetrain_trainer/failure.py") and exists("docs/contract.md")
    assert not exists("kubetrain_trainer/strategies/_testing.py")


def test_docs_point_at_files_that_exist():
    stale = [f"{p.relative_to(ROOT)}: {ptr}" for p in documents() for ptr in pointers(p.read_text()) if not exists(ptr)]
    assert not stale, "docs name files that do not exist:\n" + "\n".join(stale)


def test_test_docstrings_point_at_files_that_exist():
    stale = [f"{p.relative_to(ROOT)}: {ptr}" for p in sorted((ROOT / "tests").rglob("*.py"))
             for ptr in pointers(docstrings(p)) if not exists(ptr)]
    assert not stale, "test docstrings name files that do not exist:\n" + "\n".join(stale)
