"""Leader election on a coordination.k8s.io Lease: one operator replica reconciles, the others wait.

The protocol is client-go's (`tools/leaderelection`), so `kubectl get lease`
reads the same way as for kube-controller-manager:
- a candidate reads the Lease; it may take it when nobody holds it, when it
  already holds it, or when the holder has not renewed it for
  `leaseDurationSeconds` as measured on the candidate's own clock (the time it
  last saw the record change, never the holder's timestamps, so clock skew
  between machines does not matter);
- every write carries the resourceVersion it read, so of two candidates racing
  for an expired Lease exactly one wins (the other gets 409 Conflict);
- the leader renews every `retry_period`; if it cannot renew for
  `renew_deadline` (shorter than the lease duration), or it reads that someone
  else holds the Lease, it has lost and `on_lost` runs. The operator exits
  there: it is level-triggered, so the next leader picks up where it stopped;
- the renew deadline is kept by the clock, not by the calls: a watchdog thread
  declares the loss `renew_deadline` after the start of the last successful
  renewal even while a call still hangs (a half-open connection, an API server
  that accepts and never answers, a response that trickles in). Every Lease
  call also carries a request timeout, so a hung call ends and frees its thread.
  A standby needs a full lease duration of silence before it takes over, so the
  old leader has stopped before the new one starts;
- a leader that stops cleanly releases the Lease (empty holder, duration 1 s)
  so a standby takes over at once instead of after a lease duration;
- a standby that cannot read or write the Lease keeps trying every
  `retry_period` (it must take over within a lease duration once the API
  works), but says so once: RBAC's refusal at ERROR naming the permission and
  the fix (`permissions.py`), any other failure at WARNING, an identical repeat
  at DEBUG and once a minute at WARNING with a count, the recovery at INFO
  (`repeats.py`). Its health endpoint still answers 200: a restart gives it
  neither the permission nor an API server, and when the API server is away
  for everyone, restarting every replica only adds a crash-loop backoff to the
  time they need to come back. The leader's failed renewals are said the same
  way (their cadence and the renew deadline are untouched).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain.errors import ConflictError, ForbiddenError, NotFoundError, classify
from kubetrain.permissions import Permissions
from kubetrain.repeats import Repeats
from kubetrain.values import format_time

log = logging.getLogger("kubetrain.leader")
REPEAT_WARNING_SECONDS = 60.0
"""A standby's identical failures to read or write the Lease warn at most this often (with their count)."""


@dataclass(frozen=True)
class LeaseTiming:
    lease_duration: float = 15.0
    """How long a Lease that is not renewed stays valid for the others."""
    renew_deadline: float = 10.0
    """How long the leader keeps trying to renew before it gives up (< lease_duration)."""
    retry_period: float = 2.0
    """Time between tries, both to acquire and to renew (< renew_deadline)."""

    @property
    def request_timeout(self) -> float:
        """Limit of one Lease call: half the renew deadline (at least 1 s), so that a call that
        timed out leaves time for another try before the deadline."""
        return max(1.0, self.renew_deadline / 2)

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError("lease timings need 0 < retry_period < renew_deadline < lease_duration, "
                             f"got {self.retry_period}, {self.renew_deadline}, {self.lease_duration}")


class LeaderElector:
    """Acquire, renew and release one Lease for one identity."""

    def __init__(self, api_client: client.ApiClient, *, namespace: str, name: str, identity: str,
                 timing: LeaseTiming = LeaseTiming(), on_lost: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api = client.CoordinationV1Api(api_client)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.timing, self.on_lost, self.clock = timing, on_lost, clock
        self._observed: tuple[Any, ...] | None = None   # the record as last read
        self._observed_at = 0.0                         # our clock when that record last changed
        self._observed_duration = timing.lease_duration
        self.holder: str | None = None                  # who holds it, as last read
        self._leading = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._renewed = threading.Condition()
        self._renewed_at = 0.0    # our clock at the START of the last successful acquire or renew
        self._lost = False
        self.permissions = Permissions()   # RBAC's refusals, once each
        self._trouble = Repeats(log, every=REPEAT_WARNING_SECONDS, clock=clock)  # the standby's other failures

    @property
    def is_leader(self) -> bool:
        return self._leading.is_set()

    @property
    def lease_ref(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    def _body(self, spec: dict[str, Any], resource_version: str | None = None) -> dict[str, Any]:
        """The Lease to write; with the resourceVersion that was read, so a concurrent write gets 409."""
        meta = {"name": self.name, "namespace": self.namespace}
        if resource_version is not None:
            meta["resourceVersion"] = resource_version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def _observe(self, spec: Any) -> None:
        record = (spec.holder_identity, spec.renew_time, spec.acquire_time, spec.lease_transitions,
                  spec.lease_duration_seconds)
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()
            self._observed_duration = float(spec.lease_duration_seconds or self.timing.lease_duration)
        self.holder = spec.holder_identity or None

    @property
    def _timeout(self) -> float:
        return self.timing.request_timeout

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One Lease call with the request timeout; a client error comes as a type of `errors.py`, and RBAC's
        refusal is reported once (`permissions.py`)."""
        what = getattr(fn, "__name__", "lease call")
        with self.permissions.watching(what, self.namespace):
            try:
                return fn(*args, _request_timeout=self._timeout)
            except ApiException as exc:
                raise classify(exc, what) from None

    def try_acquire_or_renew(self) -> bool:
        """One round: True when this identity holds the Lease afterwards."""
        now = dt.datetime.now(dt.timezone.utc)
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": max(1, math.ceil(self.timing.lease_duration)),
                "acquireTime": format_time(now, micro=True), "renewTime": format_time(now, micro=True), "leaseTransitions": 0}
        try:
            lease = self._call(self.api.read_namespaced_lease, self.name, self.namespace)
        except NotFoundError:
            try:
                self._call(self.api.create_namespaced_lease, self.namespace, self._body(spec))
            except ConflictError:   # another candidate created it first
                return False
            self.holder = self.identity
            self._observed = None
            return True
        current = lease.spec
        self._observe(current)
        mine = current.holder_identity == self.identity
        expired = self.clock() >= self._observed_at + self._observed_duration
        if current.holder_identity and not mine and not expired:
            return False
        transitions = int(current.lease_transitions or 0)
        if mine:  # keep when it was acquired
            spec["acquireTime"] = format_time(current.acquire_time, micro=True) if current.acquire_time else spec["acquireTime"]
            spec["leaseTransitions"] = transitions
        else:
            spec["leaseTransitions"] = transitions + 1
        if self._lost:  # declared lost meanwhile (this round's read may have hung): write nothing
            return False
        try:
            self._call(self.api.replace_namespaced_lease, self.name, self.namespace,
                       self._body(spec, lease.metadata.resource_version))
        except ConflictError:   # someone wrote it since we read it
            return False
        if not mine:
            log.info("took %s over from %s", self.lease_ref, current.holder_identity or "nobody")
        self.holder = self.identity
        return True

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Block until this identity leads (True) or `stop` is set (False)."""
        stop = stop or self._stop
        announced = None
        while not stop.is_set():
            started = self.clock()
            try:
                leading = self.try_acquire_or_renew()
            except Exception as exc:  # noqa: BLE001  (the API server may be briefly unreachable)
                if isinstance(exc, ForbiddenError) and exc.denial is not None:  # the ledger's ERROR said it
                    log.debug("cannot read or write %s: %s", self.lease_ref, exc)
                else:
                    self._trouble.failed(self.lease_ref, f"cannot read or write {self.lease_ref}: {exc}",
                                         f"; trying again every {self.timing.retry_period:g}s")
            else:
                self._trouble.succeeded(self.lease_ref, f"{self.lease_ref} can be read and written again")
                if leading:
                    self._renewed_at = started
                    self._leading.set()
                    log.info("leading: %s held by %s", self.lease_ref, self.identity)
                    return True
            if self.holder != announced:
                log.info("standing by: %s is held by %s", self.lease_ref, self.holder)
                announced = self.holder
            stop.wait(self.timing.retry_period)
        return False

    def start_renewing(self) -> None:
        """Renew from a daemon thread, and keep the renew deadline from another; `on_lost` runs
        once if leadership is lost."""
        self._thread = threading.Thread(target=self._renew_loop, name="kubetrain-leader", daemon=True)
        self._watchdog = threading.Thread(target=self._keep_deadline, name="kubetrain-leader-deadline", daemon=True)
        self._thread.start()
        self._watchdog.start()

    def _renew_loop(self) -> None:
        renewing = (self.lease_ref, "renew")  # its failures said once, as the standby's (`_trouble`)
        then = (f"; trying again every {self.timing.retry_period:g}s (leadership is lost "
                f"{self.timing.renew_deadline:g}s after the last renewal)")
        while not self._stop.wait(self.timing.retry_period):
            started = self.clock()
            try:
                if self.try_acquire_or_renew():
                    with self._renewed:
                        if self._lost:
                            return
                        self._renewed_at = started
                        self._renewed.notify_all()
                    self._trouble.succeeded(renewing, f"{self.lease_ref} renewed again")
                    continue
                if self.holder not in (None, self.identity):
                    self._lose(f"{self.lease_ref} is now held by {self.holder}")
                    return
                self._trouble.failed(renewing, f"cannot renew {self.lease_ref}: write conflict", then)
            except Exception as exc:  # noqa: BLE001
                if isinstance(exc, ForbiddenError) and exc.denial is not None:  # the ledger's ERROR said it
                    log.debug("cannot renew %s: %s", self.lease_ref, exc)
                else:
                    self._trouble.failed(renewing, f"cannot renew {self.lease_ref}: {exc}", then)
            if self._lost:
                return

    def _keep_deadline(self) -> None:
        """Declare the loss when `renew_deadline` has passed since the start of the last successful
        renewal, whatever the renewing thread is doing (a call may hang past its timeout)."""
        with self._renewed:
            while not self._stop.is_set() and not self._lost:
                left = self._renewed_at + self.timing.renew_deadline - self.clock()
                if left <= 0:
                    break
                self._renewed.wait(left)
        self._lose(f"could not renew {self.lease_ref} for {self.timing.renew_deadline:g}s")

    def _lose(self, reason: str) -> None:
        """Once: stop leading and tell `on_lost` (unless we are stopping anyway)."""
        with self._renewed:
            if self._lost or self._stop.is_set():
                return
            self._lost = True
            self._leading.clear()
            self._renewed.notify_all()
        log.error("lost leadership: %s", reason)
        if self.on_lost is not None:
            self.on_lost(reason)

    def release(self) -> None:
        """Stop renewing and, if still leading, hand the Lease back so a standby takes over now."""
        self._stop.set()
        with self._renewed:
            self._renewed.notify_all()
        for thread in (self._thread, self._watchdog):
            if thread is not None:
                thread.join(self.timing.retry_period + self.timing.request_timeout * 2 + 1)
        if not self._leading.is_set():
            return
        self._leading.clear()
        try:
            lease = self._call(self.api.read_namespaced_lease, self.name, self.namespace)
            if lease.spec.holder_identity != self.identity:
                return
            now = format_time(dt.datetime.now(dt.timezone.utc), micro=True)
            self._call(self.api.replace_namespaced_lease, self.name, self.namespace, self._body(
                {"holderIdentity": None, "leaseDurationSeconds": 1, "acquireTime": now, "renewTime": now,
                 "leaseTransitions": int(lease.spec.lease_transitions or 0)}, lease.metadata.resource_version))
            log.info("released %s", self.lease_ref)
        except Exception as exc:  # noqa: BLE001  (the Lease then expires on its own)
            log.warning("could not release %s (it expires by itself): %s", self.lease_ref, exc)
