"""How long a job waits after a reconcile met an error that can pass, and how that is logged and counted.

Two counts per job, each of errors in a row:
- temporary errors (an API server overloaded or away, RBAC's refusal of a
  write): each doubles the error's own delay (2 s, 5 s on a 429) up to
  `TEMPORARY_MAX_DELAY`, never less than the answer's Retry-After; reset by
  the job's next reconcile that goes through. Not every job every 2 s: with
  hundreds of jobs that is a steady load on an API server already refusing.
  An answer no step of the reconcile expected (a 404, a 400/422 on a write
  that is not a create: `refused`) counts among them, from `REFUSED_DELAY`;
- pod creates refused for a reason that can pass (a full ResourceQuota, RBAC not
  yet granted): `REJECTED_BACKOFF`, reset once a pod create goes through, and
  when the job is suspended or finishes (`settled`).
A job's temporary error is logged at WARNING the first time, an identical
repeat at DEBUG, and the reconcile that goes through after repeats once at INFO
(`repeats.py`): an API server away for an hour is not a warning per job per
minute. So is a job's refused pod create (the same reason again is a repeat:
a job waiting a day for quota is one WARNING; its condition and event say the
rest), ended by its next pod create that goes through (forgotten when the job
is suspended, finishes or is deleted). RBAC's refusals are
logged at DEBUG here: the API client reported the missing permission once, at
ERROR (`permissions.py`).

A reconcile that crashes (a bug, an exception no step expected) crashes the
same way at every try: it is retried from `CRASH_FIRST_DELAY`, doubling up to
`CRASH_MAX_DELAY`; its traceback is logged once at ERROR per job and kind of
crash (the exception's type and message), the same crash again at DEBUG with a
WARNING and their count every `CRASH_WARNING_EVERY` seconds, and the first
reconcile that does not crash once at INFO (`crashed`, `reconciled`). Each
crash is counted in the metrics all the same.
"""

from __future__ import annotations

import collections
import logging

from kubetrain import metrics
from kubetrain.errors import ApiError, DeniedError, RejectedError, TemporaryError, WorkloadRejectedError
from kubetrain.repeats import Repeats, without_addresses

log = logging.getLogger("kubetrain.operator")

REJECTED_BACKOFF = (5.0, 10.0, 20.0, 40.0, 60.0)
"""Seconds between pod creates the API server refused for a reason that can pass (quota)."""
TEMPORARY_MAX_DELAY = 60.0
"""Longest wait after temporary errors in a row (each one doubles the error's own delay)."""
REFUSED_DELAY = 5.0
"""First wait after an answer no step of the reconcile expected (`Backoff.refused`), doubling as a temporary error's."""
CRASH_FIRST_DELAY = 10.0
"""Wait after a job's first crash of its reconcile in a row (each one after it doubles it)."""
CRASH_MAX_DELAY = 300.0
"""Longest wait after a job's crashes in a row."""
CRASH_WARNING_EVERY = 600.0
"""Seconds between the WARNINGs of a job's same crash again (with how many there were meanwhile)."""

Key = tuple[str, str]


class Backoff:
    """The errors in a row of each job (namespace, name)."""

    def __init__(self) -> None:
        self.failures: dict[Key, int] = {}    # temporary errors in a row
        self.rejections: dict[Key, int] = {}  # pod creates refused in a row
        self.repeats = Repeats(log)
        self.refusals = Repeats(log)  # of pod creates: their own trouble (a reconcile going through ends none)
        self.crashes: dict[Key, collections.Counter[str]] = {}  # crashes in a row, by kind
        self.crash_log = Repeats(log, every=CRASH_WARNING_EVERY, level=logging.ERROR)  # by (job, kind)

    def temporary(self, key: Key, exc: TemporaryError, doing: str = "") -> float:
        """Count and log one temporary error of the job's reconcile (`doing`: in which step, e.g. "reading Kueue"):
        the seconds until it is tried again."""
        metrics.ERRORS.labels("forbidden" if isinstance(exc, DeniedError) else "temporary").inc()
        delay = self._failed(key, exc.delay)
        failure = f"reconcile of {key[0]}/{key[1]}: {f'{doing}: ' if doing else ''}{exc}"
        if isinstance(exc, DeniedError):
            log.debug("%s; retrying in %.0fs", failure, delay)
        else:
            self.repeats.failed(key, failure, f"; retrying in {delay:.0f}s")
        return delay

    def refused(self, key: Key, exc: ApiError) -> float:
        """Count and log an answer to the job's reconcile that no step of it expected (a 404, a 400 or 422 on a write
        that is not a create): tried again with backoff, as a temporary error, since what caused it (an object deleted
        meanwhile, a schema being upgraded) may pass. The seconds until it is tried again."""
        metrics.ERRORS.labels("api").inc()
        delay = self._failed(key, REFUSED_DELAY)
        self.repeats.failed(key, f"reconcile of {key[0]}/{key[1]}: {exc}", f"; retrying in {delay:.0f}s")
        return delay

    def _failed(self, key: Key, base: float) -> float:
        """One more error in a row of the job's reconcile: `base` doubled per error before it, up to the longest."""
        count = self.failures[key] = self.failures.get(key, 0) + 1
        return max(base, min(TEMPORARY_MAX_DELAY, base * 2 ** min(count - 1, 16)))

    def crashed(self, key: Key, exc: Exception) -> float:
        """Count and log one crash of the job's reconcile (`exc`, which escaped it): the seconds until it is tried
        again. The traceback of each kind of crash (type and message) is logged once while the crashes last."""
        metrics.ERRORS.labels("reconcile_crash").inc()
        kinds = self.crashes.setdefault(key, collections.Counter())
        crash = f"{type(exc).__name__}: {exc}"
        kind = without_addresses(crash)
        kinds[kind] += 1
        count = sum(kinds.values())
        delay = min(CRASH_MAX_DELAY, CRASH_FIRST_DELAY * 2 ** min(count - 1, 16))
        self.crash_log.failed((key, kind), f"reconcile of {key[0]}/{key[1]} crashed: {crash}",
                              f"; retrying in {delay:.0f}s", exc_info=exc)
        return delay

    def reconciled(self, key: Key) -> None:
        """The job's reconcile ran to its end without crashing: after crashes, said once at INFO."""
        kinds = self.crashes.pop(key, None)
        if kinds is not None:
            for kind in kinds:
                self.crash_log.forget((key, kind))
            log.info("reconcile of %s/%s no longer crashes (crashes in a row: %d)", key[0], key[1],
                     sum(kinds.values()))

    def rejected(self, key: Key, exc: RejectedError) -> float:
        """Count and log one refused pod create (or Workload write): the seconds until the job tries again."""
        metrics.ERRORS.labels("rejected").inc()
        count = self.rejections[key] = self.rejections.get(key, 0) + 1
        delay = REJECTED_BACKOFF[min(count, len(REJECTED_BACKOFF)) - 1]
        what = "Workload write" if isinstance(exc, WorkloadRejectedError) else "pod create"
        refused = f"job {key[0]}/{key[1]}: {what} refused ({exc.reason})"
        if exc.reason == "Forbidden":  # RBAC's: logged once (permissions.py)
            log.debug("%s; retrying in %.0fs", refused, delay)
        else:
            self.refusals.failed(key, refused, f"; retrying in {delay:.0f}s")
        return delay

    def went_through(self, key: Key) -> None:
        """The job's reconcile went through: its next temporary error waits the shortest again."""
        if self.failures.pop(key, None) is not None:
            self.repeats.succeeded(key, f"reconcile of {key[0]}/{key[1]} goes through again")

    def created(self, key: Key) -> None:
        """A pod create (or a write of the job's Workload) went through."""
        if self.rejections.pop(key, None) is not None:
            self.refusals.succeeded(key, f"job {key[0]}/{key[1]}: pod creates go through again")

    def settled(self, key: Key) -> None:
        """The job was just suspended (or Succeeded, or Failed): its refused creates in a row are over, so once
        resumed its first refusal waits the shortest and is warned again."""
        self.rejections.pop(key, None)
        self.refusals.forget(key)

    def forget(self, key: Key) -> None:
        self.failures.pop(key, None)
        self.repeats.forget(key)
        self.rejections.pop(key, None)
        self.refusals.forget(key)
        for kind in self.crashes.pop(key, None) or ():
            self.crash_log.forget((key, kind))
