"""The only module that writes to the Kubernetes API (with `k8s_kueue.py`, through `Api`, for Kueue's Workload).

It carries out a `Plan` in order: creations (AlreadyExists is success, so a re-run after a crash never
duplicates a pod), then the status as a merge patch guarded by the job's resourceVersion (a conflict means
we planned from stale state: the caller re-reads and re-plans) and at once its events (a plan without a status
write: at the end), then deletions (NotFound is success). Every write is counted in `Api.writes`, which the
liveness endpoint and the benchmark report.

Every client error is classified once, in `Api._call`, into the types of
`errors.py`; the functions here decide what each means for their request
(AlreadyExists on a create is success, a conflict on the status write makes
the caller re-read and re-plan, an invalid pod is a `PermanentError`); the Kueue
integration's calls (its Workload's create and patches, the reads of Kueue's
objects) are in `k8s_kueue.py`.
The Kubernetes client is synchronous; calls run in a bounded thread pool.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import datetime as dt
import logging
import socket
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson
import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain import builders, kueue, kueue_admission
from kubetrain.k8s_kueue import create_workload, patch_workload
from kubetrain.permissions import Permissions
from kubetrain.repeats import Repeats
from kubetrain.transport import Transport
from kubetrain.errors import (
    ApiError, ConflictError, ForbiddenError, InvalidError, NotFoundError, PermanentError, RefusedError, RejectedError,
    TemporaryError, classify, classify_forbidden, classify_unavailable, retry_later,
)
from kubetrain.api import GROUP, KIND, PLURAL, VERSION, Job
from kubetrain.values import format_time
from kubetrain.actions import (
    CreatePod, CreateService, CreateWorkload, DeleteJob, DeletePod, EnsureDeepSpeedConfigMap, Event, PatchStatus,
    PatchWorkload, Plan,
)

log = logging.getLogger("kubetrain.k8s")
MERGE_PATCH = "application/merge-patch+json"
EVENT_WARNING_EVERY = 300.0
"""Seconds between the WARNINGs of events that still cannot be posted (with how many failed meanwhile)."""


@dataclass
class Api:
    """A client plus the thread pool its blocking calls run in, and the write counter."""

    api_client: client.ApiClient
    threads: int = 32
    writes: collections.Counter[str] = field(default_factory=collections.Counter)
    instance: str = field(default_factory=socket.gethostname)
    permissions: Permissions = field(default_factory=Permissions)
    event_failures: Repeats = field(default_factory=lambda: Repeats(log, every=EVENT_WARNING_EVERY))
    """Events that could not be posted, as one trouble for all jobs (`post_event`)."""

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.scheduling = client.SchedulingV1Api(self.api_client)
        self.pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="kubetrain-api")
        self.transport = Transport.for_client(self.api_client)
        self._background: set[asyncio.Task[None]] = set()
        self._low = asyncio.Semaphore(max(2, self.threads // 4))
        self._urgent = 0
        self._urgent_idle = asyncio.Event()  # no pod write in flight
        self._urgent_idle.set()
        self._last_urgent = float("-inf")  # loop time the last pod write ended

    async def call(self, what: str, fn: Callable[..., Any], *args: Any, write: bool = True,
                   defer: bool | None = None, namespace: str = "", **kwargs: Any) -> Any:
        """Run one blocking client call in the pool; errors come as the types of `errors.py`.

        Pod writes (`_URGENT`) may use every thread. Every other call shares a quarter of them, and
        bookkeeping (`_DEFERRABLE`, or `defer=True`) first yields to pod writes (`_quiet`); `defer=False`
        sends a bookkeeping write at once (a status written as the intent of the deletes after it).

        Responses are returned as parsed JSON dicts: the client's model classes cost more CPU than everything
        else the operator does. A refusal by RBAC is reported once per call and `namespace` (`permissions.py`)."""
        if write:
            self.writes[what] += 1
        if what in _URGENT:
            self._urgent += 1
            self._urgent_idle.clear()
            try:
                return await self.permissions.watch(what, namespace, self._call(fn, args, kwargs))
            finally:
                self._urgent -= 1
                self._last_urgent = asyncio.get_running_loop().time()
                if not self._urgent:
                    self._urgent_idle.set()
        if what in _DEFERRABLE if defer is None else defer:
            await self._quiet()
        async with self._low:
            return await self.permissions.watch(what, namespace, self._call(fn, args, kwargs))

    async def _quiet(self) -> None:
        """Bookkeeping (`_DEFERRABLE`: status, events, services) yields to pod writes: on a big launch the API
        server's time goes to pods first, so apply -> pods created stays short. It waits until no
        pod write has been in flight for `QUIET_SECONDS` (a launch's creates come in bursts with
        short gaps between them), at most `LOW_PRIORITY_MAX_WAIT`, so a long burst cannot starve
        the status."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LOW_PRIORITY_MAX_WAIT
        while (left := deadline - loop.time()) > 0:
            if self._urgent:
                try:
                    await asyncio.wait_for(self._urgent_idle.wait(), left)
                except asyncio.TimeoutError:
                    return
                continue
            quiet_for = loop.time() - self._last_urgent
            if quiet_for >= QUIET_SECONDS:
                return
            await asyncio.sleep(min(QUIET_SECONDS - quiet_for, left))

    async def _call(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        what = getattr(fn, "__name__", "call")
        loop = asyncio.get_running_loop()

        def blocking() -> Any:
            if route := self.transport and self.transport.route(what, args, kwargs):
                data = self.transport.request(*route)  # the hot writes (transport.py)
            else:
                resp = fn(*args, _request_timeout=30, _preload_content=False, **kwargs)
                try:
                    data = resp.data
                finally:
                    resp.release_conn()
            return orjson.loads(data) if data else None

        try:
            return await loop.run_in_executor(self.pool, blocking)
        except ApiException as exc:
            raise classify(exc, what) from None
        except (OSError, ValueError, urllib3.exceptions.HTTPError) as exc:  # the client's network errors are urllib3's
            raise TemporaryError(f"{what}: {type(exc).__name__}: {exc}") from None

    def spawn(self, coro: Any) -> None:
        """Run a write that nobody waits for (events): it must not hold up a reconcile."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.api_client.close()

    # ------------------------------------------------------------- reads

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.call("get trainingjob", self.custom.get_namespaced_custom_object,
                                   GROUP, VERSION, namespace, PLURAL, name, write=False, namespace=namespace)
        except NotFoundError:
            return None
        except RefusedError as exc:
            raise retry_later(exc, f"get trainingjob {namespace}/{name}: HTTP {exc.status}") from None


async def apply(api: Api, job: Job, resource_version: str, plan: Plan,
                said: Callable[[dict[str, Any]], Any] = lambda _: None) -> dict[str, Any] | None:
    """Carry out a plan; returns the job body after the status write (None if none). Once the status is written,
    its events go out and `said(body)` runs, before the writes after it: those may fail, and the retry plans from
    the written status. Raises ConflictError when the status write met a newer resourceVersion (no events)."""
    written: dict[str, Any] | None = None
    actions = list(plan.actions)
    i = 0
    while i < len(actions):
        # Runs of creations or of deletions go out in parallel. In a run of creations the
        # configmap (mounted by the pods) goes first, then the pods, then the headless
        # service: the pods' DNS names are needed only once their containers run, and on a
        # big launch the API server's time is better spent on the next job's pods.
        kind = _CREATE if isinstance(actions[i], _CREATE) else DeletePod if isinstance(actions[i], DeletePod) else None
        if kind is not None:
            batch = []
            while i < len(actions) and isinstance(actions[i], kind):
                batch.append(actions[i])
                i += 1
            stages = [[a for a in batch if isinstance(a, t)] for t in _CREATION_ORDER] if kind is _CREATE else [batch]
            for stage in stages:
                await asyncio.gather(*(_do(api, job, a) for a in stage))
            continue
        action = actions[i]
        if isinstance(action, PatchStatus):
            # A status that comes before pod or Workload writes is their intent (Restarting, then the
            # deletes; Failed, then the deletes; Kueue's eviction): what follows it must not wait.
            intent = any(isinstance(a, _NOT_BOOKKEEPING) for a in actions[i + 1:])
            written = await patch_status(api, job, resource_version, action, defer=not intent)
            if written is None:
                return None  # the job is gone
            api.spawn(_post_events(api, job, plan.events))
            said(written)
        elif isinstance(action, DeleteJob):
            await _delete_job(api, job)
        elif isinstance(action, CreateWorkload):
            await create_workload(api, job, action)
        elif isinstance(action, PatchWorkload):
            await patch_workload(api, job.namespace, action)
        i += 1
    if plan.events and plan.status is None:
        api.spawn(_post_events(api, job, plan.events))
    return written


_CREATE = (CreateService, EnsureDeepSpeedConfigMap, CreatePod)
_CREATION_ORDER = (EnsureDeepSpeedConfigMap, CreatePod, CreateService)
_URGENT = frozenset({"create pod", "delete pod"})
"""Writes that may use every API thread."""
_DEFERRABLE = frozenset({"patch trainingjob/status", "create event", "create service"})
"""Bookkeeping no pod waits for (the Service is needed once containers run): these yield to pod writes
(`Api._quiet`). Reads and the other writes (the DeepSpeed ConfigMap a job's pods mount, Kueue's
Workload, a job's deletion) do not wait; all of them share a quarter of the API threads."""
_NOT_BOOKKEEPING = (CreatePod, DeletePod, CreateWorkload, PatchWorkload, DeleteJob)
LOW_PRIORITY_MAX_WAIT = 5.0
"""Longest a bookkeeping write waits for pod writes to pause (each write on its own: an apply's Service
and then its status can wait this long each)."""
QUIET_SECONDS = 0.1
"""How long no pod write must have been in flight before bookkeeping writes go out."""


async def _do(api: Api, job: Job, action: Any) -> None:
    if isinstance(action, CreatePod):
        await _create_pod(api, job, action)
    elif isinstance(action, CreateService):
        await _create(api, job, "create service", api.core.create_namespaced_service, builders.get_service(job=job),
                      api.core.read_namespaced_service)
    elif isinstance(action, EnsureDeepSpeedConfigMap):
        await _ensure_configmap(api, job)
    elif isinstance(action, DeletePod):
        await _delete_pod(api, job, action)


async def _post_events(api: Api, job: Job, events: tuple[Event, ...]) -> None:
    for event in events:  # in order: `kubectl get events` sorts by time
        await post_event(api, job, event)


async def patch_status(api: Api, job: Job, resource_version: str, action: PatchStatus, *,
                       defer: bool = True) -> dict[str, Any] | None:
    body = {"metadata": {"resourceVersion": resource_version}, "status": action.status.for_storage()}
    try:
        return await api.call("patch trainingjob/status", api.custom.patch_namespaced_custom_object_status,
                              GROUP, VERSION, job.namespace, PLURAL, job.name, body, _content_type=MERGE_PATCH,
                              defer=defer, namespace=job.namespace)
    except ConflictError as exc:
        raise ConflictError(f"trainingjob {job.namespace}/{job.name} changed since it was read",
                            status=exc.status, http_reason=exc.http_reason, api_message=exc.api_message) from None
    except NotFoundError:
        return None
    except RefusedError as exc:
        raise retry_later(exc, f"patch status of {job.namespace}/{job.name}: HTTP {exc.status} {exc.http_reason}") \
            from None


async def _create(api: Api, job: Job, what: str, fn: Callable[..., Any], body: dict[str, Any],
                  read: Callable[..., Any]) -> None:
    """Create `body` ("create <kind>"); one of that name that already exists is fine if it is this job's
    (`_check_owner`): deterministic names make creation idempotent."""
    try:
        await api.call(what, fn, job.namespace, body, namespace=job.namespace)
    except ConflictError:
        await _check_owner(api, job, what.split()[-1], body["metadata"]["name"], read)
    except InvalidError as exc:
        raise PermanentError("InvalidPodTemplate", f"{what} {body['metadata']['name']}: {exc.api_message}") from None
    except ForbiddenError as exc:
        raise classify_forbidden(exc.api_message, f"{what} {body['metadata']['name']}: {exc.api_message}") from None
    except NotFoundError as exc:
        raise TemporaryError(f"{what}: HTTP {exc.status} {exc.http_reason}") from None
    except TemporaryError as exc:
        raise classify_unavailable(exc, f"{what} {body['metadata']['name']}: {exc.api_message}") from None


async def _create_pod(api: Api, job: Job, action: CreatePod) -> None:
    pod = builders.get_pod(job=job, attempt=action.attempt, rank=action.rank)
    if action.admission is not None:  # Kueue's admission (flavors' node labels and tolerations)
        try:
            pod = kueue_admission.merge_into_pod(pod, action.admission)
        except kueue.KueueError as exc:
            raise PermanentError("KueueAdmissionConflict", str(exc)) from None
    await _create(api, job, "create pod", api.core.create_namespaced_pod, pod, api.core.read_namespaced_pod)


async def _check_owner(api: Api, job: Job, kind: str, name: str, read: Callable[..., Any]) -> None:
    """An object of this job's name (a pod, the Service, the DeepSpeed ConfigMap) already exists: carry on if
    it is this job's; wait while it belongs to an earlier TrainingJob of the same name (deleted and applied
    again: the garbage collector removes it soon), since adopting it would lose it moments later; refuse one
    that is not a TrainingJob's at all."""
    try:
        body = await api.call(f"get {kind}", read, name, job.namespace, write=False, namespace=job.namespace)
    except NotFoundError:
        raise TemporaryError(f"{kind} {job.namespace}/{name} was being deleted; creating it again") from None
    except RefusedError as exc:
        raise retry_later(exc, f"get {kind} {job.namespace}/{name}: HTTP {exc.status}") from None
    owner = next((o for o in (body or {}).get("metadata", {}).get("ownerReferences") or () if o.get("controller")),
                 None)
    if owner is not None and owner.get("uid") == job.uid:
        return
    if (owner is not None and owner.get("kind") == KIND and owner.get("name") == job.name
            and str(owner.get("apiVersion") or "").startswith(f"{GROUP}/")):
        raise RejectedError("NameInUse", f"{kind} {job.namespace}/{name} still belongs to an earlier TrainingJob "
                                         f"{job.name} (deleted and created again); waiting for it to be deleted")
    raise PermanentError("NameConflict", f"{kind} {job.namespace}/{name} already exists and does not belong to "
                                         f"this TrainingJob: delete it, or give the TrainingJob another name")


async def _ensure_configmap(api: Api, job: Job) -> None:
    body = builders.get_deepspeed_configmap(job=job)
    name = body["metadata"]["name"]
    try:
        try:
            await api.call("create configmap", api.core.create_namespaced_config_map, job.namespace, body,
                           namespace=job.namespace)
            return
        except ConflictError:  # it exists: if it is ours, bring its data up to date
            await _check_owner(api, job, "configmap", name, api.core.read_namespaced_config_map)
        await api.call("patch configmap", api.core.patch_namespaced_config_map, name, job.namespace,
                       {"data": body["data"]}, namespace=job.namespace)
    except InvalidError as exc:  # e.g. an inline config over the 1 MiB an object may hold: retrying cannot help
        raise PermanentError("InvalidDeepSpeedConfig", f"configmap {name}: {exc.api_message}") from None
    except RefusedError as exc:  # RBAC (reported once: permissions.py), the patch's deleted meanwhile, ...: again
        raise retry_later(exc, f"configmap {name}: {exc}") from None


async def _delete_pod(api: Api, job: Job, action: DeletePod) -> None:
    kwargs: dict[str, Any] = {"grace_period_seconds": 0} if action.force else {}
    try:
        await api.call("delete pod", api.core.delete_namespaced_pod, action.name, job.namespace,
                       namespace=job.namespace, **kwargs)
    except NotFoundError:
        pass
    except RefusedError as exc:
        raise retry_later(exc, f"delete pod {action.name}: HTTP {exc.status}") from None


async def _delete_job(api: Api, job: Job) -> None:
    try:
        await api.call("delete trainingjob", api.custom.delete_namespaced_custom_object, GROUP, VERSION,
                       job.namespace, PLURAL, job.name, propagation_policy="Background", namespace=job.namespace)
    except NotFoundError:
        pass
    except RefusedError as exc:
        raise retry_later(exc, f"delete trainingjob {job.name}: HTTP {exc.status}") from None


async def post_event(api: Api, job: Job, event: Event) -> None:
    """Post one Event on the TrainingJob. Losing one is not worth failing a reconcile over, nor a WARNING each: an
    API server away fails every job's events, so the first failure is warned, the rest quietly, with their count
    every `EVENT_WARNING_EVERY` seconds and once when events go through again (`repeats.py`)."""
    body = builders.get_event(job=job, type=event.type, reason=event.reason, message=event.message,
                              instance=api.instance, time=format_time(dt.datetime.now(dt.timezone.utc)))
    try:
        await api.call("create event", api.core.create_namespaced_event, job.namespace, body, namespace=job.namespace)
    except ApiError as exc:
        failure = f"could not post event {event.reason} for {job.namespace}/{job.name}: {exc}"
        if isinstance(exc, ForbiddenError) and exc.denial:  # reported once by the API client (permissions.py)
            log.debug("%s", failure)
        else:  # an API server away or failing fails every job's events alike: one trouble, whichever job it names
            api.event_failures.failed("events", failure, same=type(exc).__name__)
        return
    api.event_failures.succeeded("events", "events are posted again")

