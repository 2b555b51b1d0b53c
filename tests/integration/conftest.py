"""Integration tier: every test in this folder needs the real testbed.

Tests here are marked `integration` automatically, so `pytest -m "not
integration"` (the unit tier) never collects a reason to start the testbed
even if a marker was forgotten.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integration)
