"""When a failed storage call is tried again: backoff, deadlines and the refused-access window.

Pure policy over the error types of `storage_errors`: temporary errors are
retried until a deadline, refused access only inside its own start-up window,
every other permanent error never.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from kubetrain_trainer.storage_errors import StorageAccessError, StorageError, StorageTemporaryError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter, capped."""

    initial_s: float = 1.0
    maximum_s: float = 60.0
    factor: float = 2.0

    def delay(self, failures: int) -> float:
        steps = max(0, failures - 1)
        if self.factor > 1 and self.initial_s > 0 and steps * math.log(self.factor) >= math.log(
                self.maximum_s / self.initial_s):
            ceiling = self.maximum_s  # reached the cap (also where factor ** steps would overflow a float)
        else:
            ceiling = min(self.maximum_s, self.initial_s * self.factor ** steps)
        return random.uniform(ceiling / 2, ceiling)


def should_retry(error: StorageError, *, now: float, delay: float, deadline: float | None,
                 access_deadline: float | None = None) -> bool:
    """Whether a failed storage call is tried again after `delay` seconds (times are time.monotonic).

    - temporary errors: until `deadline` (None: forever);
    - refused access or a missing bucket (`StorageAccessError`): until
      `access_deadline`, and never past `deadline`; None: not retried;
    - every other permanent error (bad URI, invalid bucket name...): never.
    A retry whose wait would end past its deadline is not made: the caller
    gets the error while the window is still open, not after it.
    """
    if isinstance(error, StorageAccessError):
        if access_deadline is None:
            return False
        limit = access_deadline if deadline is None else min(deadline, access_deadline)
        return now + delay <= limit
    if isinstance(error, StorageTemporaryError):
        return deadline is None or now + delay <= deadline
    return False


def retrying(
    fn: Callable[[], T],
    *,
    deadline: float | None,
    backoff: Backoff = Backoff(),
    what: str = "",
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[StorageError], None] | None = None,
    access_deadline: float | None = None,
    cancelled: Callable[[], bool] = lambda: False,
) -> T:
    """Run `fn`, retrying as `should_retry` says (temporary errors until `deadline`, time.monotonic;
    refused access until `access_deadline`). `cancelled()` true (e.g. SIGTERM): the last error is raised."""
    failures = 0
    while True:
        try:
            return fn()
        except StorageError as e:
            failures += 1
            delay = backoff.delay(failures)
            if cancelled() or not should_retry(e, now=time.monotonic(), delay=delay, deadline=deadline,
                                               access_deadline=access_deadline):
                raise
            if on_retry is not None:
                on_retry(e)
            log.warning("%s failed (%s); retry %d in %.1fs", what or "storage call", e, failures, delay)
            sleep(delay)
