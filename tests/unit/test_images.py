"""Each image installs only its own package: the operator image has no trainer or testbed, the
trainer image no operator or testbed (design brief: two deployables, one contract, no shared imports).

Checked offline from the Dockerfiles themselves: the final stage's source COPYs and `mkdir -p`
are replayed into a temporary build context, and setuptools' own package discovery runs there
with pyproject.toml's settings, which is what `pip install --no-deps .` installs. The images
themselves are built by `python -m kubetrain_testbed images --build-only` (the realnode e2e tier).
"""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _final_stage(dockerfile: Path) -> str:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return text[text.rindex("\nFROM "):]


def _installed_packages(dockerfile: Path, context: Path) -> set[str]:
    """Top-level import packages `pip install .` puts into the image built from `dockerfile`."""
    stage = _final_stage(dockerfile)
    for src, dst in re.findall(r"^COPY (?!--)(\S+(?: \S+)*) (\S+)$", stage, re.M):
        for name in src.split():
            target = context / (dst if dst not in ("./", ".") else name)
            if (ROOT / name).is_dir():
                shutil.copytree(ROOT / name, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(ROOT / name, context / name)
    for dirs in re.findall(r"mkdir -p ((?:[\w.-]+ ?)+)", stage):
        for d in dirs.split():
            (context / d).mkdir(parents=True, exist_ok=True)
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    found: set[str] = set()
    for where in find["where"]:
        assert (context / where).is_dir(), f"{dockerfile.name}: pip install . needs {where}/ (mkdir -p it)"
        found |= {p.split(".")[0] for p in find_packages(str(context / where), include=find["include"])}
    return found


@pytest.mark.parametrize("dockerfile, package, extra", [
    ("operator/Dockerfile", "kubetrain", "operator"),
    ("trainer_image/Dockerfile", "kubetrain_trainer", "trainer"),
])
def test_each_image_installs_only_its_own_package_and_dependencies(dockerfile: str, package: str, extra: str,
                                                                   tmp_path: Path) -> None:
    path = ROOT / dockerfile
    assert _installed_packages(path, tmp_path) == {package}
    requirements = re.search(r"\['optional-dependencies'\]\['(\w+)'\]", path.read_text())
    assert requirements is not None and requirements.group(1) == extra
    deps = PYPROJECT["project"]["optional-dependencies"]
    other = {"operator": "trainer", "trainer": "operator"}[extra]
    names = {re.split(r"[=<>\[]", d)[0] for d in deps[extra]}
    assert not names & {re.split(r"[=<>\[]", d)[0] for d in deps[other]} - {"prometheus-client"}


def test_the_check_sees_a_package_copied_into_the_wrong_image(tmp_path: Path) -> None:
    wrong = tmp_path / "Dockerfile"
    wrong.write_text((ROOT / "trainer_image/Dockerfile").read_text()
                     .replace("COPY trainer_image ./trainer_image", "COPY trainer_image ./trainer_image\nCOPY operator ./operator")
                     .replace("mkdir -p operator testbed", "mkdir -p testbed"))
    context = tmp_path / "context"
    context.mkdir()
    assert _installed_packages(wrong, context) == {"kubetrain", "kubetrain_trainer"}
