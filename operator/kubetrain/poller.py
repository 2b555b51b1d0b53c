"""Reads node rank 0's /progress of every running job, on a bounded schedule.

Training pods have no Kubernetes API rights (docs/contract.md), so their progress
is pulled, not pushed: the operator reads `GET http://<pod IP>:<metrics port>/progress`
of each running job's node rank 0 and hands the result to the reconciler as an
observation; the planner writes it into status (`progress.py`). Bounds:

- each job is read at most once per interval (KUBETRAIN_PROGRESS_INTERVAL_SECONDS),
  each job at its own offset inside the interval (so 200 jobs are not read, nor
  written, in one burst), hence at most one progress write per job per interval;
- every read has a short total timeout (KUBETRAIN_PROGRESS_TIMEOUT_SECONDS, at most
  half the interval), and at most KUBETRAIN_PROGRESS_CONCURRENCY are in flight;
- reads are aiohttp coroutines on the operator's event loop: a slow or silent pod
  holds one connection slot, never a reconcile, a thread or the loop;
- a job whose read is still in flight is not read again.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import aiohttp

from kubetrain import metrics
from kubetrain.config import Settings
from kubetrain.observe import PodView
from kubetrain.progress import (
    MAX_PROGRESS_BYTES, ProgressObservation, RecordError, parse_progress_record, progress_url,
)

log = logging.getLogger("kubetrain.progress")
Key = tuple[str, str]


@dataclass(frozen=True)
class Target:
    """One job's node rank 0 to read: its URL, or why it cannot be read (`problem`)."""

    key: Key
    attempt: int
    pod: str
    url: str = ""
    problem: tuple[str, str] | None = None


def select_targets(jobs: Iterable[tuple[Key, Mapping[str, Any]]],
                   pods_of: Callable[[Key], Iterable[tuple[str, PodView]]], *, template: str = "") -> list[Target]:
    """The rank 0 pods to read: of stored jobs in phase Running, the current attempt's rank 0 that
    runs (and is this job's: its controller uid). A pod without an IP or a `metrics` port (created
    by an operator before this one) is a target with a problem, so status says why nothing is read.
    Reads a few keys of the stored bodies, never parses a spec: it runs every tick for every job."""
    out = []
    for key, body in jobs:
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        if status.get("phase") != "Running" or meta.get("deletionTimestamp"):
            continue
        attempt, uid = status.get("attempt"), meta.get("uid") or ""
        if not isinstance(attempt, int):
            continue
        rank0 = next((view for owner, view in pods_of(key) if owner == uid and view.attempt == attempt
                      and view.rank == 0 and view.phase == "Running" and not view.terminating), None)
        if rank0 is None:
            continue
        if rank0.metrics_port is None:
            out.append(Target(key, attempt, rank0.name, problem=(
                "NoMetricsPort", f"pod {rank0.name} has no container port named metrics")))
        elif not rank0.pod_ip and not template:
            out.append(Target(key, attempt, rank0.name, problem=("NoPodIP", f"pod {rank0.name} has no IP yet")))
        else:
            url = progress_url(ip=rank0.pod_ip or "", port=rank0.metrics_port, template=template,
                               namespace=key[0], job=key[1], pod=rank0.name)
            out.append(Target(key, attempt, rank0.name, url=url))
    return out


class ProgressPoller:
    """The schedule and the reads; `targets` and `deliver` connect it to the reconciler."""

    def __init__(self, *, targets: Callable[[], list[Target]],
                 deliver: Callable[[Key, ProgressObservation], None], interval: float, timeout: float,
                 concurrency: int) -> None:
        self.targets, self.deliver = targets, deliver
        self.interval, self.timeout = interval, timeout
        self._sem = asyncio.Semaphore(concurrency)
        self._concurrency = concurrency
        self._due: dict[tuple[Key, str], float] = {}
        self._inflight: set[Key] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None

    def _offset(self, key: Key, pod: str) -> float:
        """Where in the interval this job is read: fixed per pod, spread evenly over jobs."""
        return (zlib.crc32(f"{key[0]}/{key[1]}/{pod}".encode()) % 1000) / 1000 * self.interval

    async def open(self) -> None:
        # No keep-alive: a pod is read once per interval, and idle connections to hundreds of pods
        # would only hold file descriptors.
        connector = aiohttp.TCPConnector(limit=self._concurrency, force_close=True)
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._session is not None:
            await self._session.close()

    async def run(self) -> None:
        await self.open()
        try:
            while True:
                self.poll_due(time.monotonic())
                await asyncio.sleep(min(1.0, self.interval / 10))
        finally:
            await self.close()

    def poll_due(self, now: float) -> None:
        """Start a read of every target whose time has come (and none of a job still being read)."""
        current = {(t.key, t.pod): t for t in self.targets()}
        for gone in [k for k in self._due if k not in current]:
            del self._due[gone]
        for ident, target in current.items():
            due = self._due.setdefault(ident, now + self._offset(*ident))
            if due > now or target.key in self._inflight:
                continue
            self._due[ident] = max(due + self.interval, now)
            self._inflight.add(target.key)
            task = asyncio.get_running_loop().create_task(self._poll(target))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _poll(self, target: Target) -> None:
        try:
            async with self._sem:
                observation = await self.read(target)
            metrics.PROGRESS_POLLS.labels(observation.reason or "ok").inc()
            self.deliver(target.key, observation)
        except Exception:  # a bug in one read must not stop the others
            log.exception("reading the progress of %s/%s failed", *target.key)
        finally:
            self._inflight.discard(target.key)

    async def read(self, target: Target) -> ProgressObservation:
        """One read of a target: an observation with a report, or with why there is none."""
        now = dt.datetime.now(dt.timezone.utc)
        if target.problem is not None:
            return ProgressObservation(target.attempt, now, reason=target.problem[0], message=target.problem[1])
        if self._session is None:
            raise RuntimeError("the poller is not running")
        started = time.monotonic()
        try:
            async with self._session.get(target.url, allow_redirects=False) as resp:
                if resp.status != 200:
                    return ProgressObservation(target.attempt, now, reason="HTTPError",
                                               message=f"GET /progress of pod {target.pod}: HTTP {resp.status}")
                body = await resp.content.read(MAX_PROGRESS_BYTES + 1)
            report = parse_progress_record(body, at=now, attempt=target.attempt)
        except asyncio.TimeoutError:
            return ProgressObservation(target.attempt, now, reason="Timeout",
                                       message=f"pod {target.pod} did not answer within {self.timeout:g}s")
        except (aiohttp.ClientError, OSError) as exc:
            return ProgressObservation(target.attempt, now, reason="ConnectionFailed",
                                       message=f"pod {target.pod}: {type(exc).__name__}: {exc}")
        except RecordError as exc:
            return ProgressObservation(target.attempt, now, reason="InvalidRecord",
                                       message=f"pod {target.pod}: /progress {exc}")
        finally:
            metrics.PROGRESS_POLL_SECONDS.observe(time.monotonic() - started)
        return ProgressObservation(target.attempt, now, report=report)


def start(*, jobs: Mapping[Key, Mapping[str, Any]], pods_of: Callable[[Key], Iterable[tuple[str, PodView]]],
          observations: dict[Key, ProgressObservation], wake: Callable[[Key], None],
          settings: Settings) -> asyncio.Task[None] | None:
    """Start reading the progress of the stored `jobs`: each read is stored in `observations` and
    `wake`s the job, so the planner writes progress like any other status. None when it is off."""
    if not settings.progress_interval_seconds:
        return None
    if settings.test_progress_url:
        log.warning("KUBETRAIN_TEST_PROGRESS_URL is set: progress is read from %s, not from the pods "
                    "(a test hook; never set it in production)", settings.test_progress_url)

    def deliver(key: Key, observation: ProgressObservation) -> None:
        if key in jobs:
            observations[key] = observation
            wake(key)

    poller = ProgressPoller(
        targets=lambda: select_targets(list(jobs.items()), pods_of, template=settings.test_progress_url),
        deliver=deliver, interval=settings.progress_interval_seconds, timeout=settings.progress_timeout_seconds,
        concurrency=settings.progress_concurrency)
    return asyncio.get_running_loop().create_task(poller.run())
