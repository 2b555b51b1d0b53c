"""A permission RBAC refuses (the status subresource, pods, events) is one ERROR that names it and the fix, not a
warning on every retry; the operator retries with backoff, and carries on once the Role is fixed. Through the real
`Reconciler`, `Api` and error classification; only the client functions are stand-ins that answer as the API
server does (its 403 message is k8s.io/apiserver's `forbiddenMessage`)."""

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

from kubetrain import k8s, metrics
from kubetrain.actions import Event
from kubetrain.api import Job
from kubetrain.errors import Denial
from kubetrain.k8s import Api
from reconciler_harness import logged, quiet_reconciler

SA = "system:serviceaccount:kubetrain:kt-kubetrain"
KEY = ("ml", "train")
BODY = {
    "metadata": {"name": "train", "namespace": "ml", "uid": "uid-now", "generation": 1,
                 "creationTimestamp": "2026-12-03T13:00:00Z", "resourceVersion": "7"},
    "spec": {"image": "reg/trainer:0.1.0", "nodes": 2, "trainer": {"builtin": {"task": "regression"}},
             "strategy": {"type": "ddp"}},
}


def forbidden(verb: str, resource: str, group: str = "", name: str = "x") -> ApiException:
    qualified = f"{resource.split('/')[0]}.{group}" if group else resource.split("/")[0]
    exc = ApiException(status=403, reason="Forbidden")
    exc.body = json.dumps({"kind": "Status", "code": 403, "reason": "Forbidden", "message":
                           f'{qualified} "{name}" is forbidden: User "{SA}" cannot {verb} resource "{resource}" in API '
                           f'group "{group}" in the namespace "ml"'})
    return exc


class _Response:
    def __init__(self, body: Any) -> None:
        self.data = json.dumps(body).encode()

    def release_conn(self) -> None:
        pass


class Cluster:
    """The client functions the reconciler calls; `denied` holds the calls RBAC refuses now."""

    def __init__(self, *denied: str, refusals: dict[str, Any] | None = None) -> None:
        self.denied, self.calls, self.statuses = set(denied), [], []
        self.refusals = {**FORBIDDEN, **(refusals or {})}  # what the API server says to each refused call

    def fn(self, what: str, answer: Any = None) -> Any:
        def call(*args: Any, **_: Any) -> _Response:
            self.calls.append(what)
            if what in self.denied:
                raise self.refusals[what]()
            return _Response(answer(args) if answer else {})
        call.__name__ = what.replace(" ", "_")
        return call

    def api(self) -> Api:
        api = Api(client.ApiClient(), threads=4)
        api.core = SimpleNamespace(
            create_namespaced_pod=self.fn("create pod", lambda a: a[-1]), read_namespaced_pod=self.fn("get pod"),
            delete_namespaced_pod=self.fn("delete pod"), create_namespaced_service=self.fn("create service"),
            read_namespaced_service=self.fn("get service"), create_namespaced_event=self.fn("create event"),
            create_namespaced_config_map=self.fn("create configmap"), patch_namespaced_config_map=self.fn("patch configmap"),
            read_namespaced_config_map=self.fn("get configmap", lambda a: {"metadata": {"ownerReferences": [
                {"controller": True, "uid": "uid-now", "kind": "TrainingJob"}]}}))
        api.custom = SimpleNamespace(patch_namespaced_custom_object_status=self.fn("patch status", self._patched))
        return api

    def _patched(self, args: tuple) -> dict:
        self.statuses.append(args[-1]["status"])
        return {**BODY, "metadata": {**BODY["metadata"], "resourceVersion": "8"}, **args[-1]}


FORBIDDEN = {
    "patch status": lambda: forbidden("patch", "trainingjobs/status", "kubetrain.io", "train"),
    "create pod": lambda: forbidden("create", "pods"),
    "delete pod": lambda: forbidden("delete", "pods", name="train-a1-n0"),
    "create event": lambda: forbidden("create", "events"),
}


def reconcile(cluster: Cluster, rounds: list[set[str]], body: dict = BODY, pods: list[dict] = ()) -> list[float]:
    """One reconcile per round of the same stored job, RBAC refusing that round's calls; the delays it asks for."""
    delays: list[float] = []

    async def main() -> None:
        api = cluster.api()
        rec = quiet_reconciler(api, delays)
        for pod in pods:
            rec.pod_event("ADDED", pod)
        try:
            for denied in rounds:
                cluster.denied = denied
                rec.jobs[KEY] = copy.deepcopy(body)  # the same job each time
                rec.expectations.clear()
                await rec.reconcile(KEY)
                await asyncio.sleep(0.05)  # the events go out in the background
        finally:
            api.close()

    asyncio.run(main())
    return delays


@pytest.mark.parametrize("message,denial", [
    (f'trainingjobs.kubetrain.io "train" is forbidden: User "{SA}" cannot patch resource "trainingjobs/status" in '
     'API group "kubetrain.io" in the namespace "ml"', Denial(SA, "patch", "trainingjobs/status", "kubetrain.io", "ml")),
    (f'pods is forbidden: User "{SA}" cannot create resource "pods" in API group "" in the namespace "ml": RBAC: '
     'role.rbac.authorization.k8s.io "kt-kubetrain-jobs" not found', Denial(SA, "create", "pods", "", "ml")),
    (f'nodes is forbidden: User "{SA}" cannot list resource "nodes" in API group "" at the cluster scope',
     Denial(SA, "list", "nodes", "", "")),
    ('pods "tj-a1-n0" is forbidden: exceeded quota: q, requested: pods=1, used: pods=4, limited: pods=4', None),
    ('pods "tj-a1-n0" is forbidden: violates PodSecurity "restricted:latest": hostPath volumes', None),
], ids=["status subresource", "core, with the authorizer's reason", "cluster scope", "quota", "PodSecurity"])
def test_rbacs_403_names_the_permission_and_no_other_403_does(message: str, denial: Denial | None) -> None:
    assert Denial.parse(message) == denial


def test_a_status_write_rbac_refuses_is_one_error_naming_it_and_the_fix_and_works_once_granted(caplog) -> None:
    """Before: a WARNING `reconcile of ml/train: patch status of ml/train: HTTP 403 Forbidden; retrying in 60s` for
    every job at every retry, forever, naming neither the permission nor what to do about it."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    status = {"patch status"}
    cluster = Cluster()
    forbidden_before = metrics.REGISTRY.get_sample_value("kubetrain_errors_total", {"kind": "forbidden"}) or 0.0
    delays = reconcile(cluster, [status] * 7 + [set()] + [status])
    assert metrics.REGISTRY.get_sample_value("kubetrain_errors_total", {"kind": "forbidden"}) == forbidden_before + 8
    errors = logged(caplog, logging.ERROR)
    assert len(errors) == 2, errors  # once, and again once it was lost again after working
    assert errors[0] == errors[1]
    assert "forbids the operator to patch trainingjobs/status in namespace ml" in errors[0]
    assert f"user {SA}" in errors[0] and "helm upgrade <release> <chart> -f <your values>" in errors[0]
    assert "(not --reuse-values" in errors[0]
    assert (f"kubectl auth can-i patch trainingjobs.kubetrain.io --subresource=status -n ml --as={SA}"
            in errors[0])
    assert logged(caplog, logging.WARNING) == []
    assert any("allowed again" in m for m in logged(caplog, logging.INFO))
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 2.0]  # backoff; the success reset it
    assert cluster.statuses and cluster.statuses[-1]["phase"], "the status was written once allowed"


def test_a_pod_create_rbac_refuses_is_one_error_and_the_job_shows_why_while_it_waits(caplog) -> None:
    """Before: a WARNING `job ml/train: pod create refused (Forbidden); retrying in 60s` at every retry of every
    job. The job's condition and event already said which request was refused (kept)."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    cluster = Cluster()
    delays = reconcile(cluster, [{"create pod"}] * 6)
    (error,) = logged(caplog, logging.ERROR)
    assert "forbids the operator to create pods in namespace ml (API group core" in error
    assert f"kubectl auth can-i create pods -n ml --as={SA}" in error
    assert logged(caplog, logging.WARNING) == []
    assert delays == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]  # REJECTED_BACKOFF
    created = next(c for c in cluster.statuses[-1]["conditions"] if c["type"] == "Created")
    assert created["status"] == "False" and created["reason"] == "Forbidden"
    assert "create event" in cluster.calls


def _pod(rank: int) -> dict:
    return {"metadata": {"name": f"train-a1-n{rank}", "namespace": "ml", "ownerReferences": [
                {"controller": True, "uid": "uid-now", "kind": "TrainingJob"}],
            "labels": {"kubetrain.io/job-name": "train", "kubetrain.io/attempt": "1", "kubetrain.io/node-rank": str(rank)}},
            "spec": {"nodeName": "n"}, "status": {"phase": "Running", "containerStatuses": [
                {"name": "trainer", "state": {"running": {}}}]}}


def test_a_pod_delete_rbac_refuses_is_one_error_and_is_tried_again_with_backoff(caplog) -> None:
    """Before: a WARNING `reconcile of ml/train: delete pod train-a1-n0: HTTP 403; retrying in 60s` at every retry,
    and the job said Suspended while its pods kept running, with nothing anywhere naming the missing permission."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    suspended = copy.deepcopy(BODY)
    suspended["spec"]["runPolicy"] = {"suspend": True}
    suspended["status"] = {"phase": "Running", "attempt": 1, "nodesTotal": 2, "startTime": "2026-12-03T13:00:00Z"}
    cluster = Cluster()
    delays = reconcile(cluster, [{"delete pod"}] * 5 + [set()], body=suspended, pods=[_pod(0), _pod(1)])
    (error,) = logged(caplog, logging.ERROR)
    assert "forbids the operator to delete pods in namespace ml" in error
    assert logged(caplog, logging.WARNING) == []
    assert delays[:5] == [2.0, 4.0, 8.0, 16.0, 32.0]
    assert cluster.calls.count("delete pod") == 12  # both pods, every round: once allowed, they go


def test_events_rbac_refuses_are_one_error_not_a_warning_per_event(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    cluster = Cluster("create event")

    async def main() -> None:
        api = cluster.api()
        try:
            job = Job.from_storage(copy.deepcopy(BODY))
            for reason in ("Created", "Running", "Preempted"):
                await k8s.post_event(api, job, Event("Normal", reason, "something happened"))
        finally:
            api.close()

    asyncio.run(main())
    (error,) = logged(caplog, logging.ERROR)
    assert "forbids the operator to create events in namespace ml" in error
    assert logged(caplog, logging.WARNING) == []


def _pod_security() -> ApiException:
    exc = ApiException(status=403, reason="Forbidden")
    exc.body = json.dumps({"kind": "Status", "code": 403, "message": 'pods "train-a1-n0" is forbidden: violates '
                           'PodSecurity "restricted:latest": hostPath volumes (volume "data")'})
    return exc


def test_a_job_that_cannot_run_whose_failed_status_rbac_refuses_backs_off_and_says_so_once(caplog) -> None:
    """Before: the Failed status that could not be written was tried again every 2 s, forever: each time the pods
    were created again (refused again), `job ml/train cannot run` was logged at ERROR and counted as a permanent
    error, with no backoff."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    cluster = Cluster(refusals={"create pod": _pod_security})
    both = {"create pod", "patch status"}
    delays = reconcile(cluster, [both] * 5 + [{"create pod"}])
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0]  # and none after the Failed status went out
    cannot_run = [m for m in logged(caplog, logging.ERROR) if "cannot run" in m]
    assert cannot_run == ['job ml/train cannot run: create pod train-a1-n0: pods "train-a1-n0" is forbidden: violates '
                          'PodSecurity "restricted:latest": hostPath volumes (volume "data")']
    assert cluster.statuses[-1]["phase"] == "Failed"


def _exists() -> ApiException:
    exc = ApiException(status=409, reason="Conflict")
    exc.body = json.dumps({"kind": "Status", "code": 409, "reason": "AlreadyExists",
                           "message": 'services "train" already exists'})
    return exc


def _unavailable() -> ApiException:
    return ApiException(status=503, reason="Service Unavailable")


@pytest.mark.parametrize("refusal", [FORBIDDEN["delete pod"], _unavailable], ids=["RBAC", "503"])
def test_a_job_that_cannot_run_is_reported_once_its_failed_status_is_written_even_if_its_pods_are_not_deleted(
        caplog, refusal) -> None:
    """A Service of the job's name that is not its own is met after the job's pods were created: the Failed plan
    writes the status, then deletes those pods. With the deletes refused (RBAC without `delete pods`, a 503), the
    ERROR `job ml/train cannot run` and kubetrain_errors_total{kind="permanent"} never came: 0457188 emitted them
    only after the whole plan, and the next reconcile sees a Failed job, which only cleans up."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    cluster = Cluster(refusals={"create service": _exists, "delete pod": refusal})
    permanent_before = metrics.REGISTRY.get_sample_value("kubetrain_errors_total", {"kind": "permanent"}) or 0.0
    delays = reconcile(cluster, [{"create service", "delete pod"}])
    assert cluster.statuses[-1]["phase"] == "Failed"
    assert cluster.calls.count("delete pod") == 2, cluster.calls  # tried: a Failed job's next reconcile tries again
    cannot_run = [m for m in logged(caplog, logging.ERROR) if "cannot run" in m]
    assert cannot_run == ["job ml/train cannot run: service ml/train already exists and does not belong to this "
                          "TrainingJob: delete it, or give the TrainingJob another name"]
    assert metrics.REGISTRY.get_sample_value("kubetrain_errors_total", {"kind": "permanent"}) == permanent_before + 1
    assert delays == [2.0]  # the deletes are tried again with backoff
    assert "create event" in cluster.calls  # the Failed event goes out with the status it belongs to


def test_a_deepspeed_configmap_update_rbac_refuses_is_one_error_and_backs_off(caplog) -> None:
    """The job's own DeepSpeed ConfigMap exists (an operator restart, a retry): its data is brought up to date with
    a patch. RBAC refusing that patch went out raw, as the reconciler's catch-all: `reconcile of ml/train: HTTP 403
    Forbidden; retrying` at WARNING every 5 s, forever, with no backoff, on top of the ledger's ERROR."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    zero3 = copy.deepcopy(BODY)
    zero3["spec"]["strategy"] = {"type": "zero3", "deepspeed": {"config": {"zero_optimization": {"stage": 3}}}}
    cluster = Cluster(refusals={"create configmap": _exists,
                                "patch configmap": lambda: forbidden("patch", "configmaps", name="train-deepspeed")})
    delays = reconcile(cluster, [{"create configmap", "patch configmap"}] * 4, body=zero3)
    (error,) = logged(caplog, logging.ERROR)
    assert "forbids the operator to patch configmaps in namespace ml" in error
    assert logged(caplog, logging.WARNING) == []
    assert delays == [2.0, 4.0, 8.0, 16.0]
    assert cluster.calls.count("patch configmap") == 4 and "create pod" not in cluster.calls  # the pods mount it
