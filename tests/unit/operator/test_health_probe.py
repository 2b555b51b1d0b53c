"""The operator's kopf probe handler (what /healthz reports) answers before the startup handler has run."""

from __future__ import annotations

import asyncio

import kopf

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
