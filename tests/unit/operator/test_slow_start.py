"""A pod still creating its container past runPolicy.startupGraceSeconds: the job says which pod and where to look."""

from __future__ import annotations

from kubetrain.plan import plan
from kubetrain_factories import at, iso, job, observed, pod, started


def creating(rank: int):
    return pod(rank=rank, phase="Pending", waiting="ContainerCreating", waiting_message="", scheduled=iso(0))


def test_a_pod_creating_its_container_past_the_grace_is_named_once_and_the_job_keeps_waiting() -> None:
    """A Secret volume that cannot mount shows only in the pod's FailedMount events: the job said "waiting for
    them to run" forever. Not a failure (a large image can take that long to pull)."""
    tj = job(status=started(phase="Pending"), run_policy={"startupGraceSeconds": 300})
    early = plan(tj, observed(creating(0), pod(rank=1)), at(100))
    assert early.status is None or "creating its container" not in early.status.message
    assert early.requeue_after is not None and early.requeue_after <= 200
    late = plan(tj, observed(creating(0), pod(rank=1)), at(301))
    st = late.status
    assert st is not None and st.phase == "Pending" and st.failures == 0
    assert "pod tj-a1-n0 has been creating its container on node kwok-0 for more than 300s" in st.message
    assert "kubectl describe pod tj-a1-n0" in st.message
    assert [e.reason for e in late.events] == ["SlowStart"]
    again = plan(type(tj)(**{**tj.__dict__, "status": st}), observed(creating(0), pod(rank=1)), at(400))
    assert again.status is None and again.events == (), "said once"


def test_pods_creating_within_the_grace_say_nothing() -> None:
    tj = job(status=started(phase="Pending"))
    result = plan(tj, observed(creating(0), creating(1)), at(60))
    assert result.events == () and (result.status is None or "creating its container" not in result.status.message)
