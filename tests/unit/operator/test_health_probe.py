"""The operator's kopf probe handler (what /healthz reports) answers before the startup handler has run, and a
standby's own endpoint answers the same path whoever leads (the chart's liveness and readiness probes ask it)."""

from __future__ import annotations

import asyncio

import kopf
import pytest

from kubetrain.handlers import api_writes


def test_a_probe_before_startup_answers_instead_of_raising():
    # kopf retries a raising probe handler with backoff while it holds the lock every /healthz request
    # waits on: one probe that came before the startup handler set memo.api left the endpoint hanging,
    # and the kubelet's liveness probe killed a healthy operator.
    memo = kopf.Memo()
    assert asyncio.run(api_writes(memo=memo)) == {}

    class Api:
        writes = {"create pod": 4}

    memo.api = Api()
    assert asyncio.run(api_writes(memo=memo)) == {"create pod": 4}


def test_a_standby_answers_the_probe_path_whoever_leads_and_only_that_path():
    # The chart's readinessProbe asks /healthz (as its livenessProbe): a standby must answer it with 200 before
    # its first look at the Lease and while another replica leads, or `helm install --wait` with replicaCount > 1
    # and every rolling update (maxUnavailable 0: the new pod leads only once the old one has gone) would wait
    # forever. Another path is a 404, so a probe pointed elsewhere fails on a standby and on kopf alike.
    import json
    import socket
    import urllib.error
    import urllib.request
    from types import SimpleNamespace

    from kubetrain.cli import _standby_health

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    elector = SimpleNamespace(lease_ref="Lease kubetrain/kt-kubetrain", holder=None)
    with _standby_health(f"http://127.0.0.1:{port}/healthz", elector):
        for holder in (None, "kt-kubetrain-7d9f-abcde"):  # before the first read of the Lease; another leads
            elector.holder = holder
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as answer:
                assert answer.status == 200
                assert json.loads(answer.read()) == {"leader": False, "lease": elector.lease_ref, "holder": holder}
        with pytest.raises(urllib.error.HTTPError) as other:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10)
        assert other.value.code == 404
