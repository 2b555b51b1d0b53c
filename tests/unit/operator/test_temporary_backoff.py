"""Temporary API errors (429, 5xx, a connection reset) back off while they last, at least as long as the API
server's Retry-After asks; the first success resets it. Through the real `Reconciler`, `Api` and error
classification; only the client functions are stand-ins (they answer as the API server would)."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from urllib3._collections import HTTPHeaderDict

from kubetrain import k8s
from kubetrain.config import Settings
from kubetrain.errors import InvalidError, TemporaryError, classify
from kubetrain.k8s import Api
from kubetrain.reconciler import Reconciler
from reconciler_harness import logged, quiet_reconciler

BODY = {
    "metadata": {"name": "train", "namespace": "ml", "uid": "uid-now", "generation": 1,
                 "creationTimestamp": "2026-12-03T13:00:00Z", "resourceVersion": "7"},
    "spec": {"image": "reg/trainer:0.1.0", "nodes": 2, "trainer": {"builtin": {"task": "regression"}},
             "strategy": {"type": "ddp"}},
}


class _Response:
    def __init__(self, body: Any) -> None:
        self.data = json.dumps(body).encode()

    def release_conn(self) -> None:
        pass


def _error(status: int, headers: Any = None) -> ApiException:
    exc = ApiException(status=status, reason="Reason")
    exc.body, exc.headers = json.dumps({"kind": "Status", "message": "try later"}), headers
    return exc


@pytest.mark.parametrize("headers,delay", [
    (None, 5.0), ({"Retry-After": "1"}, 5.0), ({"Retry-After": "30"}, 30.0),  # the lean transport: a dict
    (HTTPHeaderDict({"retry-after": "45"}), 45.0),                            # the generated client's headers
    ({"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}, 5.0), ({"Retry-After": "86400"}, 300.0),
], ids=["none", "shorter", "longer", "client headers", "a date", "capped"])
def test_a_429_waits_at_least_what_retry_after_asks(headers: Any, delay: float) -> None:
    err = classify(_error(429, headers), "create pod")
    assert isinstance(err, TemporaryError) and err.delay == delay


def test_a_503_with_retry_after_waits_for_it() -> None:
    assert classify(_error(503, {"Retry-After": "20"}), "create pod").delay == 20.0
    assert classify(_error(503), "create pod").delay == 2.0


def test_temporary_errors_in_a_row_back_off_and_a_success_resets_it() -> None:
    """Before: every job was tried again every 2 s (5 s on a 429) for as long as the API server was away or
    overloaded, its reconcile's requests and a warning each time: with hundreds of jobs, a steady load on an API
    server that was already refusing."""
    answers: list[Any] = [_error(503)] * 8 + [None] + [_error(503)]
    delays: list[float] = []

    def create_pod(namespace: str, body: dict, **_: Any) -> _Response:
        answer = answers[0]
        if answer is not None:
            raise answer
        return _Response(body)

    def patch_status(*args: Any, **__: Any) -> _Response:
        return _Response({**BODY, "metadata": {**BODY["metadata"], "resourceVersion": "8"}, **args[-1]})

    async def main() -> None:
        api = Api(client.ApiClient(), threads=4)
        ok = lambda *_, **__: _Response({})  # noqa: E731
        api.core = SimpleNamespace(create_namespaced_pod=create_pod, read_namespaced_pod=ok,
                                   create_namespaced_service=ok, read_namespaced_service=ok,
                                   create_namespaced_event=ok)
        api.custom = SimpleNamespace(patch_namespaced_custom_object_status=patch_status)
        rec = Reconciler(api=api, settings=Settings())
        rec.pods_synced.set()
        rec.enqueue = lambda key, delay=0.0: delays.append(delay)  # type: ignore[method-assign]
        try:
            while answers:
                rec.jobs[("ml", "train")] = copy.deepcopy(BODY)  # the same launch each time
                rec.expectations.clear()
                await rec.reconcile(("ml", "train"))
                answers.pop(0)
            await asyncio.sleep(0.1)  # the events go out in the background
        finally:
            api.close()

    asyncio.run(main())
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0, 2.0]


def test_a_conflict_whose_re_read_fails_is_tried_again_later_not_a_crash() -> None:
    """Before: the status write met a newer job (409) and the re-read of the job then met a 503 or a reset: the
    TemporaryError escaped the reconcile, logged as a crash with a traceback (metric reconcile_crash), retried
    in a fixed 10 s."""
    delays: list[float] = []

    def refuse(status: int):
        def call(*_: Any, **__: Any) -> None:
            raise _error(status)
        return call

    async def main() -> None:
        api = Api(client.ApiClient(), threads=4)
        ok = lambda *_, **__: _Response({})  # noqa: E731
        api.core = SimpleNamespace(create_namespaced_pod=ok, read_namespaced_pod=ok, create_namespaced_service=ok,
                                   read_namespaced_service=ok, create_namespaced_event=ok)
        api.custom = SimpleNamespace(patch_namespaced_custom_object_status=refuse(409),
                                     get_namespaced_custom_object=refuse(503))
        rec = Reconciler(api=api, settings=Settings())
        rec.pods_synced.set()
        rec.enqueue = lambda key, delay=0.0: delays.append(delay)  # type: ignore[method-assign]
        rec.jobs[("ml", "train")] = copy.deepcopy(BODY)
        try:
            await rec.reconcile(("ml", "train"))
        finally:
            api.close()

    asyncio.run(main())
    assert delays == [2.0]


def test_an_answer_no_step_expected_backs_off_warns_once_and_says_when_it_goes_through(caplog, monkeypatch) -> None:
    """Before: a refusal that reached the reconcile unclassified (a 404, a 422 on a write that is not a create)
    logged `reconcile of ml/train: HTTP 422 ...; retrying` at WARNING every 5 s for as long as it lasted, and
    nothing when it ended. The k8s layer stands in: it raises what the API server's answer became."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    answers: list[Any] = [InvalidError("patch trainingjob/status: HTTP 422 Unprocessable Entity", status=422,
                                       http_reason="Unprocessable Entity")] * 6 + [None]
    delays: list[float] = []

    async def apply(*_: Any, **__: Any) -> None:
        if answers[0] is not None:
            raise answers[0]

    async def main() -> None:
        api = Api(client.ApiClient(), threads=1)
        rec = quiet_reconciler(api, delays)
        try:
            while answers:
                rec.jobs[("ml", "train")] = copy.deepcopy(BODY)
                rec.expectations.clear()
                await rec.reconcile(("ml", "train"))
                answers.pop(0)
        finally:
            api.close()

    monkeypatch.setattr(k8s, "apply", apply)
    asyncio.run(main())
    assert delays == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    assert logged(caplog, logging.WARNING) == [
        "reconcile of ml/train: patch trainingjob/status: HTTP 422 Unprocessable Entity; retrying in 5s"]
    assert len([m for m in logged(caplog, logging.DEBUG) if "HTTP 422" in m]) == 5
    assert "reconcile of ml/train goes through again (after 6 failures in a row)" in logged(caplog, logging.INFO)
