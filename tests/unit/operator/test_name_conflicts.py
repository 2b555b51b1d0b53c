"""A Service or DeepSpeed ConfigMap of the job's name that already exists: the operator carries on only with
its own, waits while an earlier TrainingJob of the same name (deleted and applied again) still owns it, and
refuses someone else's, naming it, without touching it. The calls run through the real `Api` and its
error classification; only the client functions are stand-ins (they answer as the API server would)."""

from __future__ import annotations

import asyncio
import copy
import logging
import json
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain import k8s
from kubetrain.actions import CreatePod, CreateService
from kubetrain.api import Job
from kubetrain.errors import PermanentError, RejectedError, TemporaryError
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


OURS = {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "name": "train", "uid": "uid-now"}
EARLIER = {**OURS, "uid": "uid-before"}
SOMEONE = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "redis", "uid": "uid-other"}
ANOTHER_GROUP = {"apiVersion": "sagemaker.example.com/v1", "kind": "TrainingJob", "name": "train", "uid": "uid-x"}


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
    with pytest.raises(RejectedError, match="earlier TrainingJob train") as err:
        _run(_service(EARLIER, []))
    assert err.value.reason == "NameInUse"  # shown on the job while it waits (reconciler: rejected_plan)


@pytest.mark.parametrize("owner", [SOMEONE, None, ANOTHER_GROUP],
                         ids=["owned by a Deployment", "no owner", "a TrainingJob of another API group"])
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


def _pod(owner: dict | None, calls: list[str]):
    async def go(api: Api) -> None:
        api.core = SimpleNamespace(create_namespaced_pod=_refuse(409, 'pods "train-a1-n0" already exists'),
                                   read_namespaced_pod=_existing(owner, calls, "train-a1-n0"))
        await k8s._do(api, Job.from_storage(copy.deepcopy(BODY)), CreatePod(attempt=1, rank=0))
    return go


def test_a_pod_of_the_same_name_left_by_an_earlier_job_is_waited_for() -> None:
    """Deleted and applied again at once: the earlier job's pods terminate for up to their grace period. Counted as
    this job's, they would vanish and read as a preemption; the create waits for them to be gone instead."""
    calls: list[str] = []
    _run(_pod(OURS, calls))  # our own (the informer had not delivered it yet): fine
    assert calls == ["get train-a1-n0"]
    with pytest.raises(RejectedError, match="earlier TrainingJob train"):
        _run(_pod(EARLIER, []))
    with pytest.raises(PermanentError, match="pod ml/train-a1-n0 already exists and does not belong"):
        _run(_pod(SOMEONE, []))


def test_a_read_that_finds_nothing_means_it_was_just_deleted_and_is_tried_again() -> None:
    async def go(api: Api) -> None:
        api.core = SimpleNamespace(create_namespaced_service=_refuse(409, 'services "train" already exists'),
                                   read_namespaced_service=_refuse(404, 'services "train" not found'))
        await k8s._do(api, Job.from_storage(copy.deepcopy(BODY)), CreateService())

    with pytest.raises(TemporaryError, match="was being deleted"):
        _run(go)


def test_a_name_conflict_found_after_the_pods_were_created_fails_the_job_and_deletes_them(caplog) -> None:
    """The Service goes out after the pods (they are what a big launch waits for): when it turns out to be someone
    else's, the job fails as NameConflict, and the pods it had just created are deleted, not left holding GPUs."""
    from kubetrain.config import Settings
    from kubetrain.reconciler import Reconciler

    caplog.set_level(logging.INFO, logger="kubetrain.operator")
    calls: list[str] = []
    body = copy.deepcopy(BODY)
    body["spec"]["strategy"] = {"type": "ddp"}

    def record(what: str, answer: Any = None):
        def call(*args: Any, **__: Any) -> _Response:
            calls.append(f"{what} {args[0] if what.startswith('delete') else ''}".strip())
            return _Response(answer if answer is not None else {})
        return call

    async def main() -> None:
        api = Api(client.ApiClient(), threads=4)
        api.core = SimpleNamespace(
            create_namespaced_pod=record("create pod"), read_namespaced_pod=_refuse(500, "never asked"),
            create_namespaced_service=_refuse(409, 'services "train" already exists'),
            read_namespaced_service=_existing(SOMEONE, calls, "train"),
            delete_namespaced_pod=record("delete"),
            create_namespaced_event=record("event"))
        api.custom = SimpleNamespace(patch_namespaced_custom_object_status=record("status", {
            **body, "metadata": {**body["metadata"], "resourceVersion": "8"}}))
        rec = Reconciler(api=api, settings=Settings())
        rec.pods_synced.set()
        rec.jobs[("ml", "train")] = body
        try:
            await rec.reconcile(("ml", "train"))
            await asyncio.sleep(0.2)  # the events go out in the background
        finally:
            api.close()

    asyncio.run(main())
    assert calls.count("create pod") == 2
    assert "status" in calls
    assert sorted(c for c in calls if c.startswith("delete")) == ["delete train-a1-n0", "delete train-a1-n1"]
    # The operator's log tells what was written, the Failed plan, not the launch it replaced.
    said = [r.getMessage() for r in caplog.records if r.name == "kubetrain.operator"]
    assert any("ml/train Failed: " in m for m in said), said
    assert not any(" Created: " in m for m in said), said
