"""scripts/setup.sh with a stand-in interpreter whose venv's pip only logs its calls, in a scratch cache: two cold
runs at once (demo.sh in one shell, test.sh in another) once removed each other's half-built environment, and one
wrote .complete into an environment the other was still installing. A warm run reinstalled the editable package
every time through pip's isolated build, which fetches setuptools from the package index: offline it failed."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# `-c ...` answers the version; `-m venv DIR` makes an environment with the pip below and a python that answers
# the editable install's check (made elsewhere when $ELSEWHERE is set).
FAKE_PYTHON = r"""#!/usr/bin/env bash
if [[ $1 == -c ]]; then echo 3.11; exit 0; fi
if [[ $1 == -m && $2 == venv ]]; then
  mkdir -p "$3/bin"; printf '#!/bin/sh\n[ -z "$ELSEWHERE" ]\n' >"$3/bin/python"
  cp "$FAKE_PIP" "$3/bin/pip"; chmod +x "$3/bin/python" "$3/bin/pip"; exit 0
fi
exit 1
"""
# Logs "<setup's pid> <args>" to $CALLS and takes $PIP_SECONDS; fails when its environment was removed meanwhile,
# an isolated build of the package when $NO_INDEX is set (it fetches setuptools), and a build with the environment's
# own setuptools when $OLD_SETUPTOOLS is set.
FAKE_PIP = r"""#!/usr/bin/env bash
echo "$PPID $*" >>"$CALLS"; sleep "$PIP_SECONDS"
[[ -d "$(dirname "$0")" ]] || exit 1
if [[ $* == *" -e ."* ]]; then
  if [[ $* == *--no-build-isolation* ]]; then [[ -z ${OLD_SETUPTOOLS:-} ]]; else [[ -z ${NO_INDEX:-} ]]; fi
fi
"""


def _clone(tmp_path: Path) -> Path:
    clone = tmp_path / "clone"
    (clone / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "setup.sh", clone / "scripts" / "setup.sh")
    shutil.copy2(ROOT / "pyproject.toml", clone / "pyproject.toml")
    (tmp_path / "python3").write_text(FAKE_PYTHON)
    (tmp_path / "python3").chmod(0o755)
    (tmp_path / "pip").write_text(FAKE_PIP)
    (tmp_path / "calls").touch()
    return clone


def _start(tmp_path: Path, clone: Path, *, pip_seconds: float, **more: str) -> subprocess.Popen:
    env = {**more, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(tmp_path / "python3"),
           "FAKE_PIP": str(tmp_path / "pip"), "KUBETRAIN_CACHE": str(tmp_path / "cache"),
           "CALLS": str(tmp_path / "calls"), "PIP_SECONDS": str(pip_seconds)}
    return subprocess.Popen(["bash", str(clone / "scripts" / "setup.sh")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _venv(tmp_path: Path) -> Path:
    [venv] = [p for p in (tmp_path / "cache" / "venv").glob("py3.11-*") if p.is_dir()]
    return venv


def test_two_cold_setups_at_once_make_the_environment_once(tmp_path: Path) -> None:
    clone = _clone(tmp_path)
    first = _start(tmp_path, clone, pip_seconds=0.5)
    deadline = time.monotonic() + 30
    while not (tmp_path / "calls").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)  # the first run is installing: it holds the environment
    second = _start(tmp_path, clone, pip_seconds=0.5)
    outs = [p.communicate(timeout=60) for p in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], outs
    assert "waiting for it" in outs[1][1] and outs[1][1].count("creating") == 0
    calls = [line.split(" ", 1) for line in (tmp_path / "calls").read_text().splitlines()]
    pids = [pid for pid, _ in calls]
    assert len(set(pids)) == 2 and sum(a != b for a, b in zip(pids, pids[1:])) == 1, "one run's calls, then the other's"
    assert [args for _, args in calls].count("install -e .[dev]") == 1
    assert (_venv(tmp_path) / ".complete").exists() and (clone / ".venv").resolve() == _venv(tmp_path)


def _warm_run(tmp_path: Path, clone: Path, **env: str) -> list[str]:
    """The pip calls of a run on the environment an earlier run made."""
    (tmp_path / "calls").write_text("")
    run = _start(tmp_path, clone, pip_seconds=0, **env)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 0, err
    return [line.split(" ", 1)[1] for line in (tmp_path / "calls").read_text().splitlines()]


LOCAL = "install --no-deps --no-build-isolation -e ."
LINT = "install --group lint"


def test_a_warm_run_offline_reinstalls_only_an_editable_install_made_elsewhere(tmp_path: Path) -> None:
    clone = _clone(tmp_path)
    assert _start(tmp_path, clone, pip_seconds=0).wait(timeout=60) == 0
    stamp = _venv(tmp_path) / ".editable"
    assert stamp.read_text().startswith(f"{clone} ")
    assert _warm_run(tmp_path, clone, NO_INDEX="1") == [LINT], "installed from this clone: nothing to redo"
    assert _warm_run(tmp_path, clone, NO_INDEX="1", ELSEWHERE="1") == [LOCAL, LINT]
    stamp.write_text("/another/clone 0123456789ab\n")  # what another clone's setup.sh leaves
    assert _warm_run(tmp_path, clone, NO_INDEX="1") == [LOCAL, LINT]
    assert stamp.read_text().startswith(f"{clone} ")


def test_an_environment_whose_setuptools_cannot_build_it_takes_the_isolated_build(tmp_path: Path) -> None:
    clone = _clone(tmp_path)
    assert _start(tmp_path, clone, pip_seconds=0).wait(timeout=60) == 0
    calls = _warm_run(tmp_path, clone, ELSEWHERE="1", OLD_SETUPTOOLS="1")
    assert calls == [LOCAL, "install --no-deps -e .", LINT]
