"""A Service or DeepSpeed ConfigMap of the job's name that already exists: the operator carries on only with
its own, waits while an earlier TrainingJob of the same name (deleted and applied again) still owns it, and
refuses someone else's, naming it, without touching it. The calls run through the real `Api` and its
error classification; only the client functions are stand-ins (they answer as the API server would)."""

from __future__ import annotations

import asyncio
import copy
import json
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain import k8s
from kubetrain.actions import CreateService
from kubetrain.api import Job
from kubetrain.errors import PermanentError, TemporaryError
from kubetrain.k8s import Api

BODY = {
    "metadata": {"name": "train", "namespace": "ml", "uid": "uid-now", "generation": 1,
                 "creationTimestamp": "2026-12-03T13:00:00Z", "resourceVersion": "7"},
    "spec": {"image": "reg/trainer:0.1.0", "nodes": 2, "trainer": {"builtin": {"task": "regression"}},
             "strategy": {"type": "zero3", "deepspeed": {"config": {"zero_optimization": {"stage": 3}}}}},
}


class _Response:
    def __init__(self, body: Any) -> None:
        self.data = json.dumps(body).encode()

    def release_conn(self) -> None:
        pass


def _refuse(status: int, message: str):
    def call(*_: Any, **__: Any) -> None:
        exc = ApiException(status=status, reason="Refused")
        exc.body = json.dumps({"kind": "Status", "message": message})
        raise exc
    return call


def _existing(owner: dict | None, calls: list[str], name: str):
    def read(*_: Any, **__: Any) -> _Response:
        calls.append(f"get {name}")
        meta: dict[str, Any] = {"name": name, "namespace": "ml"}
        if owner is not None:
            meta["ownerReferences"] = [{"controller": True, **owner}]
        return _Response({"metadata": meta})
    return read


def _run(coro_fn) -> None:
    async def main() -> None:
        api = Api(client.ApiClient(), threads=2)
        try:
            await coro_fn(api)
        finally:
            api.close()
    asyncio.run(main())


OURS = {"kind": "TrainingJob", "name": "train", "uid": "uid-now"}
EARLIER = {"kind": "TrainingJob", "name": "train", "uid": "uid-before"}
SOMEONE = {"kind": "Deployment", "name": "redis", "uid": "uid-other"}


def _service(owner: dict | None, calls: list[str]):
    async def go(api: Api) -> None:
        api.core = SimpleNamespace(create_namespaced_service=_refuse(409, 'services "train" already exists'),
                                   read_namespaced_service=_existing(owner, calls, "train"))
        await k8s._do(api, Job.from_storage(copy.deepcopy(BODY)), CreateService())
    return go


def test_the_job_s_own_service_is_fine() -> None:
    calls: list[str] = []
    _run(_service(OURS, calls))
    assert calls == ["get train"]


def test_a_service_of_an_earlier_job_of_the_same_name_is_waited_for_not_adopted() -> None:
    with pytest.raises(TemporaryError, match="earlier TrainingJob train"):
        _run(_service(EARLIER, []))


@pytest.mark.parametrize("owner", [SOMEONE, None], ids=["owned by a Deployment", "no owner"])
def test_someone_else_s_service_fails_the_job_naming_it(owner: dict | None) -> None:
    with pytest.raises(PermanentError) as err:
        _run(_service(owner, []))
    assert err.value.reason == "NameConflict"
    assert "service ml/train already exists and does not belong to this TrainingJob" in str(err.value)


def _configmap(owner: dict | None, calls: list[str], create=None):
    async def go(api: Api) -> None:
        def patch(*_: Any, **__: Any) -> _Response:
            calls.append("patch train-deepspeed")
            return _Response({})
        api.core = SimpleNamespace(
            create_namespaced_config_map=create or _refuse(409, 'configmaps "train-deepspeed" already exists'),
            read_namespaced_config_map=_existing(owner, calls, "train-deepspeed"),
            patch_namespaced_config_map=patch)
        await k8s._ensure_configmap(api, Job.from_storage(copy.deepcopy(BODY)))
    return go


def test_the_job_s_own_configmap_is_brought_up_to_date() -> None:
    calls: list[str] = []
    _run(_configmap(OURS, calls))
    assert calls == ["get train-deepspeed", "patch train-deepspeed"]


def test_a_user_s_configmap_of_that_name_is_left_as_it_is() -> None:
    calls: list[str] = []
    with pytest.raises(PermanentError) as err:
        _run(_configmap(SOMEONE, calls))
    assert err.value.reason == "NameConflict" and "configmap ml/train-deepspeed" in str(err.value)
    assert calls == ["get train-deepspeed"]  # never patched


def test_a_configmap_of_an_earlier_job_is_waited_for_before_the_pods_mount_it() -> None:
    calls: list[str] = []
    with pytest.raises(TemporaryError):
        _run(_configmap(EARLIER, calls))
    assert "patch train-deepspeed" not in calls


def test_an_inline_config_the_api_server_refuses_fails_the_job_instead_of_retrying() -> None:
    refuse = _refuse(422, 'ConfigMap "train-deepspeed" is invalid: []: Too long: must have at most 1048576 bytes')
    with pytest.raises(PermanentError) as err:
        _run(_configmap(OURS, [], create=refuse))
    assert err.value.reason == "InvalidDeepSpeedConfig" and "at most 1048576 bytes" in str(err.value)
