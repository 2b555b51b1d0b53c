"""Failures that repeat, logged once: the first at WARNING, its repeats quietly, the end once at INFO.

A call that fails and is tried again (a standby reading the Lease every 2 s, a
job's reconcile backing off) meets the same failure for as long as the cause
lasts: an API server away, a Role missing. A warning per try buries everything
else in the log. Here each key (a Lease, a job) logs its first failure at
WARNING; an identical repeat (the same text once object addresses are left
out: urllib3 names its connection objects by address) at DEBUG, or, with
`every`, at WARNING again once `every` seconds have passed since the last
warning, with how many there were meanwhile; a different failure at WARNING at
once. The first success after repeats is logged at INFO, with their count, so
the log says when the trouble ended; a single failure needs no such line (the
next try worked). Only the logging changes: when to try again is the caller's.
`level` raises the first line of a failure (a crash: ERROR, with its traceback
as `exc_info`); `same` compares a coarser text than the one logged (an outage
that refuses every job's event alike, whichever job it names).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Callable, Hashable

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def without_addresses(text: str) -> str:
    """`text` as failures are compared: object addresses (` at 0x7f...`) left out."""
    return _ADDRESS.sub("", text)


@dataclass
class _Trouble:
    failure: str     # the last failure logged at WARNING, addresses left out
    warned_at: float
    quiet: int = 0   # repeats since that warning
    total: int = 1   # failures in a row


class Repeats:
    """The failure each key is in, if any."""

    def __init__(self, log: logging.Logger, *, every: float | None = None,
                 clock: Callable[[], float] = time.monotonic, level: int = logging.WARNING) -> None:
        self.log, self.every, self.clock, self.level = log, every, clock, level
        self._troubles: dict[Hashable, _Trouble] = {}

    def failed(self, key: Hashable, failure: str, then: str = "", *, same: str | None = None,
               exc_info: BaseException | None = None) -> None:
        """One failure of `key`: `failure` says what failed (compared with the last one, or `same` instead), `then`
        what happens next (`; retrying in 4s`: logged, not compared); `exc_info` goes with its first line only."""
        now, same = self.clock(), without_addresses(failure if same is None else same)
        trouble = self._troubles.get(key)
        if trouble is None or trouble.failure != same:
            if trouble is not None:
                trouble.failure, trouble.warned_at, trouble.quiet = same, now, 0
                trouble.total += 1
            else:
                self._troubles[key] = _Trouble(same, now)
            self.log.log(self.level, "%s%s", failure, then, exc_info=exc_info)
            return
        trouble.total += 1
        if self.every is not None and now - trouble.warned_at >= self.every:
            self.log.warning("%s%s (%d more times in the last %.0fs)", failure, then, trouble.quiet + 1,
                             now - trouble.warned_at)
            trouble.warned_at, trouble.quiet = now, 0
            return
        trouble.quiet += 1
        self.log.debug("%s%s (again)", failure, then)

    def succeeded(self, key: Hashable, message: str) -> None:
        """`key` works: after repeated failures, `message` is logged once at INFO with their count."""
        trouble = self._troubles.pop(key, None)
        if trouble is not None and trouble.total > 1:
            self.log.info("%s (after %d failures in a row)", message, trouble.total)

    def forget(self, key: Hashable) -> None:
        self._troubles.pop(key, None)

    def __contains__(self, key: object) -> bool:
        """Whether `key` is in a failure now."""
        return key in self._troubles
