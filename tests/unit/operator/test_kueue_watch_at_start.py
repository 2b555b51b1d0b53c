"""The Workload watch starts with the operator where Kueue's API is served (`KueueSide.watch_workloads_if_served`):
the Workload of a queued job deleted while no operator led (down, restarting, leadership moving) is held by Kueue's
`resource-in-use` finalizer until the operator lets it go, and only the Workload watch tells it about one. A cluster
without Kueue still never watches the missing API. Through the real `Reconciler`, `Api`, error classification and
the `WorkloadInformer`'s list delivery; only the client functions are stand-ins that answer as the API server does."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace
from typing import Any, Callable

from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain.config import Settings
from kubetrain.informer import WorkloadInformer
from kubetrain.k8s import Api
from kubetrain.reconciler import Reconciler
from reconciler_harness import logged

FINALIZER = "kueue.x-k8s.io/resource-in-use"
WORKLOAD = {  # the Workload of job ml/train, deleted with it while no operator led
    "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
    "metadata": {"name": "trainingjob-train-1a2b3", "namespace": "ml", "resourceVersion": "41",
                 "deletionTimestamp": "2026-12-03T13:00:00Z", "finalizers": [FINALIZER],
                 "labels": {"kueue.x-k8s.io/job-uid": "uid-gone"},
                 "ownerReferences": [{"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "name": "train",
                                      "uid": "uid-gone", "controller": True}]},
}


def _error(status: int, message: str) -> ApiException:
    exc = ApiException(status=status, reason="Reason")
    exc.body = json.dumps({"kind": "Status", "code": status, "message": message})
    return exc


def _no_kueue() -> ApiException:
    return _error(404, "the server could not find the requested resource")


def _unavailable() -> ApiException:
    return _error(503, "try later")


class _Response:
    def __init__(self, body: Any) -> None:
        self.data = json.dumps(body).encode()

    def release_conn(self) -> None:
        pass


def start(lists: list[Callable[[], ApiException] | None], *, jobs: dict | None = None,
          before_listed: Callable[[Reconciler], None] = lambda rec: None) -> dict[str, Any]:
    """An operator that starts: each list of Workloads answers the next of `lists` (None: served, listed). Its
    Workload watch delivers the listed WORKLOAD, as the informer's first list does. What happened, by name."""
    seen: dict[str, Any] = {"lists": [], "watches": 0, "patches": [], "sleeps": [], "woken": []}

    def list_workloads(*args: Any, **kwargs: Any) -> _Response:
        seen["lists"].append((args, kwargs.get("limit")))
        answer = lists.pop(0)
        if answer is not None:
            raise answer()
        return _Response({"items": [], "metadata": {"resourceVersion": "50"}})

    def get_workload(*_: Any, **__: Any) -> _Response:
        return _Response(WORKLOAD)

    def patch_workload(*args: Any, **__: Any) -> _Response:
        seen["patches"].append(args[-1])
        return _Response(WORKLOAD)

    async def main() -> None:
        api = Api(client.ApiClient(), threads=4)
        api.custom = SimpleNamespace(list_namespaced_custom_object=list_workloads,
                                     get_namespaced_custom_object=get_workload,
                                     patch_namespaced_custom_object=patch_workload)
        rec = Reconciler(api=api, settings=Settings())
        rec.pods_synced.set()
        rec.jobs.update(jobs or {})
        rec.enqueue = lambda key, delay=0.0: seen["woken"].append(key)  # type: ignore[method-assign]
        informer = WorkloadInformer(client.ApiClient(), namespaces=("ml",), on_event=rec.workload_event)

        def watch() -> None:  # handlers.startup's: the informer's threads list, then deliver on the loop
            seen["watches"] += 1
            informer._replace("ml", [WORKLOAD])

        rec.start_workload_watch = watch
        real_sleep = asyncio.sleep

        async def sleep(delay: float) -> None:
            seen["sleeps"].append(delay)
            await real_sleep(0)

        asyncio.sleep = sleep  # type: ignore[assignment]
        try:
            listed = asyncio.Event()
            rec.watch_workloads_if_served(namespace="ml", jobs_listed=listed)
            for _ in range(20):
                await real_sleep(0.01)
            seen["before_listed"] = (len(seen["lists"]), seen["watches"])
            before_listed(rec)
            listed.set()
            for _ in range(100):
                await real_sleep(0.01)
                if seen["patches"] or (not lists and not rec._tasks):
                    break
            seen["lazy_left"] = rec.start_workload_watch is not None
        finally:
            asyncio.sleep = real_sleep  # type: ignore[assignment]
            await rec.stop()
            api.close()

    asyncio.run(main())
    return seen


def test_a_workload_whose_job_was_deleted_while_no_operator_led_is_released_at_start() -> None:
    """Before: the Workload watch started only when a queued job was reconciled; with none left, the Workload of
    the deleted job stayed Terminating (our finalizer) until another queued job appeared."""
    seen = start([None])
    assert seen["before_listed"] == (0, 0)  # not before the jobs are listed: a live job's Workload is no orphan
    assert seen["lists"] == [(("kueue.x-k8s.io", "v1beta2", "ml", "workloads"), 1)]
    assert seen["watches"] == 1
    assert seen["patches"] == [{"metadata": {"resourceVersion": "41", "finalizers": []}}]


def test_a_workload_of_a_job_that_exists_is_left_to_the_jobs_reconcile() -> None:
    job = {"metadata": {"name": "train", "namespace": "ml", "uid": "uid-gone"}}
    seen = start([None], jobs={("ml", "train"): job})
    assert seen["watches"] == 1 and seen["patches"] == [] and seen["woken"] == [("ml", "train")]


def test_without_kueue_nothing_is_watched_and_nothing_is_said_above_info(caplog) -> None:
    """A watch of the missing API would log an ERROR after 5 minutes on every cluster without Kueue."""
    with caplog.at_level(logging.DEBUG, logger="kubetrain"):
        seen = start([_no_kueue])
    assert seen["watches"] == 0 and seen["patches"] == []
    assert seen["lazy_left"]  # a job that asks for Kueue later still starts the watch
    assert not logged(caplog, logging.WARNING) and not logged(caplog, logging.ERROR)
    assert any("Workload API (kueue.x-k8s.io/v1beta2) is not served" in m for m in logged(caplog, logging.INFO))


def test_a_question_left_unanswered_is_asked_again_with_backoff() -> None:
    seen = start([_unavailable, _unavailable, None])
    assert len(seen["lists"]) == 3 and seen["sleeps"][:2] == [0.5, 1.0]
    assert seen["watches"] == 1 and len(seen["patches"]) == 1


def test_a_watch_a_queued_job_started_first_is_not_started_again() -> None:
    seen = start([None], before_listed=lambda rec: rec._watch_workloads())
    assert seen["watches"] == 1 and seen["lists"] == []


QUEUED_JOB = {
    "metadata": {"name": "train", "namespace": "ml", "uid": "uid-now", "generation": 1,
                 "creationTimestamp": "2026-12-03T13:00:00Z", "resourceVersion": "7",
                 "labels": {"kueue.x-k8s.io/queue-name": "team"}},
    "spec": {"image": "reg/trainer:0.1.0", "nodes": 2, "trainer": {"builtin": {"task": "regression"}},
             "strategy": {"type": "ddp"}},
}


def reconcile_queued(answers: list[Callable[[], ApiException]]) -> list[int]:
    """One reconcile of a queued job per answer of its Workload read; the Workload watches started after each."""
    watches: list[int] = []

    def get_workload(*_: Any, **__: Any) -> _Response:
        raise answers[0]()

    def ok(*args: Any, **__: Any) -> _Response:
        body = args[-1] if args and isinstance(args[-1], dict) else {}
        return _Response({**QUEUED_JOB, "metadata": {**QUEUED_JOB["metadata"], "resourceVersion": "8"}, **body})

    async def main() -> None:
        api = Api(client.ApiClient(), threads=4)
        api.core = SimpleNamespace(create_namespaced_event=ok)
        api.custom = SimpleNamespace(get_namespaced_custom_object=get_workload, create_namespaced_custom_object=ok,
                                     patch_namespaced_custom_object_status=ok)
        rec = Reconciler(api=api, settings=Settings())
        rec.pods_synced.set()
        rec.enqueue = lambda key, delay=0.0: None  # type: ignore[method-assign]
        started = [0]
        rec.start_workload_watch = lambda: started.__setitem__(0, started[0] + 1)
        try:
            while answers:
                rec.jobs[("ml", "train")] = json.loads(json.dumps(QUEUED_JOB))
                await rec.reconcile(("ml", "train"))
                watches.append(started[0])
                answers.pop(0)
            await asyncio.sleep(0.05)  # the events go out in the background
        finally:
            api.close()

    asyncio.run(main())
    return watches


def test_a_queued_job_on_a_cluster_without_kueue_starts_no_watch_until_kueue_is_served() -> None:
    """Before: the first queued job started the Workload watch before its read said Kueue's API is not served;
    the watch of the missing API failed every 30 s and logged an ERROR after 5 minutes ('Workload watch (ml) has
    been down for 300s: jobs there are not reconciled', while they were: phase Queued, KueueNotInstalled)."""
    no_workload = lambda: _error(404, 'workloads.kueue.x-k8s.io "trainingjob-train-x" not found')  # noqa: E731
    assert reconcile_queued([_no_kueue, _no_kueue, no_workload, no_workload]) == [0, 0, 1, 1]
