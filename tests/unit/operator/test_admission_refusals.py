"""Pod creates refused by an admission plugin after RBAC let the call through: a ServiceAccount the pods name that
does not exist (the ServiceAccount admission) waits, saying on the job which one and what to do, once; the garbage
collector's admission refusing owner references with blockOwnerDeletion (the operator's Role lacks `update` on
`trainingjobs/finalizers`) is the operator's missing permission, not a job that cannot run. Through the real
`Reconciler`, `Api` and error classification; only the client functions are stand-ins (`test_rbac_denials.Cluster`)
that answer as the API server does."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from typing import Any

from kubernetes.client.rest import ApiException

from test_rbac_denials import BODY, KEY, Cluster, forbidden
from reconciler_harness import logged, quiet_reconciler


def _refused(message: str) -> ApiException:
    exc = ApiException(status=403, reason="Forbidden")
    exc.body = json.dumps({"kind": "Status", "code": 403, "reason": "Forbidden", "message": message})
    return exc


def no_service_account(name: str = "trainer") -> ApiException:
    # plugin/pkg/admission/serviceaccount: "error looking up service account %s/%s: %w"
    return _refused(f'pods "train-a1-n0" is forbidden: error looking up service account ml/{name}: serviceaccount '
                    f'"{name}" not found')


class Server(Cluster):
    """`Cluster`, whose status patches answer with the stored job as the API server does, and which keeps the
    events the operator posted."""

    def __init__(self, body: dict = BODY, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.body, self.events = copy.deepcopy(body), []

    def fn(self, what: str, answer: Any = None) -> Any:
        if what == "create event":
            return super().fn(what, lambda a: self.events.append(a[-1]) or a[-1])
        return super().fn(what, answer)

    def _patched(self, args: tuple) -> dict:
        self.statuses.append(args[-1]["status"])
        meta = self.body["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        self.body["status"] = args[-1]["status"]
        return copy.deepcopy(self.body)


def run(cluster: Server, rounds: list[set[str]]) -> list[float]:
    """One reconcile per round, the API server refusing that round's calls; the job as the operator stored it last
    (its own status writes included), as between two real reconciles. The delays it asks for."""
    delays: list[float] = []

    async def main() -> None:
        api = cluster.api()
        rec = quiet_reconciler(api, delays)
        rec.jobs[KEY] = copy.deepcopy(cluster.body)
        try:
            for refused in rounds:
                cluster.denied = refused
                rec.expectations.clear()  # the refused creates never show up
                await rec.reconcile(KEY)
                await asyncio.sleep(0.05)  # the events go out in the background
        finally:
            api.close()

    asyncio.run(main())
    return delays


def test_a_missing_service_account_waits_naming_it_and_the_fix_once_and_the_job_starts_once_it_exists(caplog) -> None:
    """Before: condition Created=False/ServiceAccountMissing carried only the API server's words (`pods "train-a1-n0"
    is forbidden: error looking up service account ml/trainer: ...`): which field named it, and what to do, said
    nowhere."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    with_sa = copy.deepcopy(BODY)
    with_sa["spec"]["podTemplate"] = {"serviceAccountName": "trainer"}
    cluster = Server(with_sa, refusals={"create pod": no_service_account})
    delays = run(cluster, [{"create pod"}] * 4 + [set()])
    posted = cluster.events
    assert delays == [5.0, 10.0, 20.0, 40.0]  # REJECTED_BACKOFF while it is missing; none once the pods are created
    waiting = cluster.statuses[0]
    created = next(c for c in waiting["conditions"] if c["type"] == "Created")
    assert created["status"] == "False" and created["reason"] == "ServiceAccountMissing"
    assert created["message"].startswith(
        "ServiceAccount trainer not found in namespace ml: create it (kubectl create serviceaccount trainer -n ml) "
        "or set spec.podTemplate.serviceAccountName")
    assert "error looking up service account ml/trainer" in created["message"]  # the API server's words, after it
    assert len(created["message"]) < 400  # whole: a condition's message is cut there
    assert waiting["phase"] == "Pending" and "waiting for the ServiceAccount" in waiting["message"]
    assert len(cluster.statuses) == 2, "the same refusal again writes no status"
    warnings = [e for e in posted if e["type"] == "Warning"]
    assert [e["reason"] for e in warnings] == ["ServiceAccountMissing"], "one event, not one per retry"
    assert "kubectl create serviceaccount trainer -n ml" in warnings[0]["message"]
    assert cluster.calls.count("create pod") == 10  # both pods tried in every round
    assert cluster.statuses[-1]["phase"] == "Pending"
    assert next(c for c in cluster.statuses[-1]["conditions"] if c["type"] == "Created")["status"] == "True"
    assert logged(caplog, logging.ERROR) == []  # not the operator's RBAC: nothing for the permissions ledger


def test_a_missing_default_service_account_points_at_the_controller_that_makes_it() -> None:
    cluster = Server(refusals={"create pod": lambda: no_service_account("default")})
    run(cluster, [{"create pod"}])
    created = next(c for c in cluster.statuses[0]["conditions"] if c["type"] == "Created")
    assert created["reason"] == "ServiceAccountMissing"
    assert created["message"].startswith("ServiceAccount default not found in namespace ml: the namespace's own, "
                                         "made by kube-controller-manager")


def no_owner_finalizers(name: str = "train-a1-n0", kind: str = "pods") -> ApiException:
    # plugin/pkg/admission/gc: "cannot set blockOwnerDeletion if ...: %v, %v" (the authorizer's reason, its error)
    return _refused(f'{kind} "{name}" is forbidden: cannot set blockOwnerDeletion if an ownerReference refers to a '
                    "resource you can't set finalizers on: , <nil>")


def test_owner_references_refused_for_a_role_without_finalizers_wait_as_missing_rbac_not_fail_the_job(caplog) -> None:
    """Before: Failed/PodRejected at once (`job ml/train cannot run: ... cannot set blockOwnerDeletion ...`), for a
    Role of the operator's left from an older chart, which a `helm upgrade` fixes; nothing named the permission."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    cluster = Server(refusals={"create pod": no_owner_finalizers})
    delays = run(cluster, [{"create pod"}] * 4 + [set()])
    assert delays == [5.0, 10.0, 20.0, 40.0]  # REJECTED_BACKOFF, as RBAC refusing the create itself
    assert all(s["phase"] != "Failed" for s in cluster.statuses)
    created = next(c for c in cluster.statuses[0]["conditions"] if c["type"] == "Created")
    assert created["status"] == "False" and created["reason"] == "Forbidden"
    assert created["message"].startswith("the operator may not update trainingjobs/finalizers")
    (error,) = logged(caplog, logging.ERROR)
    assert "RBAC forbids the operator to update trainingjobs/finalizers in namespace ml" in error
    assert "OwnerReferencesPermissionEnforcement" in error and "helm upgrade <release> <chart>" in error
    assert "kubectl auth can-i update trainingjobs.kubetrain.io --subresource=finalizers -n ml --as=" in error
    assert logged(caplog, logging.WARNING) == []
    assert any("allowed again" in m for m in logged(caplog, logging.INFO))
    assert next(c for c in cluster.statuses[-1]["conditions"] if c["type"] == "Created")["status"] == "True"


def test_the_finalizers_refusal_after_the_create_itself_was_granted_is_reported_too(caplog) -> None:
    """Both missing: RBAC refuses the create first; once `create pods` is granted, the owner's finalizers are refused
    by the same call. The ledger kept one entry per call, so the second permission went to DEBUG, never named."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    answers = [forbidden("create", "pods")] * 4 + [no_owner_finalizers()] * 4  # two rounds of two pods each
    cluster = Server(refusals={"create pod": lambda: answers.pop(0)})
    run(cluster, [{"create pod"}] * 4)
    errors = logged(caplog, logging.ERROR)
    assert len(errors) == 2, errors
    assert "forbids the operator to create pods in namespace ml" in errors[0]
    assert "forbids the operator to update trainingjobs/finalizers in namespace ml" in errors[1]


def test_a_deepspeed_configmap_refused_for_its_owners_finalizers_is_one_error_and_backs_off(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    zero3 = copy.deepcopy(BODY)
    zero3["spec"]["strategy"] = {"type": "zero3", "deepspeed": {"config": {"zero_optimization": {"stage": 3}}}}
    cluster = Server(zero3, refusals={"create configmap": lambda: no_owner_finalizers("train-deepspeed", "configmaps")})
    delays = run(cluster, [{"create configmap"}] * 3)
    (error,) = logged(caplog, logging.ERROR)
    assert "forbids the operator to update trainingjobs/finalizers in namespace ml" in error
    assert logged(caplog, logging.WARNING) == []
    assert delays == [2.0, 4.0, 8.0]
    assert "create pod" not in cluster.calls
