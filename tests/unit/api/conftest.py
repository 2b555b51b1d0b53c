"""Fixtures shared by the API unit tests: the CRD and its v1alpha1 schema,
loaded once from the file users and the chart consume."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
CRD_FILE = ROOT / "crds" / "trainingjob.yaml"


@pytest.fixture(scope="session")
def crd() -> dict:
    return yaml.safe_load(CRD_FILE.read_text())


@pytest.fixture(scope="session")
def version(crd: dict) -> dict:
    (v,) = crd["spec"]["versions"]
    return v


@pytest.fixture(scope="session")
def schema(version: dict) -> dict:
    return version["schema"]["openAPIV3Schema"]
