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


def test_a_succeeded_pod_deleted_while_the_watch_was_down_still_counts_as_done() -> None:
    """After a 410 the informer lists again; a pod gone meanwhile comes as a DELETED event with only its name,
    labels and uid (no owner, no status). The rank's last known state decides: a succeeded rank is done, and the
    gang finishing is not restarted as 'deleted by someone else'."""
    import datetime as dt

    from kubetrain.api import Job
    from kubetrain.informer import PodInformer
    from kubetrain.plan import plan
    from kubetrain_factories import T0

    body = {"metadata": {"name": "tj", "namespace": "ns", "uid": "uid-1", "generation": 1, "resourceVersion": "5"},
            "spec": {"image": "img:1", "nodes": 2, "trainer": {"builtin": {"task": "regression"}}},
            "status": {"phase": "Running", "attempt": 1, "nodesTotal": 2, "nodesReady": 2,
                       "startTime": "2026-01-01T12:00:00Z", "observedGeneration": 1}}

    def pod(rank: int, phase: str, rv: int) -> dict:
        b = pod_body(rank=rank, phase=phase, exit_code=0 if phase == "Succeeded" else None)
        b["metadata"].update(namespace="ns", uid=f"pod-{rank}", resourceVersion=str(rv))
        return _owned(b, "uid-1")

    async def main(relist: bool) -> tuple[str, int, dict]:
        rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type] - no API call on this path
        key = ("ns", "tj")
        rec.jobs[key] = body
        informer = PodInformer(None, namespaces=("ns",), label_selector="", on_event=rec.pod_event)  # type: ignore[arg-type]
        informer._replace("ns", [pod(0, "Running", 1), pod(1, "Running", 2)])
        informer._deliver("MODIFIED", "ns", pod(0, "Succeeded", 3))
        if relist:  # rank 0's pod deleted (PodGC) while the watch was down, rank 1 done meanwhile
            informer._replace("ns", [pod(1, "Succeeded", 5)])
        else:
            informer._deliver("DELETED", "ns", pod(0, "Succeeded", 4))
            informer._deliver("MODIFIED", "ns", pod(1, "Succeeded", 5))
        now = T0 + dt.timedelta(seconds=300)
        job = Job.from_storage(body)
        try:
            result = plan(job, rec.observe(job, now), now)
            return result.status.phase, result.status.preemptions, dict(rec.gone.get(key, {}))
        finally:
            rec.forget(key)

    for relist in (False, True):
        assert asyncio.run(main(relist)) == ("Succeeded", 0, {"tj-a1-n0": GONE_SUCCEEDED}), relist


def test_text_a_pod_writes_never_stops_its_view_from_being_read() -> None:
    """A termination message is the pod's own log tail (FallbackToLogsOnError) and its annotations are its to
    write: a text nested past the JSON parser's depth, or a generation of non-ASCII digits, must still leave a
    view of the pod (else the informer drops the event, and a failed pod would stay Running in the index)."""
    from kubetrain.observe import PodView

    view = PodView.from_storage(pod_body(phase="Failed", exit_code=1, message="[" * 2000))
    assert view is not None and view.phase == "Failed" and view.exit_code == 1
    assert view.checkpoint is None and view.failure is None
    view = PodView.from_storage(pod_body(annotations={"kubetrain.io/spec-generation": "\u00b2"}))
    assert view is not None and view.generation is None
