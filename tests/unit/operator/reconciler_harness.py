"""The real Reconciler driven one reconcile at a time by a test: no watch, its requeues recorded; and the operator's
log lines a test reads."""

from __future__ import annotations


import pytest

from kubetrain.config import Settings
from kubetrain.k8s import Api
from kubetrain.reconciler import Reconciler


def quiet_reconciler(api: Api, delays: list[float]) -> Reconciler:
    """A Reconciler on `api` whose pods count as synced and whose requeues append their delay to `delays`."""
    rec = Reconciler(api=api, settings=Settings())
    rec.pods_synced.set()
    rec.enqueue = lambda key, delay=0.0: delays.append(delay)  # type: ignore[method-assign]
    return rec


def logged(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    """The messages the operator logged at exactly `level`."""
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name.startswith("kubetrain")]


