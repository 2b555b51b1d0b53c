"""scripts/setup.sh with a stand-in interpreter whose venv's pip only logs its calls, in a scratch cache: two cold
runs at once (demo.sh in one shell, test.sh in another) once removed each other's half-built environment, and one
wrote .complete into an environment the other was still installing."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# `-c ...` answers the version, `-m venv DIR` makes an environment whose pip logs "<pid> <args>" to $CALLS, takes
# $PIP_SECONDS and fails if its environment was removed meanwhile.
FAKE_PYTHON = """#!/usr/bin/env bash
if [[ $1 == -c ]]; then echo 3.11; exit 0; fi
if [[ $1 == -m && $2 == venv ]]; then
  mkdir -p "$3/bin"; printf '#!/bin/sh\\nexit 0\\n' >"$3/bin/python"
  printf '#!/bin/sh\\necho "$PPID $*" >>"$CALLS"; sleep "$PIP_SECONDS"\\n[ -d "%s/bin" ] || exit 1\\n' "$3" >"$3/bin/pip"
  chmod +x "$3/bin/python" "$3/bin/pip"; exit 0
fi
exit 1
"""


def _clone(tmp_path: Path) -> Path:
    clone = tmp_path / "clone"
    (clone / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "setup.sh", clone / "scripts" / "setup.sh")
    shutil.copy2(ROOT / "pyproject.toml", clone / "pyproject.toml")
    (tmp_path / "python3").write_text(FAKE_PYTHON)
    (tmp_path / "python3").chmod(0o755)
    (tmp_path / "calls").touch()
    return clone


def _start(tmp_path: Path, clone: Path, *, pip_seconds: float) -> subprocess.Popen:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(tmp_path / "python3"),
           "KUBETRAIN_CACHE": str(tmp_path / "cache"), "CALLS": str(tmp_path / "calls"),
           "PIP_SECONDS": str(pip_seconds)}
    return subprocess.Popen(["bash", str(clone / "scripts" / "setup.sh")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


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
    [venv] = [p for p in (tmp_path / "cache" / "venv").glob("py3.11-*") if p.is_dir()]
    assert (venv / ".complete").exists() and (clone / ".venv").resolve() == venv
