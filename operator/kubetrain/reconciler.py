"""The reconcile loop: per-job queueing, the in-memory observed world, and plan -> apply.

No kopf here (`handlers.py` is the glue that feeds it events): the observed
world is kept in memory, our pods by job (fed by `informer.py`) and node health
(a kopf index handed over at startup), so a reconcile never lists anything.
Every event that concerns a job (the job itself, one of its pods, the node under
one of its pods) puts the job on a queue; one reconcile per job runs at a time
and a burst of events collapses into one more run. Timers the planner asks for
(backoff, deadlines, grace periods) are `call_later` wake-ups, and a slow resync
re-plans every job anyway, so nothing depends on a single event.

A reconcile reads the newest stored job, observes (pods, nodes, progress,
`Expectations` of our own writes not yet seen), calls the pure `plan()`, and
hands the plan to `k8s.apply`; the typed errors of `k8s` decide what happens
next (re-read on a conflict, fail the job on a permanent error, back off on a
refusal or a temporary error).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import logging
from typing import Any, Callable

from kubetrain import k8s, metrics, plan_kueue
from kubetrain.backoff import Backoff, Key
from kubetrain.api import LABEL_JOB, Job, pod_name
from kubetrain.config import Settings
from kubetrain.errors import (ApiError, ConflictError, PermanentError, RejectedError, TemporaryError,
                              WorkloadRejectedError)
from kubetrain.informer import FINAL_STATE_UNKNOWN
from kubetrain.actions import CreatePod, CreateWorkload, DeletePod, PatchWorkload, Plan
from kubetrain.observe import GONE_SUCCEEDED, Expectations, NodeView, Observed, PodIndex, PodView
from kubetrain.plan import fail_plan, rejected_plan
from kubetrain.plan_kueue import plan_queued, plan_unqueued, reads_workload
from kubetrain.progress import ProgressObservation
from kubetrain.reconciler_kueue import KueueSide

log = logging.getLogger("kubetrain.operator")
POD_EVENT_DELAY = 0.3
"""Pod events are coalesced: a gang's pods change state in bursts; one reconcile per burst saves CPU and writes."""
CONFLICT_RETRIES = 5


def utcnow() -> dt.datetime:
    """The operator's clock (UTC)."""
    return dt.datetime.now(dt.timezone.utc)


def _uid(body: dict[str, Any] | None) -> str | None:
    return ((body or {}).get("metadata") or {}).get("uid")


def _rv(body: dict[str, Any] | None) -> int:
    try:
        return int((body or {}).get("metadata", {}).get("resourceVersion") or 0)
    except (TypeError, ValueError):
        return 0


class Reconciler(KueueSide):
    """One serialized, coalescing reconcile loop per job (Kueue's part: `reconciler_kueue.KueueSide`)."""

    def __init__(self, *, api: k8s.Api, settings: Settings) -> None:
        self.api, self.settings = api, settings
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods_index = PodIndex()
        self.pods_synced = asyncio.Event()
        self.pods_watching: Callable[[str], asyncio.Event] = lambda namespace: self.pods_synced
        """Set while the pod store of a namespace is current (`PodInformer.watching`)."""
        self.nodes_index: Any = None
        self.nodes_indexed = False  # kopf calls node_event only once its node index is filled
        self.missing_nodes: dict[str, dt.datetime] = {}
        self.gone: dict[tuple[str, str], dict[str, str]] = {}
        self.node_ready: dict[str, bool] = {}
        self.expectations: dict[tuple[str, str], Expectations] = {}
        self.backoff = Backoff()  # errors in a row, by job
        self._running: set[tuple[str, str]] = set()
        self._dirty: set[tuple[str, str]] = set()
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._sem = asyncio.Semaphore(settings.max_concurrent_reconciles)
        self.progress: dict[tuple[str, str], ProgressObservation] = {}  # each job's newest /progress (poller.py)
        self.active = 0
        self._jobs_parsed: dict[tuple[str, str], tuple[tuple[Any, Any], Job]] = {}
        super().__init__()

    # ------------------------------------------------------------ queueing

    def store_job(self, key: tuple[str, str], body: dict[str, Any]) -> None:
        """Keep the newest body we know: the watch may lag behind our own writes."""
        if _rv(body) >= _rv(self.jobs.get(key)):
            self.jobs[key] = body

    def forget(self, key: tuple[str, str]) -> None:
        self.jobs.pop(key, None)
        self._jobs_parsed.pop(key, None)
        self.expectations.pop(key, None)
        self.gone.pop(key, None)
        self.backoff.forget(key)
        self.progress.pop(key, None)
        if timer := self._timers.pop(key, None):
            timer.cancel()

    def enqueue(self, key: tuple[str, str], delay: float = 0.0) -> None:
        if delay > 0:
            loop = asyncio.get_running_loop()
            when = loop.time() + delay
            timer = self._timers.get(key)
            if timer is not None and not timer.cancelled() and timer.when() <= when:
                return
            if timer is not None:
                timer.cancel()
            self._timers[key] = loop.call_at(when, self._fire, key)
            return
        if key in self._running:
            self._dirty.add(key)
            return
        self._running.add(key)
        task = asyncio.get_running_loop().create_task(self._run(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for a reconcile slot (queued, not yet running)."""
        return len(self._running) - self.active

    def _fire(self, key: tuple[str, str]) -> None:
        self._timers.pop(key, None)
        self.enqueue(key)

    async def _run(self, key: tuple[str, str]) -> None:
        try:
            await self.pods_synced.wait()  # until the pod list is in, a missing pod proves nothing
            while True:
                await self.pods_watching(key[0]).wait()  # nor while the pod watch of its namespace is down
                self._dirty.discard(key)
                async with self._sem:
                    self.active += 1
                    try:
                        with metrics.RECONCILE_SECONDS.time():
                            await self.reconcile(key)
                        self.backoff.reconciled(key)
                    except Exception as exc:  # noqa: BLE001 - a bug must not kill the loop of this job forever
                        self.enqueue(key, self.backoff.crashed(key, exc))  # logs its traceback, once (backoff.py)
                    finally:
                        self.active -= 1
                if key not in self._dirty:
                    return
        finally:
            self._running.discard(key)

    async def resync(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resync_seconds)
            self.forget_idle_nodes()
            for key in list(self.jobs):
                if key not in self.backoff.crashes:  # a crashing job waits for its retry (or an event), not for this
                    self.enqueue(key)

    def forget_idle_nodes(self) -> None:
        """Missing nodes with no pod of ours left on them: when they went missing no longer matters to any job."""
        for name in [n for n in self.missing_nodes if not self.pods_index.jobs_on(n)]:
            del self.missing_nodes[name]

    async def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        for task in list(self._tasks):
            task.cancel()

    # ------------------------------------------------------------ observing

    def observe(self, job: Job, now: dt.datetime) -> Observed:
        pods = [view for uid, view in self.pods_index[(job.namespace, job.name)] if uid == job.uid]
        pods = self._expectations((job.namespace, job.name), job.uid).overlay(pods, now)
        nodes: dict[str, NodeView] = {}
        for pod in pods:
            if pod.node_name and pod.node_name not in nodes:
                nodes[pod.node_name] = self.node_view(pod.node_name, now)
        gone = self.gone.get((job.namespace, job.name), {})
        for name in [n for n in gone if not n.startswith(f"{job.name}-a{job.status.attempt}-")]:
            del gone[name]  # only the current attempt's losses matter
        return Observed(pods=tuple(sorted(pods, key=lambda p: (p.attempt, p.rank))), nodes=nodes, gone=dict(gone),
                        progress=self.progress.get((job.namespace, job.name)))

    def node_view(self, name: str, now: dt.datetime) -> NodeView:
        if self.nodes_index is not None and name in self.nodes_index:
            for view in self.nodes_index[name]:
                self.missing_nodes.pop(name, None)
                return view
        if not self.nodes_indexed:  # the jobs come before kopf has listed the nodes: none is missing yet
            return NodeView(name=name)
        since = self.missing_nodes.setdefault(name, now)
        return NodeView(name=name, exists=False, ready=False, since=since)

    def job_event(self, kind: str, key: tuple[str, str], body: dict[str, Any]) -> None:
        """One TrainingJob event: keep its newest body and wake it up; forget a deleted one."""
        if kind == "DELETED":
            last = self.jobs.get(key)  # a DELETED made up by a relist has no status: the last one known has
            self.forget(key)
            self.job_deleted(key, body, last)
            return
        self.store_job(key, body)
        self.enqueue(key)

    def node_event(self, kind: str, name: str, ready: bool) -> None:
        """One node event: a change of readiness (or a deletion) wakes up the jobs with a pod
        on that node; a heartbeat (no change) does nothing."""
        self.nodes_indexed = True
        if kind == "DELETED":  # for good, often (a scale-down, a spot node): kept only while a pod of ours is on it
            self.node_ready.pop(name, None)
            if self.pods_index.jobs_on(name):
                self.missing_nodes.setdefault(name, utcnow())
        elif self.node_ready.get(name) == ready:
            return  # a heartbeat, not a change
        else:
            self.node_ready[name] = ready
        for key in self.pods_index.jobs_on(name):  # by the node index: never a walk over every job's pods
            if key in self.jobs:
                self.enqueue(key)

    def pod_event(self, kind: str, body: dict[str, Any]) -> None:
        """One pod event from the informer: update the index, remember why a pod was
        taken away, and wake its job up (after POD_EVENT_DELAY: a gang's pods change
        state in bursts, and one reconcile per burst saves CPU and status writes)."""
        meta = body.get("metadata") or {}
        job = (meta.get("labels") or {}).get(LABEL_JOB)
        if not job:
            return
        key, name = (meta.get("namespace") or "", job), meta.get("name") or ""
        view = PodView.from_storage(body)
        owner = next((o.get("uid") for o in meta.get("ownerReferences") or () if o.get("controller")), "")
        if kind == "DELETED":
            last = self.pods_index.discard(key, name)
            if body.get(FINAL_STATE_UNKNOWN) and last is not None:  # gone during a watch gap: as last seen
                owner, view = last
            job_uid = ((self.jobs.get(key) or {}).get("metadata") or {}).get("uid")
            if view is not None and owner and owner == job_uid and (view.phase == "Succeeded" or view.disruption):
                # Kept for the Preempted event, or so that a rank that succeeded and was then deleted (PodGC,
                # someone tidying up) counts as done, not as a preemption of a gang still finishing. Only the
                # job's own pods: a pod of a deleted job of the same name is removed by the garbage collector
                # after the new job exists, and its names come back with the new job's attempts.
                self.gone.setdefault(key, {})[name] = GONE_SUCCEEDED if view.phase == "Succeeded" else view.disruption
            elif key in self.gone:
                self.gone[key].pop(name, None)  # this name went for no recorded reason: nothing of it is kept
        else:
            if view is None:  # no longer labelled as ours
                self.pods_index.discard(key, name)
                return
            self.pods_index.put(key, name, (owner or "", view))
        if key in self.jobs:
            self.enqueue(key, POD_EVENT_DELAY)

    # ------------------------------------------------------------ reconciling

    def _parsed(self, key: tuple[str, str], body: dict[str, Any]) -> Job:
        """`Job.from_storage`, once per stored version (uid, resourceVersion): pod events re-plan an unchanged job."""
        meta = body.get("metadata") or {}
        stamp = (meta.get("uid"), meta.get("resourceVersion"))
        hit = self._jobs_parsed.get(key)
        if hit is None or hit[0] != stamp or not stamp[1]:
            hit = self._jobs_parsed[key] = (stamp, Job.from_storage(body, default_image=self.settings.default_image))
        return hit[1]

    async def reconcile(self, key: tuple[str, str]) -> None:
        uid = _uid(self.jobs.get(key))
        try:
            await self._reconcile(key)
        finally:
            if key not in self.jobs:  # deleted while it ran: what it noted since (errors in a row, expectations) goes
                self.forget(key)
            elif uid is not None and _uid(self.jobs[key]) not in (uid, None):  # deleted and re-created under its
                self.backoff.forget(key)  # name: the new job is kept, the old one's errors in a row are not its

    async def _reconcile(self, key: tuple[str, str]) -> None:
        for _ in range(CONFLICT_RETRIES):
            body = self.jobs.get(key)
            if body is None:
                return
            now = utcnow()
            job = self._parsed(key, body)
            observed = self.observe(job, now)
            if reads_workload(job):  # a deleting job that was queued too: its Workload holds it up
                try:
                    kq = await self.observe_kueue(job, now)
                except TemporaryError as exc:  # backs off as any temporary error (the reads' refusals are such)
                    self._retry_later(key, exc, doing="reading Kueue")
                    return
                result = plan_queued(job, observed, kq, now)
            else:
                result = plan_unqueued(job, observed, now)
            if not result.actions and not result.events:
                self.backoff.went_through(key)
                if result.requeue_after is not None:
                    self.enqueue(key, result.requeue_after + 0.05)
                return
            rv = str(body["metadata"].get("resourceVersion") or "")
            try:
                await k8s.apply(self.api, job, rv, result, functools.partial(self._said, key, job, result))
            except ConflictError:
                metrics.ERRORS.labels("conflict").inc()
                try:
                    fresh = await self.api.get_job(*key)
                except TemporaryError as exc:  # the re-read failed: tried again later, not a crash
                    self._retry_later(key, exc)
                    return
                if fresh is None or key not in self.jobs:  # gone, or its DELETED event came during the read
                    self.forget(key)
                    return
                self.jobs[key] = fresh
                continue
            except PermanentError as exc:
                # The plan may have created pods before the refusal (a Service that is not ours is found after
                # them): seen again with them, the Failed plan deletes them too (one whose create failed is
                # deleted for nothing: NotFound). Not on a refusal that can pass: a pod expected but never
                # created would read as deleted by someone else once its expectation expires.
                self._remember(key, job.uid, result, now, creates_only=True)
                failed = fail_plan(job, self.observe(job, now), now, reason=exc.reason, message=str(exc))
                try:  # said once marked Failed, whatever its deletes meet (the Failed job's next reconcile retries)
                    await k8s.apply(self.api, job, rv, failed, functools.partial(self._said, key, job, failed, cannot_run=exc))
                except ApiError as error:  # a conflict plans again soon; RBAC, 5xx... back off
                    self._retry_later(key, error) if isinstance(error, TemporaryError) else self.enqueue(key, 2.0)
                    return
                result = failed  # what was written: the expectations below are its
            except RejectedError as exc:
                await self._wait_rejected(key, job, rv, exc, now)
                return
            except TemporaryError as exc:
                self._retry_later(key, exc)
                return
            except ApiError as exc:  # refused (404, 400/422 on a write that is not a create): backs off, warned once
                self.enqueue(key, self.backoff.refused(key, exc))
                return
            self._remember(key, job.uid, result, now)
            self.backoff.went_through(key)
            if any(isinstance(a, (CreatePod, CreateWorkload, PatchWorkload)) for a in result.actions):
                self.backoff.created(key)
            if result.status is None:  # else said once it was written
                self._said(key, job, result, None)
            if result.requeue_after is not None:
                self.enqueue(key, result.requeue_after + 0.05)
            return
        self.enqueue(key, 1.0)

    async def _wait_rejected(self, key: Key, job: Job, rv: str, exc: RejectedError, now: dt.datetime) -> None:
        """A create (or a Workload write) refused for a reason that can pass: the job shows why; tried again later."""
        delay, why = self.backoff.rejected(key, exc), {"reason": exc.reason, "message": str(exc)}
        waiting = (plan_kueue.rejected_plan(job, now, create=exc.create, first=self.backoff.rejections[key] == 1, **why)
                   if isinstance(exc, WorkloadRejectedError) else rejected_plan(job, now, **why))
        try:  # said once its status is written, as any transition (the same refusal again writes none)
            await k8s.apply(self.api, job, rv, waiting, functools.partial(self._said, key, job, waiting))
        except ApiError:
            pass  # the retry below plans again from whatever is stored
        self.enqueue(key, delay)

    def _said(self, key: tuple[str, str], job: Job, result: Plan, written: dict[str, Any] | None, *,
              cannot_run: PermanentError | None = None) -> None:
        """What a plan changed, said once its status is written (`k8s.apply`): the writes after it (deletes) may
        fail, and the retry plans from the written status, with nothing left to count or log."""
        if cannot_run is not None:
            metrics.ERRORS.labels("permanent").inc()
            log.error("job %s/%s cannot run: %s", job.namespace, job.name, cannot_run)
        if written is not None and key in self.jobs:  # not a job whose DELETED event came during the write
            self.store_job(key, written)
        phase = result.status.phase if result.status is not None else None
        if phase != job.status.phase and phase in ("Suspended", "Succeeded", "Failed"):
            self.backoff.settled(key)  # a wait for quota from before a suspend is not the resumed job's
        metrics.count_plan(job.status, result)
        for event in result.events:
            log.info("%s/%s %s: %s", job.namespace, job.name, event.reason, event.message)

    def _retry_later(self, key: tuple[str, str], exc: TemporaryError, doing: str = "") -> None:
        """Backs off while it lasts (an API server overloaded or away, RBAC's refusal: backoff.py)."""
        self.enqueue(key, self.backoff.temporary(key, exc, doing))

    def _expectations(self, key: tuple[str, str], uid: str) -> Expectations:
        exp = self.expectations.get(key)
        if exp is None or exp.uid != uid:  # a same-name job deleted and re-created: the old one's are not its
            exp = self.expectations[key] = Expectations(uid=uid)
        return exp

    def _remember(self, key: tuple[str, str], uid: str, result: Plan, now: dt.datetime, *,
                  creates_only: bool = False) -> None:
        """Expect the plan's writes in the informer's view (`creates_only`: it stopped at a permanent error)."""
        exp = self._expectations(key, uid)
        for action in result.actions:
            if isinstance(action, CreatePod):
                name = pod_name(key[1], action.attempt, action.rank)
                exp.created[name] = (now, PodView(name=name, attempt=action.attempt, rank=action.rank))
            elif isinstance(action, DeletePod) and not creates_only:
                exp.deleted[action.name] = now
