"""A queued job whose Kueue read fails (the API server away or overloaded, RBAC refusing `get workloads`) backs off
as any temporary error does, and logs the failure once, not once per job every 5 s. Through the real `Reconciler`,
`Api` and error classification; only the client functions are stand-ins that answer as the API server does."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from types import SimpleNamespace
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain import metrics
from kubetrain.k8s import Api
from reconciler_harness import logged, quiet_reconciler

SA = "system:serviceaccount:kubetrain:kt-kubetrain"
KEY = ("ml", "train")
BODY = {
    "metadata": {"name": "train", "namespace": "ml", "uid": "uid-now", "generation": 1,
                 "creationTimestamp": "2026-12-03T13:00:00Z", "resourceVersion": "7",
                 "labels": {"kueue.x-k8s.io/queue-name": "team"}},
    "spec": {"image": "reg/trainer:0.1.0", "nodes": 2, "trainer": {"builtin": {"task": "regression"}},
             "strategy": {"type": "ddp"}},
}


def _error(status: int, message: str = "try later", headers: Any = None) -> ApiException:
    exc = ApiException(status=status, reason="Reason")
    exc.body, exc.headers = json.dumps({"kind": "Status", "code": status, "message": message}), headers
    return exc


def _unavailable() -> ApiException:
    return _error(503)


def _forbidden() -> ApiException:
    return _error(403, f'workloads.kueue.x-k8s.io "x" is forbidden: User "{SA}" cannot get resource "workloads" in '
                       'API group "kueue.x-k8s.io" in the namespace "ml"')


def _no_kueue() -> ApiException:  # Kueue's CRDs are not installed: the job's status says so, a write goes through
    return _error(404, "the server could not find the requested resource")


class _Response:
    def __init__(self, body: Any) -> None:
        self.data = json.dumps(body).encode()

    def release_conn(self) -> None:
        pass


def reconcile(answers: list[Any]) -> list[float]:
    """One reconcile of the same queued job per answer of its Workload read; the delays it asks for."""
    delays: list[float] = []

    def get_workload(*_: Any, **__: Any) -> _Response:
        raise answers[0]()

    def patch_status(*args: Any, **__: Any) -> _Response:
        return _Response({**BODY, "metadata": {**BODY["metadata"], "resourceVersion": "8"}, **args[-1]})

    async def main() -> None:
        api = Api(client.ApiClient(), threads=4)
        ok = lambda *_, **__: _Response({})  # noqa: E731
        api.core = SimpleNamespace(create_namespaced_event=ok)
        api.custom = SimpleNamespace(get_namespaced_custom_object=get_workload,
                                     patch_namespaced_custom_object_status=patch_status)
        rec = quiet_reconciler(api, delays)
        try:
            while answers:
                rec.jobs[KEY] = copy.deepcopy(BODY)
                await rec.reconcile(KEY)
                answers.pop(0)
            await asyncio.sleep(0.05)  # the events go out in the background
        finally:
            api.close()

    asyncio.run(main())
    return delays


def test_a_failing_kueue_read_backs_off_and_warns_once(caplog) -> None:
    """Before: `reconcile of ml/train: reading Kueue: get workload ...: HTTP 503; retrying` at WARNING for every
    queued job every 5 s for as long as it failed, with no backoff and no Retry-After."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    delays = reconcile([_unavailable] * 7 + [_no_kueue])
    assert delays[:7] == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    (warning,) = logged(caplog, logging.WARNING)
    assert warning.startswith("reconcile of ml/train: reading Kueue: ") and "HTTP 503" in warning
    repeats = [m for m in logged(caplog, logging.DEBUG) if "reading Kueue" in m]
    assert len(repeats) == 6
    assert "reconcile of ml/train goes through again (after 7 failures in a row)" in logged(caplog, logging.INFO)


def test_a_kueue_read_waits_at_least_what_retry_after_asks() -> None:
    assert reconcile([lambda: _error(429, headers={"Retry-After": "30"})]) == [30.0]


def test_a_kueue_read_rbac_refuses_is_the_ledgers_one_error_and_backs_off(caplog) -> None:
    """Before: the ERROR naming the permission, then a WARNING per job every 5 s on top of it."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    before = metrics.REGISTRY.get_sample_value("kubetrain_errors_total", {"kind": "forbidden"}) or 0.0
    delays = reconcile([_forbidden] * 4)
    assert delays == [2.0, 4.0, 8.0, 16.0]
    (error,) = logged(caplog, logging.ERROR)
    assert "forbids the operator to get workloads in namespace ml (API group kueue.x-k8s.io" in error
    assert logged(caplog, logging.WARNING) == []
    assert metrics.REGISTRY.get_sample_value("kubetrain_errors_total", {"kind": "forbidden"}) == before + 4
