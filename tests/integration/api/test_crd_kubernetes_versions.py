"""The CRD installs on every Kubernetes version the chart says it supports, and on the newest.

The testbed's API server is one version (testbed/versions.env K8S_VERSION); a user's cluster may be older
or newer. Each version's API server validates a CRD on create with its own CEL environment and cost
estimator, and those differ: a rule that 1.36 accepts can be over 1.33's budget. `testbed/build.sh
--crd-check` builds testbed/crdcheck (the API server's own CRD validation, no server) against the
k8s.io/apiextensions-apiserver of each version in CRD_CHECK_K8S_VERSIONS. Here every one at or above the
chart's kubeVersion must accept every file in crds/, and every one below must refuse it (so the
minimum the chart states is the real one, not a guess). A field a version does not know is an error there
(strict, as `kubectl apply` asks), never dropped in silence, and every document of a file is checked.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
CRD_FILE = ROOT / "crds" / "trainingjob.yaml"
BUILD = ROOT / "testbed" / "build.sh"


def _versions() -> list[str]:
    text = (ROOT / "testbed" / "versions.env").read_text()
    found = re.search(r'^CRD_CHECK_K8S_VERSIONS="([^"]+)"', text, re.M)
    assert found, "testbed/versions.env sets no CRD_CHECK_K8S_VERSIONS"
    return found.group(1).split()


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"v?(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def _chart_minimum() -> tuple[int, int]:
    constraint = yaml.safe_load((ROOT / "charts" / "kubetrain" / "Chart.yaml").read_text())["kubeVersion"]
    found = re.fullmatch(r">=\s*(\d+\.\d+)\.0-0", constraint)
    assert found, f"Chart.yaml kubeVersion {constraint!r} is not of the form '>=1.N.0-0'"
    return _minor(found.group(1))


@pytest.fixture(scope="module")
def checkers() -> Path:
    """The bin folder with crdcheck-<version> for every version (built once, then cached by version)."""
    proc = subprocess.run(["bash", str(BUILD), "--crd-check"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def test_the_versions_checked_straddle_the_charts_minimum():
    """Without a version below the minimum and one at it, the test below would prove nothing about the bound."""
    minimum = _chart_minimum()
    versions = [_minor(v) for v in _versions()]
    assert any(v < minimum for v in versions) and minimum in versions, (_versions(), minimum)


def _check(checkers: Path, version: str, *files: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(checkers / f"crdcheck-{version}"), *map(str, files)], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("version", _versions())
def test_the_crd_is_valid_exactly_where_the_chart_says_it_installs(checkers, version):
    files = sorted((ROOT / "crds").glob("*.yaml"))
    assert CRD_FILE in files
    proc = _check(checkers, version, *files)
    supported = _minor(version) >= _chart_minimum()
    if supported:
        assert proc.returncode == 0, f"Kubernetes {version} refuses the CRD:\n{proc.stdout[-4000:]}{proc.stderr}"
        assert proc.stdout.splitlines() == [f"{f}: valid" for f in files]
    else:
        # Refused for the CRD's rules (not a crash of the checker): below the minimum the chart must say no.
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "x-kubernetes-validations" in proc.stdout, proc.stdout


@pytest.mark.parametrize("version", _versions())
def test_a_field_the_version_does_not_know_is_refused_in_any_document(checkers, version, tmp_path):
    """helm's create drops an unknown field with a warning (the bound it carried is gone on that version);
    `kubectl apply` is refused. Either way the check says so, in a file's second document too."""
    text = CRD_FILE.read_text()
    assert "                  maximum: 1024\n" in text  # spec.nodes
    typo = text.replace("                  maximum: 1024\n", "                  maxximum: 1024\n", 1)
    both = tmp_path / "two-documents.yaml"
    both.write_text(f"{text}\n---\n{typo}")
    proc = _check(checkers, version, both)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (f'{both} (document 2): strict decoding error: unknown field '
            f'"spec.versions[0].schema.openAPIV3Schema.properties.spec.properties.nodes.maxximum"') in proc.stdout
