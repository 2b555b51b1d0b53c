"""A node's view from its conditions: when a not-Ready node counts from, so that it is lost after its grace."""

from __future__ import annotations

import asyncio

from kubetrain import handlers
from kubetrain.observe import NodeView, node_view
from kubetrain.plan import plan
from kubetrain_factories import at, gang, iso, job, observed, pod, started

NOT_READY = {"type": "Ready", "status": "False", "reason": "KubeletNotReady"}


def test_a_ready_node_is_ready_and_forgets_when_it_was_seen_not_ready() -> None:
    seen = {"n0": at(0)}
    assert node_view("n0", [{"type": "Ready", "status": "True"}], seen, at(5)) == NodeView("n0")
    assert seen == {}


def test_a_not_ready_node_counts_from_its_condition_time() -> None:
    seen: dict = {}
    view = node_view("n0", [{**NOT_READY, "lastTransitionTime": iso(3)}], seen, at(10))
    assert view == NodeView("n0", ready=False, since=at(3))


def test_without_a_usable_time_it_counts_from_when_first_seen_not_ready() -> None:
    """A writer that leaves lastTransitionTime out (or writes garbage), or a node with no Ready condition yet:
    before, `since` was None and the planner counted the grace from "now" on every pass, so the node was never
    lost and its gang waited forever."""
    for conditions in ([NOT_READY], [{**NOT_READY, "lastTransitionTime": "yesterday"}], [], None,
                       [{"type": "Ready", "status": "Unknown"}]):
        seen: dict = {}
        first = node_view("n0", conditions, seen, at(2))
        later = node_view("n0", conditions, seen, at(40))
        assert first == later == NodeView("n0", ready=False, since=at(2)), conditions


def test_the_planner_preempts_the_gang_after_the_grace_counted_from_first_seen() -> None:
    seen: dict = {}
    node_view("kwok-0", [NOT_READY], seen, at(0))  # first seen
    spec = job(status=started(), run_policy={"nodeLostGraceSeconds": 30})
    within = plan(spec, observed(*gang(), nodes={"kwok-0": node_view("kwok-0", [NOT_READY], seen, at(10))}), at(10))
    assert (within.status is None or within.status.phase == "Running") and within.requeue_after == 20
    beyond = plan(spec, observed(*gang(), nodes={"kwok-0": node_view("kwok-0", [NOT_READY], seen, at(31))}), at(31))
    assert beyond.status is not None and beyond.status.phase == "Restarting" and beyond.status.preemptions == 1


def test_the_node_index_keeps_the_first_seen_time_until_the_node_is_deleted() -> None:
    handlers._NOT_READY_SEEN.clear()
    status = {"conditions": [NOT_READY]}
    first = asyncio.run(handlers.nodes_by_name(name="n9", status=status))["n9"]
    again = asyncio.run(handlers.nodes_by_name(name="n9", status=status))["n9"]
    assert not first.ready and first.since is not None and again.since == first.since

    class Rec:
        def node_event(self, *args):
            pass
    asyncio.run(handlers.node_event(type="DELETED", name="n9", status={}, memo=type("M", (), {"reconciler": Rec()})()))
    assert "n9" not in handlers._NOT_READY_SEEN


def test_times_at_the_end_of_the_calendar_are_unknown_not_an_overflow() -> None:
    """The API server takes 9999-12-31T23:59:59Z in a pod's or node's conditions: the grace added to it overflowed
    and the job's every reconcile crashed (and every job on that node's)."""
    far = "9999-12-31T23:59:59Z"
    view = node_view("n0", [{"type": "Ready", "status": "Unknown", "lastTransitionTime": far}], {}, at(3))
    assert view.since == at(3)
    for obs in (observed(pod(rank=0, phase="Pending", waiting="ErrImagePull", scheduled=far), pod(rank=1)),
                observed(pod(rank=0, phase="Pending", waiting="ContainerCreating", scheduled=far), pod(rank=1)),
                observed(pod(rank=0, phase="Unknown", ready=False, ready_since=far), pod(rank=1)),
                observed(pod(rank=0, node="n0"), pod(rank=1), nodes={"n0": view})):
        plan(job(status=started(phase="Running", nodesReady=2)), obs, at(10))
