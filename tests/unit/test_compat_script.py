"""scripts/compat.sh picks the Kubernetes version to test against from the chart's kubeVersion: the
chart's minimum at the patch release testbed/versions.env names for the CRD check, so the version the
chart promises is the version a maintainer's compat run exercises."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _chart_minimum() -> str:
    constraint = yaml.safe_load((ROOT / "charts" / "kubetrain" / "Chart.yaml").read_text())["kubeVersion"]
    return re.fullmatch(r">=(\d+\.\d+)\.0-0", constraint).group(1)


def _version(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "scripts" / "compat.sh"), "--print-version", *args],
                          capture_output=True, text=True, timeout=30)


def test_the_default_is_the_charts_minimum():
    proc = _version(ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(f"v{_chart_minimum()}."), proc.stdout


def test_a_version_given_is_taken_and_a_malformed_one_refused():
    assert _version(ROOT, "v1.33.13").stdout.strip() == "v1.33.13"
    proc = _version(ROOT, "1.33")
    assert proc.returncode == 2 and "not a version like" in proc.stderr


@pytest.mark.parametrize("versions", ['"v1.29.15 v1.99.1"', None], ids=["minimum not listed", "no list"])
def test_a_minimum_without_a_pinned_patch_release_is_refused_by_name(tmp_path, versions):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "testbed").mkdir()
    (tmp_path / "charts" / "kubetrain").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "compat.sh", tmp_path / "scripts" / "compat.sh")
    shutil.copy2(ROOT / "charts" / "kubetrain" / "Chart.yaml", tmp_path / "charts" / "kubetrain" / "Chart.yaml")
    (tmp_path / "testbed" / "versions.env").write_text(
        "K8S_VERSION=v1.36.3\n" + (f"CRD_CHECK_K8S_VERSIONS={versions}\n" if versions else ""))
    proc = _version(tmp_path)
    assert proc.returncode == 2 and f"names no v{_chart_minimum()}.x" in proc.stderr, proc.stderr
