"""The reconciler's expectations: a pod we just created is not 'missing' before its watch
event arrives, and a pod we just deleted is not re-deleted or counted as running."""

from __future__ import annotations

import datetime as dt

from kubetrain.observe import EXPECTATION_TTL, Expectations
from kubetrain.actions import CreatePod, DeletePod
from kubetrain.observe import Observed, PodView
from kubetrain.plan import plan
from kubetrain_factories import at, gang, job, pod, started


def test_created_pod_counts_until_the_watch_shows_it() -> None:
    exp = Expectations()
    exp.created["tj-a1-n1"] = (at(0), PodView(name="tj-a1-n1", attempt=1, rank=1))
    pods = exp.overlay([pod(rank=0, phase="Pending")], at(1))
    assert sorted(p.name for p in pods) == ["tj-a1-n0", "tj-a1-n1"]
    # Without the overlay the planner would call the missing pod a preemption.
    tj = job(status=started(phase="Pending"))
    assert plan(tj, Observed(pods=tuple(pods)), at(1)).status is None
    assert plan(tj, Observed(pods=(pod(rank=0, phase="Pending"),)), at(1)).status.phase == "Restarting"
    # Once seen, the real pod replaces the placeholder.
    pods = exp.overlay([pod(rank=0), pod(rank=1)], at(2))
    assert [p.phase for p in pods] == ["Running", "Running"] and not exp.created


def test_expectations_expire() -> None:
    exp = Expectations()
    exp.created["tj-a1-n1"] = (at(0), PodView(name="tj-a1-n1", attempt=1, rank=1))
    assert exp.overlay([], at(0) + EXPECTATION_TTL + dt.timedelta(seconds=1)) == []


def test_deleted_pod_is_seen_as_terminating_until_gone() -> None:
    exp = Expectations()
    exp.deleted["tj-a1-n0"] = at(0)
    pods = exp.overlay(list(gang()), at(1))
    assert [p.terminating for p in pods] == [True, False]
    tj = job(status=started(phase="Restarting", nextAttemptTime="2026-01-01T12:00:00Z"))
    result = plan(tj, Observed(pods=tuple(pods)), at(1))
    assert [a.name for a in result.actions if isinstance(a, DeletePod)] == ["tj-a1-n1"]
    assert not any(isinstance(a, CreatePod) for a in result.actions)
    exp.overlay([], at(2))
    assert not exp.deleted
