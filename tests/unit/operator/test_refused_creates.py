"""A pod create refused for a reason that can pass (a full ResourceQuota, a missing ServiceAccount): what the
operator's log says while the job waits, and when. Through the real `Reconciler`, `Api` and error classification;
only the client functions are stand-ins (`test_admission_refusals.Server`) that answer as the API server does."""

from __future__ import annotations

import asyncio
import copy
import json
import logging

from kubernetes.client.rest import ApiException

from test_admission_refusals import Server, no_service_account, run
from test_rbac_denials import BODY, KEY
from reconciler_harness import logged, quiet_reconciler


def over_quota(used: int = 4) -> ApiException:
    # plugin/pkg/admission/resourcequota: "exceeded quota: %s, requested: %s, used: %s, limited: %s"
    exc = ApiException(status=403, reason="Forbidden")
    exc.body = json.dumps({"kind": "Status", "code": 403, "reason": "Forbidden", "message":
                           f'pods "train-a1-n0" is forbidden: exceeded quota: q, requested: pods=1, used: pods={used}, '
                           "limited: pods=4"})
    return exc


def test_a_job_waiting_for_quota_warns_once_then_quietly_and_says_once_when_its_pods_are_created(caplog) -> None:
    """Before: `job ml/train: pod create refused (QuotaExceeded); retrying in 60s` at WARNING at every retry, about
    one a minute per waiting job for as long as the quota stays full."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    used = iter(range(4, 100))
    cluster = Server(refusals={"create pod": lambda: over_quota(next(used))})  # other counts each time: the same
    run(cluster, [{"create pod"}] * 6 + [set()])
    refused = [m for m in logged(caplog, logging.WARNING) if "pod create refused" in m]
    assert refused == ["job ml/train: pod create refused (QuotaExceeded); retrying in 5s"]
    assert len([m for m in logged(caplog, logging.DEBUG) if "pod create refused (QuotaExceeded)" in m]) == 5
    assert "job ml/train: pod creates go through again (after 6 failures in a row)" in logged(caplog, logging.INFO)
    warnings = [e["reason"] for e in cluster.events if e["type"] == "Warning"]
    assert warnings == ["QuotaExceeded"]  # the job's event and condition as before: once
    assert next(c for c in cluster.statuses[0]["conditions"] if c["type"] == "Created")["reason"] == "QuotaExceeded"


def test_another_reason_for_the_refusal_warns_again(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    answers = [over_quota()] * 4 + [no_service_account()] * 4  # two pods a round
    run(Server(refusals={"create pod": lambda: answers.pop(0)}), [{"create pod"}] * 4)
    assert [m for m in logged(caplog, logging.WARNING) if "pod create refused" in m] == [
        "job ml/train: pod create refused (QuotaExceeded); retrying in 5s",
        "job ml/train: pod create refused (ServiceAccountMissing); retrying in 20s"]


def test_the_refused_creates_events_are_logged_once_their_status_is_written_as_any_transitions(caplog) -> None:
    """Before: the waiting plan's status and events went out without the operator's INFO line per event that every
    other transition gets once its status is written (`Reconciler._said`): a resumed job whose pods the quota
    refused posted Resumed and QuotaExceeded on the job, and the operator's log said neither."""
    caplog.set_level(logging.INFO, logger="kubetrain")
    resumed = copy.deepcopy(BODY)
    resumed["status"] = {"phase": "Suspended", "attempt": 1, "nodesTotal": 2, "startTime": "2026-12-03T13:00:00Z",
                         "observedGeneration": 1}
    cluster = Server(resumed, refusals={"create pod": over_quota})
    run(cluster, [{"create pod"}] * 3)
    assert [e["reason"] for e in cluster.events] == ["Resumed", "QuotaExceeded"]
    said = [m.split(":")[0] for m in logged(caplog, logging.INFO) if m.startswith("ml/train ")]
    assert said == ["ml/train Resumed", "ml/train QuotaExceeded"]  # once each, as the events
    assert cluster.statuses[0]["phase"] == "Restarting" and len(cluster.statuses) == 1


def test_a_job_suspended_while_it_waited_for_quota_resumes_with_the_shortest_wait_and_warns_again(caplog) -> None:
    """Before: the refused creates in a row outlived the suspend: the resumed job's first refusal waited 60 s (the
    longest step) and was logged at DEBUG as a repeat of a refusal from before the suspend, maybe days old."""
    caplog.set_level(logging.DEBUG, logger="kubetrain")
    cluster = Server(refusals={"create pod": over_quota})
    delays: list[float] = []

    async def main() -> None:
        api = cluster.api()
        rec = quiet_reconciler(api, delays)
        rec.jobs[KEY] = copy.deepcopy(cluster.body)
        try:
            for suspend in (None,) * 5 + (True, False):
                if suspend is not None:  # the user edits spec.runPolicy.suspend
                    meta = cluster.body["metadata"]
                    meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
                    cluster.body["spec"]["runPolicy"] = {"suspend": suspend}
                    rec.jobs[KEY] = copy.deepcopy(cluster.body)
                cluster.denied = {"create pod"}
                rec.expectations.clear()
                await rec.reconcile(KEY)
                await asyncio.sleep(0.05)
        finally:
            api.close()

    asyncio.run(main())
    assert [s["phase"] for s in cluster.statuses] == ["Pending", "Suspended", "Pending"]
    assert delays == [5.0, 10.0, 20.0, 40.0, 60.0, 5.0]  # the suspend asks for none
    assert [m for m in logged(caplog, logging.WARNING) if "pod create refused" in m] == [
        "job ml/train: pod create refused (QuotaExceeded); retrying in 5s"] * 2
