"""The launcher's last wait for uploads (`launch._drain`): as long as the run needs, cut to the grace
period once a SIGTERM comes, before or while it waits. The session is a stand-in at its boundary (what
is pending, how long the pod has); the real uploads under a SIGTERM are in
tests/integration/trainer_storage/test_ckpt_launcher_minio.py."""

from __future__ import annotations

import threading
import time

from kubetrain_trainer import launch


class Session:
    def __init__(self, pending_s: float) -> None:
        self.done_at = time.monotonic() + pending_s
        self.calls: list[str] = []
        self.closed_with: tuple[float, float] | None = None

    def wait_uploads(self, timeout_s: float) -> bool:
        left = self.done_at - time.monotonic()
        time.sleep(max(0.0, min(timeout_s, left)))
        return time.monotonic() >= self.done_at

    def keep_only_newest(self) -> None:
        self.calls.append("keep_only_newest")

    def give_way_if_late(self, time_left_s: float) -> bool:
        if "give_way_if_late" not in self.calls:  # asked on each wait after a SIGTERM; recorded once
            self.calls.append("give_way_if_late")
        return False

    def close(self, budget_s: float, *, join_s: float = 5.0) -> bool:
        self.closed_with = (budget_s, join_s)
        return time.monotonic() >= self.done_at


def test_without_sigterm_it_waits_for_the_uploads():
    session = Session(pending_s=0.6)
    started = time.monotonic()
    assert launch._drain(session, 30.0, threading.Event(), lambda: None)
    assert 0.6 <= time.monotonic() - started < 2.0
    assert session.calls == [] and session.closed_with == (0.0, 5.0)


def test_the_budget_ends_the_wait_and_says_not_synced():
    session = Session(pending_s=60)
    started = time.monotonic()
    assert not launch._drain(session, 0.5, threading.Event(), lambda: None)
    assert time.monotonic() - started < 1.5


def test_a_sigterm_while_it_waits_cuts_the_wait_to_the_grace_period_and_keeps_only_the_newest():
    # The workers had finished (the run succeeded); uploads would take a minute; the node is drained.
    session, stop, stopped_at = Session(pending_s=60), threading.Event(), []

    def sigterm():
        stopped_at.append(time.monotonic())
        stop.set()

    threading.Timer(0.3, sigterm).start()
    started = time.monotonic()
    synced = launch._drain(session, 1800.0, stop, lambda: stopped_at[0] + 1.0 if stopped_at else None)
    assert not synced
    assert 1.2 <= time.monotonic() - started < 2.5  # SIGTERM at 0.3 s + 1 s to the end of the grace
    assert session.calls == ["keep_only_newest", "give_way_if_late"]  # then, while it waits, whether the newest needs the time  # once, when the SIGTERM was seen
    assert session.closed_with == (0.0, 1.0)  # and the upload thread is waited for only the given time


def test_a_sigterm_before_it_waits_is_not_trimmed_again_and_an_ended_grace_ends_it_at_once():
    session, stop = Session(pending_s=60), threading.Event()
    stop.set()
    started = time.monotonic()
    assert not launch._drain(session, 1800.0, stop, lambda: time.monotonic() - 1.0)
    assert time.monotonic() - started < 0.5
    assert session.calls == []  # finish_watching already kept only the newest
