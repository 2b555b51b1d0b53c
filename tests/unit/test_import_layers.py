"""The layer rules (operator: api -> plan -> k8s -> reconciler -> handlers; the training loop never talks to S3; the
two packages share no imports), enforced by import-linter: the contracts are in pyproject.toml."""

import subprocess
import sys
from pathlib import Path


def test_import_contracts_hold():
    root = Path(__file__).resolve().parents[2]
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" in result.stdout and " 0 broken" in result.stdout
