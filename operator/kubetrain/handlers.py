"""Thin kopf glue: settings, startup and cleanup, and the watches that feed the reconciler.

kopf watches the nodes (node health is a kopf index); our pods and the
TrainingJobs come from `informer.py`, a plain list+watch (kopf's per-event
cost dominated the operator's CPU on big launches). Every event is handed to
`reconciler.Reconciler`, which keeps the observed world in memory and runs
plan -> apply per job.

kopf itself writes nothing to our objects here: only event watchers and an
index are used (no finalizers, no progress annotations); all writes go
through `k8s.py`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any

import kopf

from kubetrain import k8s, metrics, poller, transport
from kubetrain.api import LABEL_MANAGED_BY, MANAGED_BY
from kubetrain.config import Settings
from kubetrain.informer import JobInformer, PodInformer, WorkloadInformer, key_of
from kubetrain.observe import NodeView, node_view
from kubetrain.reconciler import Reconciler, utcnow

log = logging.getLogger("kubetrain.operator")
NODES_LISTED_WARNING_SECONDS = 60.0


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
    api = k8s.Api(transport.load_client_config(threads=config.api_threads), threads=config.api_threads)
    memo.api = api
    rec = memo.reconciler = Reconciler(api=api, settings=config)
    rec.nodes_index = nodes_by_name
    def watch_client() -> Any:  # an informer's own client: a reader thread per namespace
        return transport.load_client_config(threads=len(config.namespaces) + 1)

    memo.informer = PodInformer(watch_client(), namespaces=config.namespaces,
                                label_selector=f"{LABEL_MANAGED_BY}={MANAGED_BY}", on_event=rec.pod_event)
    rec.pods_synced, rec.pods_watching = memo.informer.synced, memo.informer.watching
    memo.informer.start()
    memo.job_informer = JobInformer(watch_client(), namespaces=config.namespaces,
                                    on_event=lambda kind, body: rec.job_event(kind, key_of(body), body))
    memo.job_informer.start()
    memo.workload_informer = None

    def watch_workloads() -> None:  # Kueue's Workloads: at once where Kueue is served, else once a job asks for it
        memo.workload_informer = WorkloadInformer(watch_client(), namespaces=config.namespaces,
                                                  on_event=rec.workload_event)
        memo.workload_informer.start()

    rec.start_workload_watch = watch_workloads
    rec.watch_workloads_if_served(namespace=next(iter(config.namespaces), ""), jobs_listed=memo.job_informer.synced)

    def check_nodes() -> None:  # no node counts as missing until kopf has listed them (Reconciler.node_view)
        if not rec.nodes_indexed:
            log.warning("the nodes are not listed after %.0f s (RBAC on nodes? the API server?): a lost node goes "
                        "unnoticed until they are", NODES_LISTED_WARNING_SECONDS)

    memo.nodes_check = asyncio.get_running_loop().call_later(NODES_LISTED_WARNING_SECONDS, check_nodes)
    memo.resync_task = asyncio.get_running_loop().create_task(rec.resync())
    metrics.watch(jobs=lambda: list(rec.jobs.values()), queue_depth=lambda: rec.queue_depth,
                  writes=lambda: dict(api.writes))
    metrics.LEADER.set(1)  # kopf starts only on the replica that leads (cli.py)
    memo.poller_task = poller.start(jobs=rec.jobs, pods_of=rec.pods_index.__getitem__, observations=rec.progress,
                                    wake=rec.enqueue, settings=config)
    log.info("kubetrain operator started (namespaces: %s)", ",".join(config.namespaces) or "all")


@kopf.on.cleanup()
async def cleanup(memo: Any, **_: Any) -> None:
    memo.informer.stop()
    memo.job_informer.stop()
    if memo.workload_informer is not None:
        memo.workload_informer.stop()
    memo.resync_task.cancel()
    memo.nodes_check.cancel()
    if memo.poller_task is not None:
        memo.poller_task.cancel()
    await memo.reconciler.stop()
    log.info("API writes: %s", dict(memo.api.writes))
    memo.api.close()


@kopf.on.probe(id="api_writes")
async def api_writes(memo: Any, **_: Any) -> dict[str, int]:
    # A probe may come before the startup handler has set memo.api: it must answer, not raise. kopf retries a
    # raising probe handler with backoff while it holds the lock every /healthz request waits on, so one early
    # probe left the endpoint hanging and the kubelet killed a healthy operator (seen in the e2e tier).
    api = getattr(memo, "api", None)
    return dict(api.writes) if api is not None else {}


_NOT_READY_SEEN: dict[str, dt.datetime] = {}
"""When this operator first saw each not-Ready node, for those whose Ready condition has no time."""


@kopf.index("nodes")
async def nodes_by_name(name: str, status: kopf.Status, **_: Any) -> dict[str, NodeView]:
    return {name: node_view(name, status.get("conditions"), _NOT_READY_SEEN, utcnow())}


@kopf.on.event("nodes")
async def node_event(type: str, name: str, status: kopf.Status, memo: Any, **_: Any) -> None:
    if type == "DELETED":
        _NOT_READY_SEEN.pop(name, None)
    ready = type != "DELETED" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
    _reconciler(memo).node_event(type, name, ready)
