"""Bounded polling for tests: wait until a condition holds, or fail saying what was last seen.

Integration tests observe an eventually-consistent system; a sleep is either
too short (flaky) or too long (slow). `wait_until` polls quickly, gives up at
a deadline, and its error shows the last observed value so a failure explains
itself.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The condition did not hold in time (an AssertionError, so pytest shows it as a test failure)."""


def wait_until(
    observe: Callable[[], T],
    predicate: Callable[[T], bool] = bool,
    *,
    timeout: float = 30.0,
    interval: float = 0.2,
    what: str = "condition",
) -> T:
    """Call `observe` until `predicate(value)` is true; return that value.

    Exceptions raised by `observe` count as "not yet" and are reported if the
    deadline passes.
    """
    deadline = time.monotonic() + timeout
    last: object = "(never observed)"
    while True:
        try:
            value = observe()
            if predicate(value):
                return value
            last = value
        except Exception as exc:  # noqa: BLE001 - reported below if it persists
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            raise WaitTimeout(f"{what} not reached within {timeout:.0f} s; last observed: {last!r:.2000}")
        time.sleep(interval)
