"""docs/api.md is generated from the CRD; this fails when someone edits one
without regenerating the other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_api_reference_is_fresh():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-api-docs.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
