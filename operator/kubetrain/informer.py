"""List + watch the operator's pods and TrainingJobs into memory, the way client-go's informers do.

Pods are the bulk of what the operator watches: a launch of 200 four-node jobs
is some 3,000 pod events in a few seconds. Through kopf each one costs a full
handler cycle (cause, state, patch and logger objects) plus a stdlib JSON parse;
here it is an orjson parse on a reader thread and one dict update on the event
loop, which more than halves the operator's CPU on big launches (see
benchmarks/README.md). The TrainingJobs come the same way (`JobInformer`);
kopf still watches the nodes.

Semantics, per watched scope (one namespace, or the whole cluster):
- LIST (paginated), then WATCH from the list's resourceVersion with bookmarks;
  a watch that ends is resumed from the last resourceVersion seen (one that
  ended within a second with nothing in it backs off as an error does, as
  client-go's reflector does: else a server or proxy that closes every watch at
  once meets a loop of requests as fast as they can be sent);
- 410 Gone (the resourceVersion is too old, as an HTTP status or an ERROR
  event in the stream) means LIST again: objects that
  vanished meanwhile are delivered as DELETED, so nothing is missed;
- other errors back off (1 s doubling to 30 s) and LIST again (client-go's
  reflector, too, lists again after most watch errors): a watch resumed from
  where it broke would bring what happened meanwhile only after it answered
  (see `watching`).
`synced` is set once every scope has listed: until then the store is
incomplete and nobody may plan from it (a missing pod would look deleted).
`watching(namespace)` is clear while that namespace's watch is down (an error,
a relist) and set again once it has listed again: a store no event reaches is
stale in the same way (a pod created meanwhile never shows up, and once the
reconciler's expectation of it expires it would read as deleted by someone
else). Not once a watch answers again: its first events may still be on their
way while the namespace's jobs are already being planned.

Events reach `on_event(type, obj)` on the event loop, in order per scope.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any, Callable

import orjson
from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain.api import GROUP, PLURAL, VERSION

log = logging.getLogger("kubetrain.informer")
WATCH_SECONDS = 270
PAGE = 500
MAX_BACKOFF = 30.0
SHORT_WATCH = 1.0
DOWN_ERROR_SECONDS = 300.0
"""A scope's watch down this long is logged at ERROR once (its jobs wait: a RoleBinding removed, an API server gone)."""

OnEvent = Callable[[str, dict[str, Any]], None]


class PodInformer:
    """Pods matching `label_selector` in `namespaces` (empty: cluster-wide)."""

    what = "pod"
    down_means = "jobs there are not reconciled until it is back"
    """What a watch down for DOWN_ERROR_SECONDS holds up (its ERROR says it)."""

    def __init__(self, api_client: client.ApiClient, *, namespaces: tuple[str, ...], label_selector: str,
                 on_event: OnEvent) -> None:
        self.core = client.CoreV1Api(api_client)
        self.scopes: tuple[str | None, ...] = tuple(namespaces) or (None,)
        self.label_selector = label_selector
        self.on_event = on_event
        self.synced = asyncio.Event()
        self._unsynced = set(self.scopes)
        self._watching = {s: asyncio.Event() for s in self.scopes}  # set while the scope's store is current
        self._down: set[str | None] = set()  # scopes whose watch broke (reader threads' side)
        self._down_since: dict[str | None, float] = {}  # when each scope's store last went stale
        self._known: dict[str | None, dict[tuple[str, str], dict[str, Any]]] = {s: {} for s in self.scopes}
        self._queue: collections.deque[tuple[str, str | None, Any]] = collections.deque()
        self._scheduled = False
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for scope in self.scopes:
            threading.Thread(target=self._run, args=(scope,), daemon=True,
                             name=f"kubetrain-watch-{self.what}-{scope or 'all'}").start()

    def watching(self, namespace: str) -> asyncio.Event:
        """Set while the store of `namespace` is current: listed, and its watch up."""
        return self._watching[namespace if namespace in self._watching else None]

    def stop(self) -> None:
        """Nothing more is delivered; readers notice at their next event or watch timeout (daemon threads)."""
        self._stop.set()

    # ------------------------------------------------------------ reader threads

    def _run(self, scope: str | None) -> None:
        rv: str | None = None
        backoff = 1.0
        while not self._stop.is_set():
            opened: float | None = None  # when the watch answered 200 (not yet): a refusal, however slow, never was
            try:
                if rv is None:
                    rv = self._list(scope)
                started, before = time.monotonic(), rv
                resp = self._open_watch(scope, rv)
                opened = time.monotonic()
                rv = self._watch(scope, resp, rv)
                if rv == before and time.monotonic() - started < SHORT_WATCH and not self._stop.is_set():
                    log.warning("%s watch (%s) ended at once with nothing in it; retrying in %.0fs", self.what,
                                scope or "all namespaces", backoff)
                    backoff = self._pause(backoff)
                    continue
                backoff = 1.0
                self._watch_up(scope)  # a watch that ran its course, even a quiet one
            except ApiException as exc:
                self._broken(scope, watched_since=opened)
                rv = None  # list again: see the module's docstring
                if exc.status == 410:  # our resourceVersion (or continue token) expired: list again
                    # Rare (watch bookmarks keep the version fresh); a relist re-delivers every object, a
                    # burst of reconciles worth knowing about when a phase costs more than it should.
                    log.info("%s watch (%s): resourceVersion expired (410), listing again", self.what,
                             scope or "all namespaces")
                    continue
                log.warning("%s watch (%s): HTTP %s %s; retrying in %.0fs", self.what, scope or "all namespaces",
                            exc.status, exc.reason, backoff)
                backoff = self._pause(backoff)
            except Exception as exc:  # noqa: BLE001  (network trouble: list again, never die)
                self._broken(scope, watched_since=opened)
                rv = None
                log.warning("%s watch (%s): %s: %s; retrying in %.0fs", self.what, scope or "all namespaces",
                            type(exc).__name__, exc, backoff)
                backoff = self._pause(backoff)

    def _broken(self, scope: str | None, *, watched_since: float | None = None) -> None:
        """No event reaches this scope's store until it has listed again: stale (see the module's docstring).
        `watched_since`: when the watch that broke was opened (None: the list failed, or the watch was refused)."""
        if watched_since is not None and time.monotonic() - watched_since >= SHORT_WATCH:
            self._watch_up(scope)  # it was up, if quiet: a new outage starts here
        if scope not in self._down:
            self._down.add(scope)
            self._down_since.setdefault(scope, time.monotonic())
            self._post("STALE", scope, None)
        since = self._down_since.get(scope)
        if since is not None and since >= 0 and time.monotonic() - since >= DOWN_ERROR_SECONDS:
            self._down_since[scope] = -1.0  # once per outage
            log.error("%s watch (%s) has been down for %.0fs: %s (the operator's RBAC there, the API server?)",
                      self.what, scope or "all namespaces", time.monotonic() - since, self.down_means)

    def _watch_up(self, scope: str | None) -> None:
        """The outage is over once a watch delivers, stays open, or runs its course; not once a list works: RBAC
        that grants list but not watch, or a proxy that refuses watches, lists fine every time and is never current."""
        self._down_since.pop(scope, None)

    def _pause(self, backoff: float) -> float:
        self._stop.wait(backoff)
        return min(MAX_BACKOFF, backoff * 2)

    def _call(self, scope: str | None, **kwargs: Any) -> Any:
        kwargs.update(label_selector=self.label_selector, _preload_content=False)
        if scope is None:
            return self.core.list_pod_for_all_namespaces(**kwargs)
        return self.core.list_namespaced_pod(scope, **kwargs)

    def _list(self, scope: str | None) -> str:
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"limit": PAGE, "_request_timeout": 60}
            if token:
                kwargs["_continue"] = token
            resp = self._call(scope, **kwargs)
            try:
                page = orjson.loads(resp.data)
            finally:
                resp.release_conn()
            items.extend(page.get("items") or ())
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                self._down.discard(scope)  # current once listed: a watch that fails next is down again
                self._post("SYNC", scope, items)
                return str(meta.get("resourceVersion") or "")

    def _open_watch(self, scope: str | None, rv: str) -> Any:
        """The watch's response once the API server answered 200; an error status raises (it never opened)."""
        return self._call(scope, watch=True, resource_version=rv, allow_watch_bookmarks=True,
                          timeout_seconds=WATCH_SECONDS, _request_timeout=(10, WATCH_SECONDS + 30))

    def _watch(self, scope: str | None, resp: Any, rv: str) -> str:
        up = False
        try:
            for line in resp:
                if self._stop.is_set():
                    break
                if not line.strip():
                    continue
                event = orjson.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # a Status object; 410 means the resourceVersion expired
                    raise ApiException(status=obj.get("code") or 500, reason=obj.get("message") or "watch error")
                rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                if not up:
                    up = True
                    self._watch_up(scope)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._post(kind, scope, obj)
        finally:
            resp.release_conn()
        return rv

    def _post(self, kind: str, scope: str | None, payload: Any) -> None:
        """Hand over to the event loop; one wake-up drains everything queued by then."""
        self._queue.append((kind, scope, payload))
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: the operator is exiting
                self._stop.set()

    # ------------------------------------------------------------ event loop side

    def _drain(self) -> None:
        self._scheduled = False
        while self._queue and not self._stop.is_set():  # stopped: the operator is shutting down
            kind, scope, payload = self._queue.popleft()
            try:
                if kind == "SYNC":
                    self._replace(scope, payload)
                elif kind == "STALE":
                    self._watching[scope].clear()
                else:
                    self._deliver(kind, scope, payload)
            except Exception:  # a bad object or a handler bug must not stop the stream
                log.exception("%s event %s could not be handled", self.what, kind)

    def _deliver(self, kind: str, scope: str | None, obj: dict[str, Any]) -> None:
        if kind == "DELETED":
            self._known[scope].pop(key_of(obj), None)
        else:
            meta = obj.get("metadata") or {}
            self._known[scope][key_of(obj)] = {"labels": meta.get("labels") or {}, "uid": meta.get("uid") or ""}
        try:
            self.on_event(kind, obj)
        except Exception:  # a bad object or a handler bug must not stop the stream, nor the rest of a relist
            log.exception("%s event %s of %s/%s could not be handled", self.what, kind, *key_of(obj))

    def _gone(self, scope: str | None, key: tuple[str, str], kept: dict[str, Any]) -> None:
        # client-go's DeletedFinalStateUnknown: the object went while the watch was down, its last state is
        # not in this body (only its name, labels and uid); a handler takes it from what it kept itself.
        self._deliver("DELETED", scope, {"metadata": {"namespace": key[0], "name": key[1], **kept}, "status": {},
                                         FINAL_STATE_UNKNOWN: True})

    def _replace(self, scope: str | None, items: list[dict[str, Any]]) -> None:
        """A (re)list: what is listed is MODIFIED, what vanished since is DELETED (and so is an object of a
        listed name with another uid: deleted and re-created while the watch was down)."""
        listed = {key_of(item) for item in items}
        for key, kept in list(self._known[scope].items()):
            if key not in listed:
                self._gone(scope, key, kept)
        for item in items:
            key, uid = key_of(item), (item.get("metadata") or {}).get("uid")
            kept = self._known[scope].get(key)
            if kept and kept["uid"] and uid and kept["uid"] != uid:  # deleted and re-created meanwhile
                self._gone(scope, key, kept)
            self._deliver("MODIFIED", scope, item)
        self._watching[scope].set()
        self._unsynced.discard(scope)
        if not self._unsynced and not self.synced.is_set():
            self.synced.set()
            log.info("%s informer synced (%d)", self.what, sum(len(k) for k in self._known.values()))


FINAL_STATE_UNKNOWN = "kubetrain.io/final-state-unknown"
"""Key set (True) in the body of a DELETED event made up by a relist: the object vanished while the
watch was down, and the body has only its name, labels and uid, no status or owner."""


def key_of(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


KUEUE_GROUP, KUEUE_VERSION, WORKLOADS = "kueue.x-k8s.io", "v1beta2", "workloads"


class WorkloadInformer(PodInformer):
    """Kueue's Workloads of queued jobs (issue 14), with the same list+watch semantics. The operator
    starts it at once where Kueue's API is served, else when it first meets a job labelled for Kueue (a
    cluster without Kueue never watches a missing resource); its events only wake the owning job up (the
    reconcile reads the Workload) or let go of the Workload of a job that is gone."""

    what = "Workload"
    down_means = ("Kueue's decisions reach the queued jobs there only at the resync (KUBETRAIN_RESYNC_SECONDS), "
                  "and the Workload of a job deleted meanwhile stays Terminating until it is back")

    def __init__(self, api_client: client.ApiClient, *, namespaces: tuple[str, ...], on_event: OnEvent) -> None:
        super().__init__(api_client, namespaces=namespaces, label_selector="kueue.x-k8s.io/job-uid",
                         on_event=on_event)
        self.custom = client.CustomObjectsApi(api_client)

    def _call(self, scope: str | None, **kwargs: Any) -> Any:
        kwargs.update(label_selector=self.label_selector, _preload_content=False)
        if scope is None:
            return self.custom.list_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, WORKLOADS, **kwargs)
        return self.custom.list_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, scope, WORKLOADS, **kwargs)


class JobInformer(PodInformer):
    """The TrainingJobs, with the same list+watch semantics. Through kopf each job event cost a handler cycle
    and a stdlib JSON parse on the event loop, over half of its CPU on a launch of 200 jobs (each job is
    added, then patched twice), and waited out kopf's batch window before its reconcile could start."""

    what = "TrainingJob"

    def __init__(self, api_client: client.ApiClient, *, namespaces: tuple[str, ...], on_event: OnEvent) -> None:
        super().__init__(api_client, namespaces=namespaces, label_selector="", on_event=on_event)
        self.custom = client.CustomObjectsApi(api_client)

    def _call(self, scope: str | None, **kwargs: Any) -> Any:
        kwargs["_preload_content"] = False
        if scope is None:
            return self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, **kwargs)
        return self.custom.list_namespaced_custom_object(GROUP, VERSION, scope, PLURAL, **kwargs)
