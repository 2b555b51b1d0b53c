"""The reconciler's side of Kueue (issue 14): a queued job's Workload read for the planner, Workload events, and
the release of a deleted job's Workload.

`Reconciler` (reconciler.py) inherits `KueueSide`: what is here runs on its state (the jobs, the pod index, its
tasks and queue) and does I/O through `k8s` and `k8s_kueue`; what to do with a Workload is decided by the pure
`plan_kueue.py`. A Workload whose job is gone has no job left to reconcile: it is let go here (`_release`), woken
by the Workload watch or by the job's DELETED event.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import logging
from typing import Any, Callable

from kubetrain import k8s, k8s_kueue, kueue
from kubetrain.actions import PatchWorkload
from kubetrain.api import GROUP, KIND, Job
from kubetrain.errors import ApiError, ConflictError, TemporaryError
from kubetrain.observe import EXPECTATION_TTL, PodIndex
from kubetrain.plan_kueue import QUEUED, KueueObserved

log = logging.getLogger("kubetrain.operator")


class KueueSide:
    """Kueue's part of `Reconciler`; the attributes annotated below are the reconciler's own."""

    api: k8s.Api
    jobs: dict[tuple[str, str], dict[str, Any]]
    pods_index: PodIndex
    pods_synced: asyncio.Event
    _tasks: set[asyncio.Task[None]]
    enqueue: Callable[..., None]

    def __init__(self) -> None:
        self.start_workload_watch: Callable[[], None] | None = None  # called once, when a job first asks for Kueue
        self._flavors: dict[str, tuple[dt.datetime, dict[str, Any]]] = {}
        self._releasing: set[tuple[str, str]] = set()

    def _watch_workloads(self) -> None:
        if self.start_workload_watch is not None:
            start, self.start_workload_watch = self.start_workload_watch, None
            start()

    def watch_workloads_if_served(self, *, namespace: str, jobs_listed: asyncio.Event) -> None:
        """At start, once the jobs are listed: watch the Workloads now if Kueue's API is served (asked in `namespace`,
        "": cluster-wide). Else the watch would wait for a queued job to be reconciled, and the Workload of a queued
        job deleted while no operator led stayed Terminating (our finalizer) until one came. A cluster without Kueue
        still never watches the missing API (a watch of it would be logged at ERROR after 5 min)."""
        task = asyncio.get_running_loop().create_task(self._watch_if_served(namespace, jobs_listed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_if_served(self, namespace: str, jobs_listed: asyncio.Event) -> None:
        # After the jobs' list: a listed Workload whose job is not known yet would be taken for an orphan.
        await jobs_listed.wait()
        for tries in itertools.count(1):
            if self.start_workload_watch is None:
                return  # a queued job started it meanwhile
            try:
                served = await k8s_kueue.workloads_served(self.api, namespace)
                break
            except TemporaryError as exc:  # the API server away, RBAC: asked again, as a release is
                log.log(logging.INFO if tries < 6 else logging.WARNING if tries == 6 else logging.DEBUG,
                        "asking whether Kueue's Workload API is served: %s; trying again", exc)
                await asyncio.sleep(min(60.0, 0.5 * 2 ** min(tries - 1, 7)))
        if served:
            self._watch_workloads()
        else:
            log.info("Kueue's Workload API (%s) is not served: Workloads are watched once a job asks for Kueue",
                     kueue.API_VERSION)

    async def observe_kueue(self, job: Job, now: dt.datetime) -> KueueObserved:
        """Kueue's side of a queued job: its Workload, the priority value it needs, the admitted flavors."""
        installed, body = await k8s_kueue.get_workload(self.api, job.namespace, kueue.workload_name(job.name, job.uid))
        if not installed:  # no watch of a missing API (it would fail on and on): asked again at the next reconcile
            return KueueObserved(installed=False)
        self._watch_workloads()
        priority, error = None, ""
        if body is None and job.spec is not None:
            ref = kueue.priority_ref(job, job.labels)
            if ref is not None:
                priority, error = await k8s_kueue.priority_value(self.api, ref)
        flavors: dict[str, dict[str, Any]] = {}
        view = kueue.WorkloadView.from_storage(body) if body is not None else None
        if view is not None and view.admitted:
            for name in {f for a in view.assignments for f in a.flavors.values()}:
                cached = self._flavors.get(name)
                if cached is None or now - cached[0] > EXPECTATION_TTL:
                    spec = await k8s_kueue.flavor_spec(self.api, name)
                    if spec is None:
                        continue
                    cached = self._flavors[name] = (now, spec)
                flavors[name] = cached[1]
        return KueueObserved(workload=body, priority=priority, priority_error=error, flavors=flavors)

    def workload_event(self, kind: str, body: dict[str, Any]) -> None:
        """One Workload event: wake its job up; a Workload whose job is gone is let go once its pods are."""
        meta = body.get("metadata") or {}
        owner = next((o for o in meta.get("ownerReferences") or () if o.get("controller") and o.get("kind") == KIND
                      and str(o.get("apiVersion") or "").split("/")[0] == GROUP), None)  # not another group's kind
        if owner is None:
            return
        key = (meta.get("namespace") or "", str(owner.get("name") or ""))
        known = self.jobs.get(key)
        if known is not None and (known.get("metadata") or {}).get("uid") == owner.get("uid"):
            self.enqueue(key)
        elif kind != "DELETED" and meta.get("deletionTimestamp") and kueue.FINALIZER in (meta.get("finalizers") or ()):
            self._release_later(key, str(owner.get("uid") or ""), str(meta.get("name") or ""), unless_listed=True)

    def job_deleted(self, key: tuple[str, str], body: dict[str, Any], last: dict[str, Any] | None = None) -> None:
        """A deleted job's Workload is deleted with it, held by the finalizer until the pods are gone: let go, that of
        a queued job and that of a job whose queue label was removed (its Workload deactivated, still ours). `last`:
        the job's body as last known, whose status counts too (a DELETED made up by a relist has none)."""
        meta = body.get("metadata") or {}
        statuses = [body] + ([last] if last is not None and (last.get("metadata") or {}).get("uid") == meta.get("uid")
                             else [])
        queued = kueue.LABEL_QUEUE_NAME in (meta.get("labels") or {}) or any(
            isinstance(c, dict) and c.get("type") == QUEUED
            for b in statuses for c in (b.get("status") or {}).get("conditions") or ())
        if queued and meta.get("uid"):
            self._release_later(key, str(meta["uid"]), kueue.workload_name(key[1], str(meta["uid"])))

    def _release_later(self, key: tuple[str, str], uid: str, name: str, *, unless_listed: bool = False) -> None:
        if (key[0], name) in self._releasing:
            return
        self._releasing.add((key[0], name))
        task = asyncio.get_running_loop().create_task(self._release(key, uid, name, unless_listed=unless_listed))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, key: tuple[str, str], uid: str, name: str, *, unless_listed: bool = False) -> None:
        """Remove the finalizer of a deleted job's Workload once none of its pods is left (or after 5 min); a conflict
        (Kueue wrote meanwhile) or an error that can pass (a webhook down, RBAC) is tried again until it goes through:
        no event of the job is left to wake it up, and a Workload not let go stays Terminating forever.
        `unless_listed`: the job was only unknown (a Workload event before its namespace's jobs were listed): if it
        is known by then, alive or deleting, its own reconcile decides about its Workload (`plan_queued`)."""
        try:
            await self.pods_synced.wait()  # after a restart, an empty index does not mean the pods are gone
            for _ in range(300):
                if not any(owner == uid for owner, _ in self.pods_index[key]):
                    break
                await asyncio.sleep(1.0)
            for tries in itertools.count(1):
                if unless_listed and ((self.jobs.get(key) or {}).get("metadata") or {}).get("uid") == uid:
                    return
                try:
                    await k8s.patch_workload(self.api, key[0], PatchWorkload(name=name, resource_version="",
                                                                             remove_finalizer=True))
                    return
                except (ConflictError, TemporaryError) as exc:  # 0.5 s, doubling to every minute; warned once
                    log.log(logging.INFO if tries < 6 else logging.WARNING if tries == 6 else logging.DEBUG,
                            "releasing Workload %s/%s: %s; trying again", key[0], name, exc)
                    await asyncio.sleep(min(60.0, 0.5 * 2 ** min(tries - 1, 7)))
        except ApiError as exc:
            log.warning("could not release Workload %s/%s: %s", key[0], name, exc)
        finally:
            self._releasing.discard((key[0], name))
