"""The operator's Prometheus metrics (prometheus-client), and the HTTP endpoint that serves them.

What an operator of a shared cluster asks of a controller: how many jobs are in
which phase, how often they restart and why, how long a reconcile takes and how
many wait for one, how much it writes to the API server, what goes wrong, and
which replica leads. Names follow Prometheus' conventions: the `kubetrain_`
prefix, base units (`_seconds`), `_total` on counters.

Counters of things that happen (restarts, preemptions, errors, polls) are
incremented where they happen; gauges of state (jobs by phase, queue depth)
and the API write counts (kept by `k8s.Api`) are read at scrape time from the
sources `watch()` was given, so nothing is kept twice. The endpoint runs on its
own thread (prometheus-client's server): a scrape never waits for the event
loop, and every replica serves it, standbys included (`kubetrain_leader` 0).
Label values are bounded sets (phases, reasons, verbs), never job names.
"""

from __future__ import annotations

import errno
import logging
import re
import socket
from typing import Any, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kubetrain.status import Status
from kubetrain.actions import Plan

log = logging.getLogger("kubetrain.metrics")

REGISTRY = CollectorRegistry()
"""The operator's own registry (no process/platform collectors of the default one: the chart's
resource metrics come from the kubelet)."""

PHASES = ("New", "Queued", "Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed")
"""`New`: stored, no status written yet."""

RECONCILE_SECONDS = Histogram(
    "kubetrain_reconcile_duration_seconds", "Time one reconcile of one job took (plan and its API writes).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=REGISTRY)
RESTARTS = Counter(
    "kubetrain_job_restarts", "Attempts started after a job's first, by why the previous one ended "
    "(Preempted, BackoffRestart, Resumed).", ["reason"], registry=REGISTRY)
PREEMPTIONS = Counter(
    "kubetrain_job_preemptions", "Preemptions counted in jobs' status.preemptions, by cause "
    "(PreemptionByScheduler, EvictionByEvictionAPI, DeletionByTaintManager, NodeLost, Deleted, ...).",
    ["reason"], registry=REGISTRY)
ERRORS = Counter(
    "kubetrain_errors", "Errors by kind: conflict, temporary, forbidden, permanent, rejected, api, reconcile_crash.",
    ["kind"], registry=REGISTRY)
LEADER = Gauge("kubetrain_leader", "1 while this replica reconciles (holds the Lease, or runs without "
                                   "leader election), 0 while it stands by.", registry=REGISTRY)
PROGRESS_POLLS = Counter(
    "kubetrain_progress_polls", "Reads of node rank 0's /progress by result (ok, or why not: Timeout, "
    "ConnectionFailed, HTTPError, InvalidRecord).", ["result"], registry=REGISTRY)
PROGRESS_POLL_SECONDS = Histogram(
    "kubetrain_progress_poll_duration_seconds", "Time one read of a rank 0's /progress took.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=REGISTRY)

_REASON = re.compile(r"^[A-Za-z][A-Za-z0-9]{0,62}$")


def bounded(reason: str) -> str:
    """A label value from a reason: CamelCase words pass, anything else is `Other` (a pod's
    DisruptionTarget reason is written by whoever may patch pod status)."""
    return reason if _REASON.match(reason or "") else "Other"


def count_plan(before: Status, plan: Plan) -> None:
    """Count what an applied plan did to a job: preemptions (by the Preempted event's cause) and
    restarts (by the reason of the restart the previous attempt was ended for). Called once per
    plan whose status write succeeded, so a re-plan after a conflict does not count twice."""
    after = plan.status
    if after is None:
        return
    if after.preemptions > before.preemptions:
        cause = next((e.cause for e in plan.events if e.reason == "Preempted" and e.cause), "Unknown")
        PREEMPTIONS.labels(bounded(cause)).inc(after.preemptions - before.preemptions)
    if after.restarts > before.restarts:
        cond = before.condition("Restarting")
        reason = cond.reason if cond is not None and cond.status == "True" else (
            "Resumed" if before.phase == "Suspended" else "Unknown")
        RESTARTS.labels(bounded(reason)).inc(after.restarts - before.restarts)


class _State(Collector):
    """Gauges and counters read from the operator's own state at scrape time."""

    def __init__(self, *, jobs: Callable[[], Iterable[Mapping[str, Any]]], queue_depth: Callable[[], int],
                 writes: Callable[[], Mapping[str, int]]) -> None:
        self.jobs, self.queue_depth, self.writes = jobs, queue_depth, writes

    def collect(self) -> Iterable[Any]:
        by_phase = dict.fromkeys(PHASES, 0)
        for body in self.jobs():
            phase = str((body.get("status") or {}).get("phase") or "New")
            by_phase[phase if phase in by_phase else "New"] += 1
        jobs = GaugeMetricFamily("kubetrain_jobs", "TrainingJobs the operator manages, by phase.", labels=["phase"])
        for phase, count in by_phase.items():
            jobs.add_metric([phase], count)
        yield jobs
        yield GaugeMetricFamily("kubetrain_reconcile_queue_depth",
                                "Jobs waiting for a reconcile (queued, not yet running).", value=self.queue_depth())
        writes = CounterMetricFamily("kubetrain_api_writes", "Writes to the Kubernetes API by verb and kind "
                                     "(create pod, patch trainingjob/status, ...).", labels=["verb", "kind"])
        for what, count in sorted(dict(self.writes()).items()):
            verb, _, kind = what.partition(" ")
            writes.add_metric([verb, kind or "unknown"], count)
        yield writes


_watched: list[_State] = []


def watch(*, jobs: Callable[[], Iterable[Mapping[str, Any]]], queue_depth: Callable[[], int],
          writes: Callable[[], Mapping[str, int]]) -> None:
    """Expose the operator's state (replacing what an earlier start exposed). The callables run on
    the endpoint's thread: they must only copy (a `list(dict.values())` is atomic under the GIL)."""
    for old in _watched:
        REGISTRY.unregister(old)
    _watched.clear()
    state = _State(jobs=jobs, queue_depth=queue_depth, writes=writes)
    REGISTRY.register(state)
    _watched.append(state)


def serve(port: int, address: str | None = None) -> Any:
    """Serve /metrics on a thread of its own; returns the server (None when `port` is 0). Without an
    `address`, on IPv6 and IPv4 both where the node has both (an IPv6-only cluster scrapes the pod's
    IPv6 address), else on IPv4. A port already taken is logged, not fatal: metrics are not worth an
    operator that does not start."""
    if not port:
        return None
    candidates = [address] if address else (["::", "0.0.0.0"] if socket.has_dualstack_ipv6() else ["0.0.0.0"])
    try:
        for address in candidates:
            try:
                server, _thread = start_http_server(port, addr=address, registry=REGISTRY)
                break
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE or address == candidates[-1]:
                    raise
    except OSError as exc:
        log.warning("metrics endpoint on port %s not served: %s", port, exc)
        return None
    log.info("metrics on http://%s:%s/metrics", address, port)
    return server
