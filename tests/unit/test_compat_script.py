"""scripts/compat.sh picks the Kubernetes version to test against from the chart's kubeVersion: the
chart's minimum at the patch release testbed/versions.env names for the CRD check, so the version the
chart promises is the version a maintainer's compat run exercises."""

from __future__ import annotations

import os
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


def _stub_root(tmp_path: Path, *, build_fails: bool = False) -> Path:
    """A repository with compat.sh, the chart and versions.env, and stubs for everything it runs (the build,
    scripts/testbed.sh, the venv's python), each writing its arguments and KUBETRAIN_TESTBED_DIR to $RECORD."""
    root = tmp_path / "root"
    for rel in ("scripts/compat.sh", "charts/kubetrain/Chart.yaml", "testbed/versions.env"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, root / rel)
    stub = '#!/usr/bin/env bash\necho "$0 $* dir=${KUBETRAIN_TESTBED_DIR-unset}" >>"$RECORD"\n'
    (root / "testbed" / "build.sh").write_text(stub + ("echo the compiler said no; exit 1\n" if build_fails else ""))
    (root / "scripts" / "testbed.sh").write_text(stub)
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").write_text(stub)
    for f in ("scripts/testbed.sh", ".venv/bin/python"):
        (root / f).chmod(0o755)
    (root / ".gitignore").write_text(".venv\n")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "stub"], check=True)
    return root


def _compat(root: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "scripts" / "compat.sh"), "v1.30.14"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "RECORD": str(tmp_path / "record"), **env})


def test_a_testbed_folder_from_the_environment_is_not_the_compat_runs(tmp_path):
    """KUBETRAIN_TESTBED_DIR (testbed/README's knob for another state folder) would have the scratch clone's
    `up` reuse the testbed running there, on its own Kubernetes, and the cleanup's `down` stop it."""
    root = _stub_root(tmp_path)
    proc = _compat(root, tmp_path, KUBETRAIN_TESTBED_DIR=str(tmp_path / "mine"))
    assert proc.returncode == 0, proc.stderr
    record = (tmp_path / "record").read_text()
    assert "testbed.sh up" in record and "-m pytest" in record and "kubetrain_testbed down" in record, record
    assert "dir=unset" in record and str(tmp_path / "mine") not in record, record


def test_a_failed_build_leaves_the_log_it_names(tmp_path):
    root = _stub_root(tmp_path, build_fails=True)
    proc = _compat(root, tmp_path)
    assert proc.returncode == 1 and "the compiler said no" in proc.stderr, proc.stderr
    named = re.search(r"(/tmp/kubetrain-compat\S*\.log)", proc.stderr.split("the compiler said no")[-1])
    assert named, proc.stderr
    log = Path(named.group(1))
    try:
        assert "the compiler said no" in log.read_text()
    finally:
        log.unlink(missing_ok=True)
