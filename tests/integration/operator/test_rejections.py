"""Pod creates the API server refuses are visible on the job: a full ResourceQuota makes the job
wait (and it starts once the quota admits it); a refusal that judges the pod itself fails it."""

from __future__ import annotations

import pytest

from kubetrain_optest import spec
from kubetrain_testbed import wait_until

pytestmark = pytest.mark.integration


def _quota(jobs, name: str, pods: int) -> None:
    body = {"metadata": {"name": name}, "spec": {"hard": {"pods": str(pods)}}}
    try:
        jobs.core.replace_namespaced_resource_quota(name, jobs.namespace, body)
    except Exception:  # noqa: BLE001 - not there yet (404): create it; a real error shows in the create
        jobs.core.create_namespaced_resource_quota(jobs.namespace, body)
    wait_until(lambda: jobs.core.read_namespaced_resource_quota(name, jobs.namespace).status,
               lambda st: st is not None and (st.hard or {}).get("pods") == str(pods) and "pods" in (st.used or {}),
               timeout=120, what="the pod quota computed by the quota controller")


def test_a_full_quota_shows_as_pending_with_the_reason_then_the_gang_starts(operator, jobs, pod_timeline) -> None:
    used = len(jobs.core.list_namespaced_pod(jobs.namespace).items)
    _quota(jobs, "tight", used + 1)  # one pod of the gang of two fits
    jobs.create("waits", spec(nodes=2))
    status = jobs.wait("waits", lambda st: (next((c for c in st.get("conditions", []) if c["type"] == "Created"), {})
                                             .get("reason") == "QuotaExceeded"), timeout=120)
    assert status["phase"] == "Pending" and "waiting for quota" in status["message"]
    created = next(c for c in status["conditions"] if c["type"] == "Created")
    assert created["status"] == "False" and "exceeded quota: tight" in created["message"]
    warnings = wait_until(lambda: jobs.event_messages("waits", "QuotaExceeded"), timeout=60,
                          what="a QuotaExceeded Warning event")
    assert "exceeded quota: tight" in warnings[0]
    assert len(jobs.pods("waits")) == 1, "the pod the quota admits exists; nothing else"

    _quota(jobs, "tight", used + 10)
    status = jobs.wait_phase("waits", "Running", timeout=180)
    assert status["attempt"] == 1 and status["restarts"] == 0 and status["preemptions"] == 0
    created = next(c for c in status["conditions"] if c["type"] == "Created")
    assert (created["status"], created["reason"]) == ("True", "PodsCreated")
    added = pod_timeline.wait_added(2, "waits-")
    assert sorted(added) == ["waits-a1-n0", "waits-a1-n1"], "each pod created once"


def test_a_refusal_of_the_pod_itself_fails_the_job_with_the_api_message(operator, jobs) -> None:
    jobs.core.create_namespaced_limit_range(jobs.namespace, {
        "metadata": {"name": "small"},
        "spec": {"limits": [{"type": "Container", "max": {"cpu": "200m"}}]}})
    jobs.create("toobig", spec(nodes=2, resources={"requests": {"cpu": "500m"}, "limits": {"cpu": "500m"}}))
    status = jobs.wait_phase("toobig", "Failed", timeout=120)
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PodRejected", failed
    assert "maximum cpu usage per Container is 200m" in status["message"], status["message"]
    events = wait_until(lambda: jobs.event_messages("toobig", "Failed"), timeout=60, what="the Failed event")
    assert "maximum cpu usage per Container is 200m" in events[0]
    wait_until(lambda: jobs.pods("toobig"), lambda p: p == [], timeout=120, what="no pod of the failed job left")
