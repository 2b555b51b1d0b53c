"""scripts/test.sh's arguments, run with stand-ins for the setup, the linter, the testbed and pytest: the README's
tier table runs `scripts/test.sh -- -m integration`, which once took `--` for a tier and ended in the usage line
after the setup and the linter had run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAST = "-m not integration and not slow and not e2e"


def _stand_in(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """scripts/test.sh ARGS in a copy of the layout it expects; returns the run and the stand-ins' calls."""
    calls = tmp_path / "calls"
    calls.touch()
    (tmp_path / "scripts").mkdir()
    shutil.copy2(ROOT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    log = f'echo "$(basename "$0") $*" >>{calls}'
    _stand_in(tmp_path / "scripts" / "setup.sh", log)
    _stand_in(tmp_path / "testbed" / "build.sh", log)
    _stand_in(tmp_path / "fakebin" / "ruff", log)
    _stand_in(tmp_path / "fakebin" / "python", log)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "activate").write_text(f'PATH="{tmp_path / "fakebin"}:$PATH"\n')
    (tmp_path / "cache").mkdir()  # testbed/build.sh makes it; the images' log goes there
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBETRAIN_CACHE": str(tmp_path / "cache")}
    run = subprocess.run(["bash", str(tmp_path / "scripts" / "test.sh"), *args], env=env, capture_output=True,
                         text=True, timeout=60)
    return run, calls.read_text().splitlines()


@pytest.mark.parametrize(("args", "pytest_args"), [
    ((), "-m pytest -q"),
    (("--", "-m", "integration"), "-m pytest -q -m integration"),
    (("all",), "-m pytest -q"),
    (("all", "--", "-k", "preemption"), "-m pytest -q -k preemption"),
    (("fast",), f"-m pytest -q {FAST}"),
    (("fast", "--", "-k", "preemption"), f"-m pytest -q {FAST} -k preemption"),
])
def test_the_tier_and_the_pytest_arguments(tmp_path: Path, args: tuple[str, ...], pytest_args: str) -> None:
    run, calls = _run(tmp_path, *args)
    assert run.returncode == 0, run.stderr
    assert calls[0] == "setup.sh " and calls[1].startswith("ruff check")
    assert calls[-1] == f"python {pytest_args}"
    built = [c for c in calls if c.startswith("build.sh")]
    assert bool(built) == (args[:1] != ("fast",)), calls
    if built:  # before pytest, whose timeout (600 s a test) would otherwise cover a cold compile
        assert "build.sh --crd-check" in built, calls


def test_an_unknown_tier_is_refused_before_the_setup_runs(tmp_path: Path) -> None:
    run, calls = _run(tmp_path, "quick")
    assert run.returncode == 2 and "usage: scripts/test.sh" in run.stderr
    assert calls == []
