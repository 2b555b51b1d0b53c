"""Events that cannot be posted while the API server is away or failing: one WARNING for all jobs, the rest at DEBUG
(a WARNING with their count now and then), one INFO once events go through again. Through the real `Api`, its
error classification and `k8s.post_event`; only the client's create function stands in."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from types import SimpleNamespace
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain import k8s
from kubetrain.actions import Event
from kubetrain.api import Job
from kubetrain.k8s import Api
from reconciler_harness import logged

BODY = {
    "metadata": {"name": "train", "namespace": "ml", "uid": "uid-now", "generation": 1,
                 "creationTimestamp": "2026-12-03T13:00:00Z", "resourceVersion": "7"},
    "spec": {"image": "reg/trainer:0.1.0", "nodes": 2, "trainer": {"builtin": {"task": "regression"}},
             "strategy": {"type": "ddp"}},
}


class _Response:
    data = b"{}"

    def release_conn(self) -> None:
        pass


def _unavailable(namespace: str = "ml") -> ApiException:
    exc = ApiException(status=503, reason="Service Unavailable")
    exc.body = json.dumps({"kind": "Status", "code": 503, "message": "etcdserver: leader changed"})
    return exc


def _refused(namespace: str) -> Exception:
    return urllib3.exceptions.MaxRetryError(None, f"/api/v1/namespaces/{namespace}/events",  # type: ignore[arg-type]
                                            reason=ConnectionRefusedError("Connection refused"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_api_outage_is_one_warning_for_all_jobs_events_not_one_per_event(caplog) -> None:
    """Before: `could not post event Running for ml-3/train-17: ...` at WARNING for every event of every job while
    the API server was away (200 jobs: a flood burying the rest), and nothing when it came back."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    answers: list[Any] = []

    def create_namespaced_event(namespace: str, body: dict, **_: Any) -> _Response:
        answer = answers.pop(0)
        if answer is not None:
            raise answer(namespace)
        return _Response()

    async def main() -> None:
        api = Api(client.ApiClient(), threads=2)
        api.core = SimpleNamespace(create_namespaced_event=create_namespaced_event)
        api.transport = None  # the client's own request path: its stand-in above answers
        try:
            for n in range(200):  # 200 jobs in 4 namespaces, each with an event: the API server restarting
                body = copy.deepcopy(BODY)
                body["metadata"].update(name=f"train-{n}", namespace=f"ml-{n % 4}")
                answers.append(_refused if n % 3 else _unavailable)
                await k8s.post_event(api, Job.from_storage(body), Event("Normal", "Running", "all pods run"))
            answers.append(None)  # it is back
            await k8s.post_event(api, Job.from_storage(copy.deepcopy(BODY)), Event("Normal", "Running", "all run"))
            answers.append(None)
            await k8s.post_event(api, Job.from_storage(copy.deepcopy(BODY)), Event("Normal", "Running", "all run"))
        finally:
            api.close()

    asyncio.run(main())
    warnings = logged(caplog, logging.WARNING)
    assert len(warnings) == 1, warnings  # the first one; none of the next (within EVENT_WARNING_EVERY)
    assert warnings[0].startswith("could not post event Running for ml-0/train-0: create_namespaced_event: HTTP 503")
    assert len([m for m in logged(caplog, logging.DEBUG) if m.startswith("could not post event")]) == 199
    assert logged(caplog, logging.INFO) == ["events are posted again (after 200 failures in a row)"]


def test_a_long_outage_warns_again_every_few_minutes_with_the_count(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    clock = Clock()

    def create_namespaced_event(namespace: str, body: dict, **_: Any) -> _Response:
        clock.now += 60.0
        raise _unavailable()

    async def main() -> None:
        api = Api(client.ApiClient(), threads=1)
        api.core = SimpleNamespace(create_namespaced_event=create_namespaced_event)
        api.transport = None
        api.event_failures.clock = clock
        try:
            for _ in range(11):  # one event a minute for 11 minutes
                await k8s.post_event(api, Job.from_storage(copy.deepcopy(BODY)), Event("Normal", "Running", "ok"))
        finally:
            api.close()

    asyncio.run(main())
    failure = "could not post event Running for ml/train: create_namespaced_event: HTTP 503 Service Unavailable"
    assert logged(caplog, logging.WARNING) == [failure, f"{failure} (5 more times in the last 300s)",
                                               f"{failure} (5 more times in the last 300s)"]
