"""A pod still creating its container past runPolicy.startupGraceSeconds (at least 120 s): condition StartupSlow
names the pod and where to look, once; it gives way to StartupDelayed and Unschedulable."""

from __future__ import annotations

from dataclasses import replace

from kubetrain.plan import plan
from kubetrain_factories import at, iso, job, observed, pod, started


def creating(rank: int):
    return pod(rank=rank, phase="Pending", waiting="ContainerCreating", waiting_message="", scheduled=iso(0))


def slow(status):
    cond = status.condition("StartupSlow") if status is not None else None
    return (cond.status, cond.reason) if cond is not None else None


def test_a_pod_creating_its_container_past_the_grace_is_named_once_and_the_job_keeps_waiting() -> None:
    """A Secret volume that cannot mount shows only in the pod's FailedMount events: the job said "waiting for
    them to run" forever. Not a failure (a large image can take that long to pull)."""
    tj = job(status=started(phase="Pending"), run_policy={"startupGraceSeconds": 300})
    early = plan(tj, observed(creating(0), pod(rank=1)), at(100))
    assert slow(early.status) is None and early.events == ()
    assert early.requeue_after is not None and early.requeue_after <= 200
    late = plan(tj, observed(creating(0), pod(rank=1)), at(301))
    st = late.status
    assert st is not None and st.phase == "Pending" and st.failures == 0 and slow(st) == ("True", "ContainerCreating")
    assert "pod tj-a1-n0 has been creating its container on node kwok-0 for more than 300s" in st.message
    assert "kubectl describe pod tj-a1-n0" in st.condition("StartupSlow").message
    assert [e.reason for e in late.events] == ["StartupSlow"]
    stored = replace(tj, status=st)
    again = plan(stored, observed(creating(0), pod(rank=1)), at(400))
    assert again.status is None and again.events == (), "said once"
    # Something else rewrites the message: the condition stays, no second event.
    moved = replace(tj, status=replace(st, message="attempt 1: something else"))
    assert plan(moved, observed(creating(0), pod(rank=1)), at(410)).events == ()
    started_now = plan(stored, observed(pod(rank=0), pod(rank=1)), at(420)).status
    assert slow(started_now) == ("False", "ContainersCreated") and started_now.phase == "Running"


def test_pods_creating_within_the_grace_or_a_grace_of_0_under_the_floor_say_nothing() -> None:
    tj = job(status=started(phase="Pending"))
    result = plan(tj, observed(creating(0), creating(1)), at(60))
    assert result.events == () and slow(result.status) is None
    zero = job(status=started(phase="Pending"), run_policy={"startupGraceSeconds": 0})
    assert plan(zero, observed(creating(0), creating(1)), at(5)).events == (), "at least 120 s"
    assert [e.reason for e in plan(zero, observed(creating(0), creating(1)), at(121)).events] == ["StartupSlow"]


def test_startup_delayed_says_more_and_keeps_the_message() -> None:
    """Before: a pod ContainerCreating beside one in ImagePullBackOff overwrote the StartupDelayed message and
    sent its event again at every ErrImagePull <-> ImagePullBackOff flip."""
    tj = job(status=started(phase="Pending"), run_policy={"startupGraceSeconds": 600})
    pulling = pod(rank=1, phase="Pending", waiting="ErrImagePull", waiting_message="not found", scheduled=iso(0))
    first = plan(tj, observed(creating(0), pulling), at(310))
    assert "ErrImagePull" in first.status.message and slow(first.status) is None
    assert [e.reason for e in first.events] == ["StartupDelayed"]
    flipped = replace(pulling, waiting_reason="ImagePullBackOff")
    second = plan(replace(tj, status=first.status), observed(creating(0), flipped), at(320))
    assert "StartupSlow" not in [e.reason for e in second.events] and slow(second.status) is None


def test_once_the_start_problem_is_gone_the_message_says_the_pods_wait_to_run() -> None:
    """The message said ImagePullBackOff (or named the slow pod) until the whole gang ran, next to
    StartupDelayed=False / StartupSlow=False (a reviewer's fixpoint walk)."""
    tj = job(status=started(phase="Pending"))
    backoff = pod(rank=0, phase="Pending", waiting="ImagePullBackOff", waiting_message="Back-off", scheduled=iso(0))
    first = plan(tj, observed(backoff, creating(1)), at(10)).status
    assert first.message.endswith("(retrying)")
    cleared = plan(replace(tj, status=first), observed(creating(0), creating(1)), at(20)).status
    assert cleared.message == "attempt 1: 2 pod(s) created, waiting for them to run"
    slow_status = plan(tj, observed(creating(0), creating(1)), at(400)).status
    assert "creating its container" in slow_status.message
    done = plan(replace(tj, status=slow_status), observed(pod(rank=0), pod(rank=1, phase="Pending")), at(410)).status
    assert done.message == "attempt 1: 2 pod(s) created, waiting for them to run"
