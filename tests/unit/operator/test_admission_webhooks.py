"""A policy engine's admission webhook in the user's cluster (Kyverno, Gatekeeper...): one that denies a pod fails
the job with its message and deletes the pods of the gang already created; one the API server cannot call (down,
slow, failurePolicy Fail: HTTP 500) is shown on the job while the operator waits with backoff. Through the real
`Reconciler` and `Api`; only the client functions are stand-ins (they answer as the API server does)."""

from __future__ import annotations

import asyncio
import copy
import json
from types import SimpleNamespace
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain.config import Settings
from kubetrain.k8s import Api
from kubetrain.reconciler import Reconciler

BODY = {
    "metadata": {"name": "train", "namespace": "ml", "uid": "uid-now", "generation": 1,
                 "creationTimestamp": "2026-12-03T13:00:00Z", "resourceVersion": "7"},
    "spec": {"image": "reg/trainer:0.1.0", "nodes": 2, "trainer": {"builtin": {"task": "regression"}},
             "strategy": {"type": "ddp"}},
}
DENIED = ('admission webhook "validate.kyverno.svc-fail" denied the request: resource Pod/ml/train-a1-n1 was '
          'blocked: require-team-label: label team is required')
UNREACHABLE = ('Internal error occurred: failed calling webhook "validate.kyverno.svc-fail": failed to call '
               'webhook: Post "https://kyverno-svc.kyverno.svc:443/validate/fail?timeout=10s": context deadline '
               'exceeded')


class _Response:
    def __init__(self, body: Any) -> None:
        self.data = json.dumps(body).encode()

    def release_conn(self) -> None:
        pass


def _reconcile(create_pod) -> tuple[list[str], list[dict], list[float]]:
    """One reconcile of a new two-node job: (calls, status bodies written, requeue delays)."""
    calls: list[str] = []
    statuses: list[dict] = []
    delays: list[float] = []

    def record(what: str):
        def call(*args: Any, **__: Any) -> _Response:
            calls.append(f"{what} {args[0]}" if what == "delete" else what)
            return _Response({})
        return call

    def patch_status(*args: Any, **__: Any) -> _Response:
        statuses.append(args[-1]["status"])
        return _Response({**BODY, "metadata": {**BODY["metadata"], "resourceVersion": "8"}, **args[-1]})

    async def main() -> None:
        api = Api(client.ApiClient(), threads=4)
        api.core = SimpleNamespace(create_namespaced_pod=create_pod(calls), read_namespaced_pod=record("read"),
                                   create_namespaced_service=record("service"), delete_namespaced_pod=record("delete"),
                                   create_namespaced_event=record("event"))
        api.custom = SimpleNamespace(patch_namespaced_custom_object_status=patch_status)
        rec = Reconciler(api=api, settings=Settings())
        rec.pods_synced.set()
        rec.jobs[("ml", "train")] = copy.deepcopy(BODY)
        rec.enqueue = lambda key, delay=0.0: delays.append(delay)  # type: ignore[method-assign]
        try:
            await rec.reconcile(("ml", "train"))
            await asyncio.sleep(0.2)  # the events go out in the background
        finally:
            api.close()

    asyncio.run(main())
    return calls, statuses, delays


def _answer(status: int, message: str, *, rank: int | None = None):
    """create_namespaced_pod: HTTP `status` with `message` (for `rank` only, or every pod)."""
    def make(calls: list[str]):
        def create(namespace: str, body: dict, **_: Any) -> _Response:
            calls.append(f"create {body['metadata']['name']}")
            if rank is None or body["metadata"]["name"].endswith(f"-n{rank}"):
                exc = ApiException(status=status, reason="Refused")
                exc.body = json.dumps({"kind": "Status", "code": status, "message": message})
                raise exc
            return _Response(body)
        return create
    return make


def test_a_webhook_that_denies_one_pod_fails_the_job_with_its_message_and_deletes_the_rest_of_the_gang() -> None:
    calls, statuses, _ = _reconcile(_answer(403, DENIED, rank=1))
    assert sorted(c for c in calls if c.startswith("create")) == ["create train-a1-n0", "create train-a1-n1"]
    assert statuses[-1]["phase"] == "Failed" and "require-team-label: label team is required" in \
        statuses[-1]["message"]
    assert "delete train-a1-n0" in calls  # not left holding its node


def test_a_webhook_the_api_server_cannot_call_is_shown_on_the_job_while_it_waits_with_backoff() -> None:
    """Before: an HTTP 500 like any other, retried every 2 s for as long as the policy engine was down, with
    nothing on the job (no status, no event): `kubectl describe` said nothing about why no pod ran."""
    calls, statuses, delays = _reconcile(_answer(500, UNREACHABLE))
    assert statuses, "nothing was written on the job"
    created = next(c for c in statuses[-1]["conditions"] if c["type"] == "Created")
    assert created["status"] == "False" and created["reason"] == "AdmissionWebhookUnavailable"
    assert 'failed calling webhook "validate.kyverno.svc-fail"' in statuses[-1]["message"]
    assert statuses[-1]["phase"] == "Pending" and "event" in calls
    assert delays == [5.0]  # REJECTED_BACKOFF: 5 s, then 10, 20, 40, 60


def test_any_other_http_500_on_a_create_is_retried_quietly() -> None:
    _, statuses, delays = _reconcile(_answer(500, "etcdserver: request timed out"))
    assert statuses == [] and delays == [2.0]
