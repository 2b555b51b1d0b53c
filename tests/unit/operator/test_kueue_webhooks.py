"""An admission webhook on Kueue's Workloads that the API server cannot call (Kueue's own, while its controller is
down; a policy engine's with failurePolicy Fail: HTTP 500 "failed calling webhook") is shown on the job while the
operator waits with backoff, as it is for a pod create (test_admission_webhooks.py). Through the real `Reconciler`
and `Api`; only the client functions are stand-ins (they answer as the API server does)."""

from __future__ import annotations

import asyncio
import copy
import json
from types import SimpleNamespace
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain.k8s import Api
from reconciler_harness import quiet_reconciler

KEY = ("ml", "train")
QUEUED_BODY = {
    "metadata": {"name": "train", "namespace": "ml", "uid": "uid-now", "generation": 1,
                 "creationTimestamp": "2026-12-03T13:00:00Z", "resourceVersion": "7",
                 "labels": {"kueue.x-k8s.io/queue-name": "team"}},
    "spec": {"image": "reg/trainer:0.1.0", "nodes": 2, "trainer": {"builtin": {"task": "regression"}},
             "strategy": {"type": "ddp"}},
}
UNREACHABLE = ('Internal error occurred: failed calling webhook "vworkload.kb.io": failed to call webhook: Post '
               '"https://kueue-webhook-service.kueue-system.svc:443/validate-kueue-x-k8s-io-v1beta2-workload?'
               'timeout=10s": dial tcp 10.96.12.7:443: connect: connection refused')


def _error(status: int, message: str) -> ApiException:
    exc = ApiException(status=status, reason="Refused")
    exc.body = json.dumps({"kind": "Status", "code": status, "message": message})
    return exc


class _Response:
    def __init__(self, body: Any) -> None:
        self.data = json.dumps(body).encode()

    def release_conn(self) -> None:
        pass


def reconcile(body: dict[str, Any], times: int, *, workload_write: ApiException,
              workload: dict[str, Any] | None = None) -> dict[str, list]:
    """`times` reconciles of one job whose Workload is `workload` (None: it does not exist yet), each write of it
    answered `workload_write`: what was written (statuses, events, Workload writes) and the requeue delays."""
    seen: dict[str, list] = {"statuses": [], "events": [], "workload writes": [], "delays": []}
    stored = copy.deepcopy(body)

    def read_workload(*args: Any, **__: Any) -> _Response:
        if workload is not None:
            return _Response(workload)
        raise _error(404, f'workloads.kueue.x-k8s.io "{args[-1]}" not found')

    def write_workload(*args: Any, **__: Any) -> _Response:
        seen["workload writes"].append(args[-1])
        raise workload_write

    def patch_job_status(*args: Any, **__: Any) -> _Response:
        nonlocal stored
        if args[-1]["metadata"]["resourceVersion"] != stored["metadata"]["resourceVersion"]:
            raise _error(409, "the object has been modified; please apply your changes to the latest version")
        seen["statuses"].append(args[-1]["status"])
        rv = str(int(stored["metadata"]["resourceVersion"]) + 1)
        stored = {**stored, "metadata": {**stored["metadata"], "resourceVersion": rv},
                  "status": {**(stored.get("status") or {}), **args[-1]["status"]}}
        return _Response(stored)

    def post_event(namespace: str, event: dict, **__: Any) -> _Response:
        seen["events"].append(event)
        return _Response(event)

    def refuse_pod(*_: Any, **__: Any) -> _Response:
        raise AssertionError("no pod is created before Kueue admits the job")

    async def main() -> None:
        api = Api(client.ApiClient(), threads=4)
        api.core = SimpleNamespace(create_namespaced_event=post_event, create_namespaced_pod=refuse_pod)
        api.custom = SimpleNamespace(get_namespaced_custom_object=read_workload,
                                     create_namespaced_custom_object=write_workload,
                                     patch_namespaced_custom_object=write_workload,
                                     patch_namespaced_custom_object_status=patch_job_status)
        rec = quiet_reconciler(api, seen["delays"])
        try:
            for _ in range(times):
                rec.jobs[KEY] = copy.deepcopy(stored)
                await rec.reconcile(KEY)
                await asyncio.sleep(0.05)  # the events go out in the background
        finally:
            api.close()

    asyncio.run(main())
    return seen


def test_a_workload_create_the_webhook_cannot_judge_shows_on_the_job_while_it_waits_with_backoff() -> None:
    """Before: an HTTP 500 like any other, retried with backoff up to every 60 s for as long as Kueue's webhook was
    down, with nothing on the job (no phase, no condition, no event): `kubectl get tj` showed an empty row and
    `kubectl describe` said nothing; only the operator's log knew."""
    seen = reconcile(QUEUED_BODY, 3, workload_write=_error(500, UNREACHABLE))
    assert len(seen["workload writes"]) == 3  # tried again each time
    assert seen["statuses"], "nothing was written on the job"
    status = seen["statuses"][-1]
    queued = next(c for c in status["conditions"] if c["type"] == "Queued")
    assert (queued["status"], queued["reason"]) == ("True", "AdmissionWebhookUnavailable")
    assert 'failed calling webhook "vworkload.kb.io"' in queued["message"]
    assert status["phase"] == "Queued" and "AdmissionWebhookUnavailable" in status["message"]
    (event,) = seen["events"]  # one, not one per retry
    assert (event["type"], event["reason"]) == ("Warning", "AdmissionWebhookUnavailable")
    assert "create" in event["message"] and "failed calling webhook" in event["message"]
    assert len(seen["statuses"]) == 1  # the same refusal again writes nothing
    assert seen["delays"] == [5.0, 10.0, 20.0]  # REJECTED_BACKOFF, as for a pod create


def test_a_workload_patch_the_webhook_cannot_judge_is_one_warning_event_on_the_job() -> None:
    """The queue label removed from a waiting job: its Workload is deactivated first. Before: refused by a webhook
    that is down, retried quietly for as long as it lasted, nothing on the job."""
    body = copy.deepcopy(QUEUED_BODY)
    body["metadata"]["labels"] = {}
    body["status"] = {"phase": "Queued", "conditions": [
        {"type": "Queued", "status": "True", "reason": "ExceedsMaxQuota", "message": "insufficient quota",
         "lastTransitionTime": "2026-12-03T13:00:01Z"}]}
    seen = reconcile(body, 3, workload_write=_error(500, UNREACHABLE))
    assert len(seen["workload writes"]) == 3
    (event,) = seen["events"]
    assert (event["type"], event["reason"]) == ("Warning", "AdmissionWebhookUnavailable")
    assert "update" in event["message"] and "failed calling webhook" in event["message"]
    # The refused patch comes first: nothing of the plan went out (the phase is not moved, the label's removal
    # not recorded, so the next try plans the deactivation again).
    assert all(s["phase"] == "Queued" and s["conditions"][0]["reason"] == "ExceedsMaxQuota" for s in seen["statuses"])
    assert seen["delays"] == [5.0, 10.0, 20.0]


def test_a_suspend_whose_workload_update_the_webhook_cannot_judge_says_so_once() -> None:
    """The job's status (Suspended) is written first, then the Workload's deactivation is refused: the Warning event
    must not hang on a second status write from the job as it was read (a conflict: the event was lost)."""
    body = copy.deepcopy(QUEUED_BODY)
    body["metadata"]["generation"] = 2
    body["spec"]["runPolicy"] = {"suspend": True}
    body["status"] = {"phase": "Queued", "observedGeneration": 1, "conditions": [
        {"type": "Queued", "status": "True", "reason": "Pending", "message": "waiting", "observedGeneration": 1,
         "lastTransitionTime": "2026-12-03T13:00:01Z"}]}
    workload = {"metadata": {"name": "trainingjob-train-x", "namespace": "ml", "resourceVersion": "3",
                             "finalizers": ["kueue.x-k8s.io/resource-in-use"]},
                "spec": {"active": True, "podSets": []},
                "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                           "message": "waiting", "lastTransitionTime": "2026-12-03T13:00:01Z"}]}}
    seen = reconcile(body, 3, workload_write=_error(500, UNREACHABLE), workload=workload)
    assert [s["phase"] for s in seen["statuses"]] == ["Suspended"]
    assert [(e["type"], e["reason"]) for e in seen["events"]].count(("Warning", "AdmissionWebhookUnavailable")) == 1


def test_any_other_http_500_on_a_workload_create_is_retried_quietly() -> None:
    seen = reconcile(QUEUED_BODY, 1, workload_write=_error(500, "etcdserver: request timed out"))
    assert seen["statuses"] == [] and seen["events"] == [] and seen["delays"] == [2.0]


DENIED = ('admission webhook "vworkload.kb.io" denied the request: spec.podSets[0].template.spec.containers[0]'
          '.resources.requests[nvidia.com/gpu]: Invalid value: "0.5": must be an integer')


def test_a_workload_create_a_webhook_denies_fails_the_job_with_its_message() -> None:
    """Before: the 403 was retried as if RBAC might let it through later, up to every 60 s forever, and the job
    showed nothing: no phase, no condition, no event. The same Workload is refused again, as a pod a webhook
    denies is (test_admission_webhooks.py)."""
    seen = reconcile(QUEUED_BODY, 1, workload_write=_error(403, DENIED))
    status = seen["statuses"][-1]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert status["phase"] == "Failed" and failed["reason"] == "WorkloadRejected"
    assert 'admission webhook "vworkload.kb.io" denied the request' in status["message"]


def test_a_workload_create_rbac_refuses_still_waits_for_the_role_to_be_fixed() -> None:
    rbac = ('workloads.kueue.x-k8s.io is forbidden: User "system:serviceaccount:kubetrain:kt" cannot create '
            'resource "workloads" in API group "kueue.x-k8s.io" in the namespace "ml"')
    seen = reconcile(QUEUED_BODY, 1, workload_write=_error(403, rbac))
    assert not any(s.get("phase") == "Failed" for s in seen["statuses"]) and seen["delays"] == [2.0]
