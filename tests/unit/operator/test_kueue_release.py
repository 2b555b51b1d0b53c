"""A deleted job's Workload is held by Kueue's `resource-in-use` finalizer until the operator lets it go
(`Reconciler._release`); a release that keeps failing for a while (Kueue's webhook down while its controller
restarts: HTTP 500 "failed calling webhook" on every update of a Workload) must not leave it Terminating forever."""

from __future__ import annotations

import asyncio

from kubetrain import k8s, kueue
from kubetrain.config import Settings
from kubetrain.errors import TemporaryError, WorkloadRejectedError
from kubetrain.reconciler import Reconciler


def test_a_release_refused_for_a_while_is_tried_until_it_goes_through(monkeypatch):
    """Before: six tries within 15 s, then a WARNING 'could not release Workload' and never again: with no job
    of that name left nothing woke it up, and the Workload stayed Terminating with its finalizer."""
    tries: list[str] = []

    async def patch_workload(api, namespace, action) -> None:
        tries.append(action.name)
        if len(tries) <= 8:  # Kueue's webhook is down for the first eight tries (about two minutes)
            raise WorkloadRejectedError("AdmissionWebhookUnavailable", "patch workload wl: failed calling webhook",
                                        create=False)
        if len(tries) == 9:
            raise TemporaryError("patch workload wl: HTTP 503")

    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        sleeps.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(k8s, "patch_workload", patch_workload)
    monkeypatch.setattr(asyncio, "sleep", sleep)

    async def main() -> None:
        rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type] - patch_workload is replaced
        rec.pods_synced.set()
        await asyncio.wait_for(rec._release(("ns", "tj"), "uid-1", "wl"), 5)

    asyncio.run(main())
    assert len(tries) == 10  # released at last
    assert max(sleeps) <= 60.0 and sleeps[:4] == [0.5, 1.0, 2.0, 4.0]  # backs off, at most a minute apart


LABEL_REMOVED = {"type": "Queued", "status": "False", "reason": "QueueLabelRemoved", "message": "...",
                 "lastTransitionTime": "2026-12-03T13:00:00Z"}


def _recording_releases(monkeypatch) -> list[str]:
    """The names of the Workloads let go (k8s.patch_workload replaced), in order."""
    released: list[str] = []

    async def patch_workload(api, namespace, action) -> None:
        released.append(action.name)

    monkeypatch.setattr(k8s, "patch_workload", patch_workload)
    return released


def _deleted_job(labels: dict, conditions: list) -> dict:
    return {"metadata": {"namespace": "ns", "name": "tj", "uid": "uid-1", "labels": labels},
            "status": {"conditions": conditions}}


def test_the_workload_of_a_job_whose_queue_label_was_removed_is_released_when_the_job_is_deleted(monkeypatch):
    """Before: only a job still labelled kueue.x-k8s.io/queue-name had its Workload let go on deletion. One whose
    label was removed keeps its Workload (deactivated, our finalizer on it): deleted with the job, it stayed
    Terminating whenever its Workload event came before the job's DELETED (the job still known: only woken up)."""
    released = _recording_releases(monkeypatch)
    label_removed = LABEL_REMOVED

    async def main() -> None:
        rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type] - patch_workload is replaced
        rec.pods_synced.set()
        rec.job_event("DELETED", ("ns", "tj"), _deleted_job({}, [label_removed]))
        rec.job_event("DELETED", ("ns", "plain"), {**_deleted_job({}, []), "metadata": {
            "namespace": "ns", "name": "plain", "uid": "uid-2"}})  # never queued: no Workload to let go
        for _ in range(10):
            await asyncio.sleep(0)

    asyncio.run(main())
    assert released == [kueue.workload_name("tj", "uid-1")]


def test_a_workload_owned_by_another_groups_training_job_is_not_ours_to_release(monkeypatch):
    """Before: any owner of kind TrainingJob counted, whatever its API group: the Terminating Workload of another
    operator's TrainingJob (a Kueue external framework) lost Kueue's finalizer to kubetrain."""
    released: list[str] = []

    async def patch_workload(api, namespace, action) -> None:
        released.append(action.name)

    monkeypatch.setattr(k8s, "patch_workload", patch_workload)

    def workload(api_version: str, name: str) -> dict:
        return {"metadata": {"namespace": "ns", "name": name, "deletionTimestamp": "2026-12-03T13:00:00Z",
                             "finalizers": [kueue.FINALIZER],
                             "ownerReferences": [{"apiVersion": api_version, "kind": "TrainingJob", "name": "tj",
                                                  "uid": "uid-1", "controller": True}]}}

    async def main() -> None:
        rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type] - patch_workload is replaced
        rec.pods_synced.set()
        rec.workload_event("MODIFIED", workload("sagemaker.aws.amazon.com/v1", "theirs"))
        rec.workload_event("MODIFIED", workload("kubetrain.io/v1alpha1", "ours"))
        for _ in range(10):
            await asyncio.sleep(0)

    asyncio.run(main())
    assert released == ["ours"]


def test_a_job_whose_queue_label_was_removed_deleted_in_the_foreground_lets_its_workload_go(monkeypatch):
    """`kubectl delete --cascade=foreground` (Argo CD's prune) of a job that had been queued and then had its
    kueue.x-k8s.io/queue-name label removed: its Workload (deactivated, our finalizer still on it, blockOwnerDeletion)
    is deleted first and the job waits for it. Before: the reconcile of a job without the label never read its
    Workload, so the finalizer never went and the job and its Workload stayed Terminating forever (no DELETED of the
    job ever came to release it)."""
    from kubetrain import k8s_kueue

    name = kueue.workload_name("tj", "uid-1")
    terminating = {"metadata": {"name": name, "namespace": "ns", "resourceVersion": "9",
                                "deletionTimestamp": "2026-12-03T14:00:00Z", "finalizers": [kueue.FINALIZER],
                                "labels": {kueue.LABEL_JOB_UID: "uid-1"}},
                   "spec": {"active": False, "queueName": "team", "podSets": []}, "status": {}}
    released: list[tuple[str, bool]] = []

    async def get_workload(api, namespace, wl_name):
        return True, terminating if wl_name == name else None

    async def patch_workload(api, namespace, action) -> None:
        released.append((action.name, action.remove_finalizer))

    monkeypatch.setattr(k8s_kueue, "get_workload", get_workload)
    monkeypatch.setattr(k8s, "patch_workload", patch_workload)
    label_removed = {"type": "Queued", "status": "False", "reason": "QueueLabelRemoved", "message": "...",
                     "lastTransitionTime": "2026-12-03T13:00:00Z"}
    job = {"apiVersion": "kubetrain.io/v1", "kind": "TrainingJob",
           "metadata": {"namespace": "ns", "name": "tj", "uid": "uid-1", "resourceVersion": "12", "generation": 1,
                        "creationTimestamp": "2026-12-03T12:00:00Z", "deletionTimestamp": "2026-12-03T14:00:00Z",
                        "finalizers": ["foregroundDeletion"], "labels": {}},
           "spec": {"image": "reg/trainer:0.1.0", "nodes": 2, "trainer": {"builtin": {"task": "regression"}},
                    "strategy": {"type": "ddp"}},
           "status": {"phase": "Running", "attempt": 1, "conditions": [label_removed]}}

    async def main() -> None:
        rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type] - the Kueue calls are replaced
        rec.pods_synced.set()
        rec.enqueue = lambda key, delay=0.0: None  # type: ignore[method-assign]
        rec.jobs[("ns", "tj")] = job
        await rec.reconcile(("ns", "tj"))

    asyncio.run(main())
    assert released == [(name, True)]


def test_a_workload_whose_job_is_listed_meanwhile_is_left_to_the_jobs_reconcile(monkeypatch):
    """A Terminating Workload whose job is not known yet (the Workload watch, started by the first queued job's
    reconcile in one namespace, listed another namespace before the TrainingJobs there were listed) waits for its
    pods before it is let go. Before: once the pods were gone (or after 5 minutes, pods or not) its finalizer went
    even when its job had been listed meanwhile, alive: the job's own reconcile, which decides about the Workload of
    a live job (stop the gang, then let it go, then queue again), was bypassed and the quota freed early."""
    from kubetrain.observe import PodView

    released: list[str] = []

    async def patch_workload(api, namespace, action) -> None:
        released.append(action.name)

    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        await real_sleep(0)

    monkeypatch.setattr(k8s, "patch_workload", patch_workload)
    monkeypatch.setattr(asyncio, "sleep", sleep)
    name = kueue.workload_name("tj", "uid-1")
    terminating = {"metadata": {"name": name, "namespace": "ns", "deletionTimestamp": "2026-12-03T14:00:00Z",
                                "finalizers": [kueue.FINALIZER],
                                "ownerReferences": [{"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                                     "name": "tj", "uid": "uid-1", "controller": True}]}}

    async def main() -> None:
        rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type] - patch_workload is replaced
        rec.pods_synced.set()
        rec.enqueue = lambda key, delay=0.0: None  # type: ignore[method-assign]
        rec.pods_index.put(("ns", "tj"), "tj-a1-n0", ("uid-1", PodView(name="tj-a1-n0", attempt=1, rank=0)))
        rec.workload_event("MODIFIED", terminating)  # the job is not known yet: released once its pods are gone
        for _ in range(5):
            await real_sleep(0)
        rec.job_event("MODIFIED", ("ns", "tj"), {"metadata": {"namespace": "ns", "name": "tj", "uid": "uid-1",
                                                              "resourceVersion": "3"}})  # listed: it lives
        rec.pods_index.discard(("ns", "tj"), "tj-a1-n0")
        for _ in range(20):
            await real_sleep(0)
        assert not rec._releasing  # the release task ended

    asyncio.run(main())
    assert released == []


def test_a_job_whose_label_was_removed_deleted_during_a_watch_gap_has_its_workload_released(monkeypatch):
    """The TrainingJob watch was down when a job whose queue label had been removed was deleted: its relist makes up
    a DELETED whose body has only the name, labels and uid (no status, so no Queued condition). Before: that job did
    not count as queued, nothing let its Workload go, and the Workload stayed Terminating (its own event, come while
    the job was still known, had only woken the job up). The job's last known status says it was queued."""
    from kubetrain.informer import FINAL_STATE_UNKNOWN

    released = _recording_releases(monkeypatch)
    label_removed = LABEL_REMOVED

    async def main() -> None:
        rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type] - patch_workload is replaced
        rec.pods_synced.set()
        rec.enqueue = lambda key, delay=0.0: None  # type: ignore[method-assign]
        rec.job_event("MODIFIED", ("ns", "tj"), {**_deleted_job({}, [label_removed]), "metadata": {
            "namespace": "ns", "name": "tj", "uid": "uid-1", "labels": {}, "resourceVersion": "5"}})
        rec.job_event("DELETED", ("ns", "tj"), {"metadata": {"namespace": "ns", "name": "tj", "uid": "uid-1",
                                                             "labels": {}}, "status": {}, FINAL_STATE_UNKNOWN: True})
        for _ in range(10):
            await asyncio.sleep(0)

    asyncio.run(main())
    assert released == [kueue.workload_name("tj", "uid-1")]
