"""The test node agent's pods run the packages of the agent's own checkout, whatever the shared
virtual environment's editable install points at (a fresh clone that ran scripts/setup.sh, then was
deleted, left every operator pod unable to import kubetrain)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kubetrain_testbed.agent import CHECKOUT, checkout_python_path

ROOT = Path(__file__).resolve().parents[3]


def test_the_agent_knows_its_checkout() -> None:
    assert CHECKOUT == ROOT


def test_a_pod_process_imports_this_checkouts_operator_and_trainer() -> None:
    code = "import kubetrain, kubetrain_trainer; print(kubetrain.__file__); print(kubetrain_trainer.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": checkout_python_path()},
                         capture_output=True, text=True, check=True, cwd="/").stdout.split()
    assert out == [str(ROOT / "operator" / "kubetrain" / "__init__.py"),
                   str(ROOT / "trainer_image" / "kubetrain_trainer" / "__init__.py")]
