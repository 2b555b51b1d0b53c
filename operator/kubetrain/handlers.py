"""Thin kopf glue: watch jobs, pods and nodes, and run plan -> apply per job.

The observed world is kept in memory: our pods by job (fed by `informer.py`,
a plain list+watch: pods are most of the events, and kopf's per-event cost
dominated the operator's CPU on big launches) and node health (a kopf index),
so a reconcile never lists anything. Every event that
concerns a job (the job itself, one of its pods, the node under one of its
pods) puts the job on a queue; one reconcile per job runs at a time and a
burst of events collapses into one more run. Timers the planner asks for
(backoff, deadlines, grace periods) are `call_later` wake-ups, and a slow
resync re-plans every job anyway, so nothing depends on a single event.

kopf itself writes nothing to our objects here: only event watchers and an
index are used (no finalizers, no progress annotations); all writes go
through `k8s.py`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import kopf
from kubernetes.client.rest import ApiException

from kubetrain import k8s, metrics, poller
from kubetrain.informer import PodInformer
from kubetrain.progress import ProgressObservation
from kubetrain.api import (
    GROUP, LABEL_JOB, LABEL_MANAGED_BY, MANAGED_BY, PLURAL, VERSION, Job, parse_time, pod_name,
)
from kubetrain.config import Settings
from kubetrain.plan import (
    CreatePod, DeletePod, NodeView, Observed, Plan, PodView, fail_plan, plan, rejected_plan,
)

log = logging.getLogger("kubetrain.operator")
EXPECTATION_TTL = dt.timedelta(seconds=60)
POD_EVENT_DELAY = 0.3
"""Pod events are coalesced: a gang's pods change state in bursts (scheduled, started,
ready), and one reconcile per burst saves CPU and status writes."""
CONFLICT_RETRIES = 5
REJECTED_BACKOFF = (5.0, 10.0, 20.0, 40.0, 60.0)
"""Seconds between pod creates the API server refused for a reason that can pass (quota)."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _rv(body: dict[str, Any] | None) -> int:
    try:
        return int((body or {}).get("metadata", {}).get("resourceVersion") or 0)
    except (TypeError, ValueError):
        return 0


@dataclass
class Expectations:
    """Writes we made whose watch events have not arrived yet (as in kube-controller-manager):
    a pod we just created is not 'missing', a pod we just deleted is not 'still running'."""

    created: dict[str, tuple[dt.datetime, PodView]] = field(default_factory=dict)
    deleted: dict[str, dt.datetime] = field(default_factory=dict)

    def overlay(self, pods: list[PodView], now: dt.datetime) -> list[PodView]:
        seen = {p.name for p in pods}
        for name in [n for n, (t, _) in self.created.items() if n in seen or now - t > EXPECTATION_TTL]:
            del self.created[name]
        out = [replace(p, deletion_timestamp=self.deleted[p.name])
               if p.name in self.deleted and p.deletion_timestamp is None else p for p in pods]
        for name in [n for n, t in self.deleted.items() if n not in seen or now - t > EXPECTATION_TTL]:
            del self.deleted[name]
        return out + [view for _, view in self.created.values()]


class PodIndex:
    """Our pods by (namespace, job): pod name -> (controller uid, view)."""

    def __init__(self) -> None:
        self._by_job: dict[tuple[str, str], dict[str, tuple[str, PodView]]] = {}

    def put(self, key: tuple[str, str], name: str, entry: tuple[str, PodView]) -> None:
        self._by_job.setdefault(key, {})[name] = entry

    def discard(self, key: tuple[str, str], name: str) -> None:
        pods = self._by_job.get(key)
        if pods is not None:
            pods.pop(name, None)
            if not pods:
                del self._by_job[key]

    def __contains__(self, key: object) -> bool:
        return key in self._by_job

    def __getitem__(self, key: tuple[str, str]) -> list[tuple[str, PodView]]:
        return list(self._by_job.get(key, {}).values())

    def __iter__(self) -> Any:
        return iter(list(self._by_job))


class Reconciler:
    """One serialized, coalescing reconcile loop per job."""

    def __init__(self, *, api: k8s.Api, settings: Settings) -> None:
        self.api, self.settings = api, settings
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods_index = PodIndex()
        self.pods_synced = asyncio.Event()
        self.nodes_index: Any = None
        self.missing_nodes: dict[str, dt.datetime] = {}
        self.gone: dict[tuple[str, str], dict[str, str]] = {}
        self.node_ready: dict[str, bool] = {}
        self.expectations: dict[tuple[str, str], Expectations] = {}
        self.rejections: dict[tuple[str, str], int] = {}
        self._running: set[tuple[str, str]] = set()
        self._dirty: set[tuple[str, str]] = set()
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._sem = asyncio.Semaphore(settings.max_concurrent_reconciles)
        self.progress: dict[tuple[str, str], ProgressObservation] = {}
        """The newest read of each job's rank 0 /progress (poller.py), an observation like the pods."""
        self.active = 0

    # ------------------------------------------------------------ queueing

    def store_job(self, key: tuple[str, str], body: dict[str, Any]) -> None:
        """Keep the newest body we know: the watch may lag behind our own writes."""
        if _rv(body) >= _rv(self.jobs.get(key)):
            self.jobs[key] = body

    def forget(self, key: tuple[str, str]) -> None:
        self.jobs.pop(key, None)
        self.expectations.pop(key, None)
        self.gone.pop(key, None)
        self.rejections.pop(key, None)
        self.progress.pop(key, None)
        timer = self._timers.pop(key, None)
        if timer:
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

    def _fire(self, key: tuple[str, str]) -> None:
        self._timers.pop(key, None)
        self.enqueue(key)

    async def _run(self, key: tuple[str, str]) -> None:
        try:
            await self.pods_synced.wait()  # until the pod list is in, a missing pod proves nothing
            while True:
                self._dirty.discard(key)
                async with self._sem:
                    self.active += 1
                    try:
                        with metrics.RECONCILE_SECONDS.time():
                            await self.reconcile(key)
                    except Exception:  # a bug must not kill the loop of this job forever
                        metrics.ERRORS.labels("reconcile_crash").inc()
                        log.exception("reconcile of %s/%s crashed; retrying in 10s", *key)
                        self.enqueue(key, 10.0)
                    finally:
                        self.active -= 1
                if key not in self._dirty:
                    return
        finally:
            self._running.discard(key)

    async def resync(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resync_seconds)
            for key in list(self.jobs):
                self.enqueue(key)

    async def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        for task in list(self._tasks):
            task.cancel()

    # ------------------------------------------------------------ observing

    def observe(self, job: Job, now: dt.datetime) -> Observed:
        pods = [view for uid, view in self.pods_index[(job.namespace, job.name)] if uid == job.uid]
        exp = self.expectations.setdefault((job.namespace, job.name), Expectations())
        pods = exp.overlay(pods, now)
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
        since = self.missing_nodes.setdefault(name, now)
        return NodeView(name=name, exists=False, ready=False, since=since)

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
        if kind == "DELETED":
            self.pods_index.discard(key, name)
            if key in self.jobs and view is not None and view.disruption:
                self.gone.setdefault(key, {})[name] = view.disruption  # kept for the Preempted event
        else:
            if view is None:  # no longer labelled as ours
                self.pods_index.discard(key, name)
                return
            owner = next((o.get("uid") for o in meta.get("ownerReferences") or () if o.get("controller")), "")
            self.pods_index.put(key, name, (owner or "", view))
        if key in self.jobs:
            self.enqueue(key, POD_EVENT_DELAY)

    # ------------------------------------------------------------ reconciling

    async def reconcile(self, key: tuple[str, str]) -> None:
        for _ in range(CONFLICT_RETRIES):
            body = self.jobs.get(key)
            if body is None:
                return
            now = _now()
            job = Job.from_storage(body, default_image=self.settings.default_image)
            observed = self.observe(job, now)
            result = plan(job, observed, now)
            if not result.actions and not result.events:
                if result.requeue_after is not None:
                    self.enqueue(key, result.requeue_after + 0.05)
                return
            rv = str(body["metadata"].get("resourceVersion") or "")
            try:
                written = await k8s.apply(self.api, job, rv, result)
            except k8s.ConflictError:
                metrics.ERRORS.labels("conflict").inc()
                fresh = await self.api.get_job(*key)
                if fresh is None:
                    self.forget(key)
                    return
                self.jobs[key] = fresh
                continue
            except k8s.PermanentError as exc:
                metrics.ERRORS.labels("permanent").inc()
                log.error("job %s/%s cannot run: %s", job.namespace, job.name, exc)
                failed = fail_plan(job, observed, now, reason=exc.reason, message=str(exc))
                try:
                    written = await k8s.apply(self.api, job, rv, failed)
                except (k8s.ConflictError, k8s.TemporaryError, ApiException):
                    self.enqueue(key, 2.0)
                    return
            except k8s.RejectedError as exc:
                metrics.ERRORS.labels("rejected").inc()
                count = self.rejections[key] = self.rejections.get(key, 0) + 1
                delay = REJECTED_BACKOFF[min(count, len(REJECTED_BACKOFF)) - 1]
                log.warning("job %s/%s: pod create refused (%s); retrying in %.0fs", job.namespace, job.name,
                            exc.reason, delay)
                waiting = rejected_plan(job, now, reason=exc.reason, message=str(exc))
                try:
                    written = await k8s.apply(self.api, job, rv, waiting)
                    if written is not None:
                        self.store_job(key, written)
                except (k8s.ConflictError, k8s.TemporaryError, ApiException):
                    pass  # the retry below plans again from whatever is stored
                self.enqueue(key, delay)
                return
            except k8s.TemporaryError as exc:
                metrics.ERRORS.labels("temporary").inc()
                log.warning("reconcile of %s/%s: %s; retrying in %.0fs", job.namespace, job.name, exc, exc.delay)
                self.enqueue(key, exc.delay)
                return
            except ApiException as exc:
                metrics.ERRORS.labels("api").inc()
                log.warning("reconcile of %s/%s: HTTP %s %s; retrying", job.namespace, job.name, exc.status, exc.reason)
                self.enqueue(key, 5.0)
                return
            self._remember(key, result, now)
            metrics.count_plan(job.status, result)
            if any(isinstance(a, CreatePod) for a in result.actions):
                self.rejections.pop(key, None)
            if written is not None:
                self.store_job(key, written)
            for event in result.events:
                log.info("%s/%s %s: %s", job.namespace, job.name, event.reason, event.message)
            if result.requeue_after is not None:
                self.enqueue(key, result.requeue_after + 0.05)
            return
        self.enqueue(key, 1.0)

    def _remember(self, key: tuple[str, str], result: Plan, now: dt.datetime) -> None:
        exp = self.expectations.setdefault(key, Expectations())
        for action in result.actions:
            if isinstance(action, CreatePod):
                name = pod_name(key[1], action.attempt, action.rank)
                exp.created[name] = (now, PodView(name=name, attempt=action.attempt, rank=action.rank))
            elif isinstance(action, DeletePod):
                exp.deleted[action.name] = now


# ------------------------------------------------------------------ kopf glue

def _reconciler(memo: Any) -> Reconciler:
    return memo.reconciler


class NoDiffBase(kopf.DiffBaseStorage):
    """A diff-base that stores and builds nothing.

    kopf deep-copies every watched body into an "essence" on every event, for
    change-detecting handlers (on.create/update/field). kubetrain registers
    none (only event watchers and indexes: the planner compares observed state
    itself), so that copy was pure overhead: a quarter of the operator's CPU
    with 200 jobs x 4 pods in flight (py-spy).
    """

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: Any, nodes_by_name: kopf.Index, **_: Any) -> None:
    config: Settings = getattr(memo, "settings", None) or Settings.from_env()  # also under plain `kopf run`
    memo.settings = config
    settings.posting.enabled = False      # our own events only, with our reasons
    settings.persistence.diffbase_storage = NoDiffBase()
    # No namespace listing or CRD watching: the namespaces are exact names and the chart installs the
    # CRD before the operator, so the operator needs no cluster-wide read of namespaces or CRDs.
    settings.scanning.disabled = True
    settings.watching.server_timeout = 270
    settings.networking.connect_timeout = 10
    api = k8s.Api(k8s.load_client_config(threads=config.api_threads), threads=config.api_threads)
    memo.api = api
    rec = memo.reconciler = Reconciler(api=api, settings=config)
    rec.nodes_index = nodes_by_name
    memo.informer = PodInformer(k8s.load_client_config(threads=len(config.namespaces) + 1),
                                namespaces=config.namespaces, label_selector=f"{LABEL_MANAGED_BY}={MANAGED_BY}",
                                on_event=rec.pod_event)
    rec.pods_synced = memo.informer.synced
    memo.informer.start()
    memo.resync_task = asyncio.get_running_loop().create_task(rec.resync())
    metrics.watch(jobs=lambda: list(rec.jobs.values()), queue_depth=lambda: len(rec._running) - rec.active,
                  writes=lambda: dict(api.writes))
    metrics.LEADER.set(1)  # kopf starts only on the replica that leads (cli.py)
    memo.poller_task = poller.start(jobs=rec.jobs, pods_of=rec.pods_index.__getitem__, observations=rec.progress,
                                    wake=rec.enqueue, settings=config)
    log.info("kubetrain operator started (namespaces: %s)", ",".join(config.namespaces) or "all")


@kopf.on.cleanup()
async def cleanup(memo: Any, **_: Any) -> None:
    memo.informer.stop()
    memo.resync_task.cancel()
    if memo.poller_task is not None:
        memo.poller_task.cancel()
    await memo.reconciler.stop()
    log.info("API writes: %s", dict(memo.api.writes))
    memo.api.close()


@kopf.on.probe(id="api_writes")
async def api_writes(memo: Any, **_: Any) -> dict[str, int]:
    return dict(memo.api.writes)


@kopf.index("nodes")
async def nodes_by_name(name: str, status: kopf.Status, **_: Any) -> dict[str, NodeView]:
    ready = next((c for c in status.get("conditions") or () if c.get("type") == "Ready"), None)
    is_ready = bool(ready and ready.get("status") == "True")
    return {name: NodeView(name=name, ready=is_ready,
                           since=None if is_ready else parse_time((ready or {}).get("lastTransitionTime")))}


@kopf.on.event(GROUP, VERSION, PLURAL)
async def job_event(type: str, body: kopf.Body, namespace: str, name: str, memo: Any, **_: Any) -> None:
    rec = _reconciler(memo)
    key = (namespace, name)
    if type == "DELETED":
        rec.forget(key)
        return
    rec.store_job(key, dict(body))
    rec.enqueue(key)


@kopf.on.event("nodes")
async def node_event(type: str, name: str, status: kopf.Status, memo: Any, **_: Any) -> None:
    rec = _reconciler(memo)
    ready = type != "DELETED" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
    if type == "DELETED":
        rec.missing_nodes.setdefault(name, _now())
    if rec.node_ready.get(name) == ready and type != "DELETED":
        return  # a heartbeat, not a change
    rec.node_ready[name] = ready
    for key in rec.pods_index:
        if any(view.node_name == name for _, view in rec.pods_index[key]) and key in rec.jobs:
            rec.enqueue(key)
