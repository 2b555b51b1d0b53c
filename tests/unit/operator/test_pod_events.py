"""What the reconciler remembers of a pod that is gone (`Reconciler.pod_event`): the reason the cluster
took it away, for the Preempted event, or that it had succeeded, so that its rank counts as done
(`supervise`): a gang still finishing is not restarted because PodGC or a user removed a finished pod."""

from __future__ import annotations

import asyncio

from kubetrain.observe import GONE_SUCCEEDED
from kubetrain.reconciler import Reconciler
from kubetrain.config import Settings
from kubetrain_factories import pod_body


def _owned(body: dict, uid: str) -> dict:
    body["metadata"]["ownerReferences"] = [{"kind": "TrainingJob", "name": "tj", "uid": uid, "controller": True}]
    return body


def _gone_after(*events: tuple[str, dict]) -> dict[str, str]:
    async def main() -> dict[str, str]:
        rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type] - no API call on this path
        key = ("", "tj")
        rec.jobs[key] = {"metadata": {"name": "tj", "uid": "uid-new"}}
        try:
            for kind, body in events:
                rec.pod_event(kind, body)
            return dict(rec.gone.get(key, {}))
        finally:
            rec.forget(key)

    return asyncio.run(main())


def test_a_deleted_pod_is_remembered_as_succeeded_or_by_its_disruption_and_otherwise_forgotten():
    gone = _gone_after(
        ("DELETED", _owned(pod_body(rank=0, phase="Succeeded", exit_code=0), "uid-new")),
        ("DELETED", _owned(pod_body(rank=1, phase="Running", disruption="PreemptionByScheduler"), "uid-new")),
        ("DELETED", _owned(pod_body(rank=2, phase="Running"), "uid-new")),  # deleted by someone: supervise's default
        # A pod that succeeded on a node being drained afterwards is still a success.
        ("DELETED", _owned(pod_body(rank=3, phase="Succeeded", exit_code=0, disruption="EvictionByEvictionAPI"),
                           "uid-new")))
    assert gone == {"tj-a1-n0": GONE_SUCCEEDED, "tj-a1-n1": "PreemptionByScheduler", "tj-a1-n3": GONE_SUCCEEDED}


def test_a_pod_of_a_deleted_job_of_the_same_name_leaves_nothing_for_the_new_job():
    # The old job's succeeded pod is garbage-collected after the new job exists: its name (tj-a1-n0) comes
    # back with the new job's first attempt, whose pod must not count as done when it is lost.
    assert _gone_after(("DELETED", _owned(pod_body(rank=0, phase="Succeeded", exit_code=0), "uid-old"))) == {}
    assert _gone_after(("DELETED", pod_body(rank=0, phase="Succeeded", exit_code=0))) == {}  # no owner at all
    # A name recorded, then gone again for no recorded reason (the new pod of that name deleted while it ran).
    assert _gone_after(("DELETED", _owned(pod_body(rank=0, phase="Succeeded", exit_code=0), "uid-new")),
                       ("DELETED", _owned(pod_body(rank=0, phase="Running"), "uid-new"))) == {}


def test_expectations_of_a_deleted_job_are_not_a_same_name_successor_s():
    """A reconcile of the old job still in flight when it is deleted and re-created under the same name:
    its pod creates were remembered after the DELETED event's forget(). The new job must not see those pods
    as created (no pod would be made for it, then a 'deleted by someone else' restart would follow)."""
    import datetime as dt

    from kubetrain.actions import CreatePod, Plan
    from kubetrain.api import Job

    async def main() -> tuple[int, int]:
        rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type] - no API call on this path
        key, now = ("default", "tj"), dt.datetime(2026, 12, 5, tzinfo=dt.timezone.utc)
        rec._remember(key, "uid-old", Plan(actions=(CreatePod(attempt=1, rank=0), CreatePod(attempt=1, rank=1))), now)

        def view(uid: str) -> int:
            body = {"metadata": {"name": "tj", "namespace": "default", "uid": uid, "generation": 1},
                    "spec": {"image": "img:1", "nodes": 2, "trainer": {"builtin": {"task": "regression"}}}}
            return len(rec.observe(Job.from_storage(body, default_image="img:1"), now).pods)

        return view("uid-new"), view("uid-old")

    assert asyncio.run(main()) == (0, 0)  # the new job's; and the old job's, dropped when the new one looked
