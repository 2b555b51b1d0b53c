"""The API's errors as types: each HTTP status once, in `Api._call`; which refusals of a pod
create can pass (wait) and which cannot (fail the job)."""

from __future__ import annotations

import asyncio
import socket
import json

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain import errors
from kubetrain.errors import PermanentError, RejectedError, classify_forbidden
from kubetrain.k8s import Api

CASES = [
    ('pods "tj-a1-n0" is forbidden: exceeded quota: q, requested: pods=1, used: pods=4, limited: pods=4',
     RejectedError, "QuotaExceeded"),
    ('pods is forbidden: User "system:serviceaccount:kt:kubetrain" cannot create resource "pods" in API group "" '
     'in the namespace "team-a"', RejectedError, "Forbidden"),
    ('pods "tj-a1-n0" is forbidden: status unknown for quota: compute, resources: limits.cpu,pods',
     RejectedError, "QuotaPending"),  # a quota made with the namespace, its usage not counted yet
    ('pods "tj-a1-n0" is forbidden: error looking up service account ml/default: serviceaccount "default" not '
     'found', RejectedError, "ServiceAccountMissing"),
    ('pods "tj-a1-n0" is forbidden: cannot set blockOwnerDeletion if an ownerReference refers to a resource you '
     "can't set finalizers on: , <nil>", RejectedError, "Forbidden"),  # the operator's Role, for the owner
    ('pods "tj-a1-n0" is forbidden: violates PodSecurity "restricted:latest": hostPath volumes (volume "data")',
     PermanentError, "PodSecurity"),
    ('pods "tj-a1-n0" is forbidden: maximum cpu usage per Container is 200m, but limit is 1',
     PermanentError, "PodRejected"),
]


@pytest.mark.parametrize("api_message,kind,reason", CASES, ids=[c[2] for c in CASES])
def test_forbidden_pod_creates_are_classified(api_message: str, kind: type, reason: str) -> None:
    err = classify_forbidden(api_message, f"create pod tj-a1-n0: {api_message}")
    assert isinstance(err, kind) and err.reason == reason and api_message in str(err)


STATUSES = [
    (409, errors.ConflictError), (404, errors.NotFoundError), (400, errors.InvalidError),
    (422, errors.InvalidError), (403, errors.ForbiddenError), (429, errors.TemporaryError),
    (500, errors.TemporaryError), (503, errors.TemporaryError), (410, errors.TemporaryError),
]


@pytest.mark.parametrize("status,kind", STATUSES, ids=[str(s) for s, _ in STATUSES])
def test_api_call_raises_one_typed_error_per_status(status: int, kind: type) -> None:
    """What a caller of `Api.call` catches: never a raw ApiException, never a status to inspect."""
    body = json.dumps({"kind": "Status", "message": f"pods \"tj-a1-n0\" says {status}"})

    def create_namespaced_pod(*_: object, **__: object) -> None:
        exc = ApiException(status=status, reason="Reason")
        exc.body = body
        raise exc

    async def call() -> None:
        api = Api(client.ApiClient(), threads=2)
        try:
            await api.call("create pod", create_namespaced_pod, "ns", {})
        finally:
            api.close()

    with pytest.raises(errors.ApiError) as raised:
        asyncio.run(call())
    assert type(raised.value) is kind
    assert raised.value.status == status
    assert raised.value.api_message == f'pods "tj-a1-n0" says {status}'
    assert str(raised.value) == f"create_namespaced_pod: HTTP {status} Reason"
    if kind is errors.TemporaryError:
        assert raised.value.delay == (5.0 if status == 429 else 2.0)


def test_an_api_server_that_cannot_be_reached_is_temporary_through_the_real_client() -> None:
    """The generated client raises urllib3's errors (MaxRetryError on a refused connection), not OSError."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{port}"

    async def call() -> None:
        api = Api(client.ApiClient(cfg), threads=2)
        try:
            await api.call("read pod", api.core.read_namespaced_pod, "p", "ns", write=False)
        finally:
            api.close()

    with pytest.raises(errors.TemporaryError, match="read_namespaced_pod: MaxRetryError"):
        asyncio.run(call())


def test_network_trouble_is_temporary() -> None:
    def list_namespaced_pod(*_: object, **__: object) -> None:
        raise ConnectionRefusedError("connection refused")

    async def call() -> None:
        api = Api(client.ApiClient(), threads=2)
        try:
            await api.call("list pods", list_namespaced_pod, "ns", write=False)
        finally:
            api.close()

    with pytest.raises(errors.TemporaryError, match="list_namespaced_pod: ConnectionRefusedError"):
        asyncio.run(call())
