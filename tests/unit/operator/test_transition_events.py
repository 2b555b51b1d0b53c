"""The events of a status transition (Suspended, Preempted and Restarting, Failed) are posted once its status is
written, even when the pod deletes after it fail; never for a status write that failed, and never twice. Through the
real `Reconciler`, `Api` and error classification; only the client functions are stand-ins that answer as the API
server does (a status patch guarded by an older resourceVersion is a 409)."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from types import SimpleNamespace
from typing import Any, Callable

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain import k8s, metrics
from kubetrain.k8s import Api
from kubetrain_factories import pod_body
from test_rbac_denials import forbidden
from reconciler_harness import quiet_reconciler

KEY = ("ml", "train")
UID = "uid-now"
BODY = {
    "metadata": {"name": "train", "namespace": "ml", "uid": UID, "generation": 1,
                 "creationTimestamp": "2026-12-03T13:00:00Z", "resourceVersion": "7"},
    "spec": {"image": "reg/trainer:0.1.0", "nodes": 2, "trainer": {"builtin": {"task": "regression"}},
             "strategy": {"type": "ddp"}},
    "status": {"phase": "Running", "attempt": 1, "nodesTotal": 2, "startTime": "2026-12-03T13:00:00Z",
               "observedGeneration": 1},
}


class _Response:
    def __init__(self, body: Any) -> None:
        self.data = json.dumps(body).encode()

    def release_conn(self) -> None:
        pass


def _error(status: int, reason: str) -> ApiException:
    exc = ApiException(status=status, reason=reason)
    exc.body = json.dumps({"kind": "Status", "code": status, "reason": reason, "message": reason})
    return exc


class Server:
    """The stored job, the status patches and pod deletes it refuses now (`refused`), the events posted."""

    def __init__(self, body: dict, refusal: Callable[[], ApiException]) -> None:
        self.body, self.refusal = copy.deepcopy(body), refusal  # what a refused delete meets
        self.refused: set[str] = set()
        self.events: list[str] = []
        self.phases: list[str] = []  # the status writes that went through

    def api(self) -> Api:
        api = Api(client.ApiClient(), threads=4)
        api.core = SimpleNamespace(delete_namespaced_pod=self._delete, create_namespaced_event=self._event)
        api.custom = SimpleNamespace(patch_namespaced_custom_object_status=self._patch,
                                     get_namespaced_custom_object=lambda *_, **__: _Response(self.body))
        return api

    def _delete(self, *_: Any, **__: Any) -> _Response:
        if "delete pod" in self.refused:
            raise self.refusal()
        return _Response({})

    def _event(self, namespace: str, body: dict, **_: Any) -> _Response:
        self.events.append(body["reason"])
        return _Response(body)

    def _patch(self, *args: Any, **_: Any) -> _Response:
        patch = args[-1]
        if "patch status" in self.refused:
            raise _error(503, "Service Unavailable")
        if patch["metadata"]["resourceVersion"] != self.body["metadata"]["resourceVersion"]:
            raise _error(409, "Conflict")
        self.body["status"] = {k: v for k, v in patch["status"].items() if v is not None}
        self.body["metadata"]["resourceVersion"] = str(int(self.body["metadata"]["resourceVersion"]) + 1)
        self.phases.append(self.body["status"]["phase"])
        return _Response(self.body)


def reconcile(server: Server, rounds: list[set[str]], held: dict, pods: list[dict]) -> list[float]:
    """One reconcile per round, the server refusing that round's calls, starting from the reconciler holding `held`
    (no watch: what is written comes back through the reconciler's own writes and a conflict's re-read). Returns
    the delays it asked for."""
    delays: list[float] = []

    async def main() -> None:
        api = server.api()
        rec = quiet_reconciler(api, delays)
        for pod in pods:
            pod["metadata"].update(namespace="ml", ownerReferences=[
                {"controller": True, "uid": UID, "kind": "TrainingJob", "name": "train"}])
            rec.pod_event("ADDED", pod)
        rec.jobs[KEY] = copy.deepcopy(held)
        try:
            for refused in rounds:
                server.refused = refused
                rec.expectations.clear()
                await rec.reconcile(KEY)
                await asyncio.sleep(0.05)
            await asyncio.sleep(2 * k8s.QUIET_SECONDS)  # the events go out in the background, once pod writes pause
        finally:
            api.close()

    asyncio.run(main())
    return delays


def _unavailable() -> ApiException:
    return _error(503, "Service Unavailable")


def _suspended() -> tuple[dict, list[dict]]:
    body = copy.deepcopy(BODY)
    body["spec"]["runPolicy"] = {"suspend": True}
    return body, [pod_body(name="train", rank=0), pod_body(name="train", rank=1)]


def _preempted() -> tuple[dict, list[dict]]:
    return BODY, [pod_body(name="train", rank=0, disruption="PreemptionByScheduler"), pod_body(name="train", rank=1)]


def _failed() -> tuple[dict, list[dict]]:
    body = copy.deepcopy(BODY)
    body["spec"]["runPolicy"] = {"backoffLimit": 0}
    return body, [pod_body(name="train", rank=0, phase="Failed", exit_code=1), pod_body(name="train", rank=1)]


def _deadline() -> tuple[dict, list[dict]]:
    body = copy.deepcopy(BODY)
    body["spec"]["runPolicy"] = {"activeDeadlineSeconds": 60}  # started 2026-12-03T13:00:00Z: long past
    return body, [pod_body(name="train", rank=0), pod_body(name="train", rank=1)]


DELETES = "delete pod"
RBAC = lambda: forbidden("delete", "pods", name="train-a1-n0")  # noqa: E731


@pytest.mark.parametrize("refusal", [RBAC, _unavailable], ids=["RBAC", "503"])
@pytest.mark.parametrize("job,events,phase", [
    (_suspended, ["Suspended"], "Suspended"),
    (_preempted, ["Preempted", "Restarting"], "Restarting"),
    (_failed, ["Failed"], "Failed"),
    (_deadline, ["Failed"], "Failed"),  # one Warning: a DeadlineExceeded one before it said the same again
], ids=["suspended", "preempted", "failed", "deadline"])
def test_a_transition_s_events_are_posted_once_its_status_is_written_even_when_its_deletes_fail(
        job, events, phase, refusal) -> None:
    """Before: `k8s.apply` posted a plan's events after all of its actions. With the pod deletes after the status
    refused (RBAC without `delete pods`, a 503), the status was written and the events never posted: the next
    reconcile plans from the written status, which has no events left, and `kubectl describe trainingjob` never
    showed e.g. the Preempted Warning. The job was written by someone else since the reconciler read it. Round 1:
    the status write is refused (no events); 2: it conflicts (no events), the plan made again from the fresh job
    is written (its events), its deletes refused; 3: the deletes refused again; 4: they go through."""
    body, pods = job()
    server = Server(body, refusal)
    server.body["metadata"]["resourceVersion"] = "8"  # e.g. a label changed: the reconciler holds "7"
    delays = reconcile(server, [{"patch status", DELETES}, {DELETES}, {DELETES}, set()], body, pods)
    assert server.phases[0] == phase
    assert server.events == events  # once each: none for the status write refused, none for the one that conflicted
    assert delays[:3] == [2.0, 4.0, 8.0], delays  # the status, then the deletes tried again with backoff



def test_a_preemption_whose_deletes_fail_is_counted_and_logged_once(caplog) -> None:
    """Before: kubetrain_job_preemptions_total and the operator's INFO line for each event were done after the whole
    plan: with the gang's deletes refused (a 503), the Restarting status was written and the preemption was never
    counted nor logged (the next reconcile plans from Restarting: nothing left to count)."""
    caplog.set_level(logging.INFO, logger="kubetrain")
    labels = {"reason": "PreemptionByScheduler"}
    before = metrics.REGISTRY.get_sample_value("kubetrain_job_preemptions_total", labels) or 0.0
    body, pods = _preempted()
    server = Server(body, _unavailable)
    reconcile(server, [{DELETES}, {DELETES}, set()], body, pods)
    assert server.phases[0] == "Restarting"
    assert metrics.REGISTRY.get_sample_value("kubetrain_job_preemptions_total", labels) == before + 1
    said = [r.getMessage().split(":")[0] for r in caplog.records if r.getMessage().startswith("ml/train ")]
    assert said == ["ml/train Preempted", "ml/train Restarting"]
