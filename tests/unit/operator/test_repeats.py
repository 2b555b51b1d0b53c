"""A failure that repeats is logged once at WARNING, its identical repeats quietly (or once per `every` seconds with
their count), and the success after repeats once at INFO. A fake clock; the logger is the real one."""

from __future__ import annotations

import logging

import pytest

from kubetrain.repeats import Repeats

log = logging.getLogger("kubetrain.test_repeats")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def records(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == log.name]


def test_identical_repeats_warn_at_most_once_per_period_with_their_count(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger=log.name)
    clock = Clock()
    repeats = Repeats(log, every=60.0, clock=clock)
    for _ in range(61):  # two minutes of a try every 2 s
        repeats.failed("lease", "cannot read Lease ops/kt: HTTP 503", "; retrying")
        clock.now += 2.0
    warnings = [m for level, m in records(caplog) if level == "WARNING"]
    assert warnings == ["cannot read Lease ops/kt: HTTP 503; retrying",
                        "cannot read Lease ops/kt: HTTP 503; retrying (30 more times in the last 60s)",
                        "cannot read Lease ops/kt: HTTP 503; retrying (30 more times in the last 60s)"]
    assert sum(level == "DEBUG" for level, _ in records(caplog)) == 58
    repeats.succeeded("lease", "Lease ops/kt can be read again")
    assert records(caplog)[-1] == ("INFO", "Lease ops/kt can be read again (after 61 failures in a row)")


def test_object_addresses_do_not_make_a_failure_new_and_another_failure_warns_at_once(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger=log.name)
    repeats = Repeats(log)
    refused = "Max retries exceeded (NewConnectionError('<HTTPSConnection object at 0x{:x}>: Connection refused'))"
    for address in (0x7F01, 0x7F02, 0x7F03):
        repeats.failed("job", refused.format(address))
    repeats.failed("job", "HTTP 503 Service Unavailable")
    repeats.failed("other job", "HTTP 503 Service Unavailable")
    assert [level for level, _ in records(caplog)] == ["WARNING", "DEBUG", "DEBUG", "WARNING", "WARNING"]


def test_a_single_failure_then_success_adds_no_line_and_success_clears_it(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger=log.name)
    repeats = Repeats(log)
    repeats.failed("job", "HTTP 429")
    repeats.succeeded("job", "works again")
    repeats.failed("job", "HTTP 429")  # a new episode: warned again
    assert [level for level, _ in records(caplog)] == ["WARNING", "WARNING"]
