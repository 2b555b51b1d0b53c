"""A reconcile that crashes the same way at every try (a bug, an exception no step expected): its traceback once per
job and kind of crash, the repeats quietly with a WARNING and their count now and then, retried with a capped
exponential backoff, and one INFO when the job reconciles again. Through the real `Reconciler._run` loop; only the
reconcile itself stands in (it raises what a bug would)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kubernetes import client

from kubetrain import metrics
from kubetrain.config import Settings
from kubetrain.k8s import Api
from kubetrain.reconciler import Reconciler
from reconciler_harness import logged, quiet_reconciler

KEY = ("ml", "train")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _crashes() -> float:
    return metrics.ERRORS.labels("reconcile_crash")._value.get()


def _run(outcomes: list[Exception | None], caplog: Any) -> tuple[list[float], Reconciler]:
    """Run the job's reconcile once per outcome (an exception it raises, or None: it goes through), the fake clock
    moving on by each retry's delay; the delays it asked for."""
    delays: list[float] = []

    async def main() -> Reconciler:
        api = Api(client.ApiClient(), threads=1)
        rec = quiet_reconciler(api, delays)
        clock = rec.backoff.crash_log.clock = Clock()
        rec.jobs[KEY] = {"metadata": {"name": "train", "namespace": "ml"}}

        async def reconcile(key: tuple[str, str]) -> None:
            outcome = outcomes.pop(0)
            if outcome is not None:
                raise outcome

        rec.reconcile = reconcile  # type: ignore[method-assign]
        try:
            while outcomes:
                before = len(delays)
                await rec._run(KEY)
                clock.now += delays[-1] if len(delays) > before else 1.0
        finally:
            api.close()
        return rec

    caplog.set_level(logging.DEBUG, logger="kubetrain")
    return delays, asyncio.run(main())


def test_a_reconcile_that_crashes_alike_logs_its_traceback_once_and_backs_off(caplog) -> None:
    """Before: `reconcile of ml/train crashed; retrying in 10s` with a full traceback at ERROR every 10 s, per job,
    for as long as the bug lasted (a day of one crashing job: 8640 tracebacks), and nothing when it ended."""
    bug = [AttributeError(f"'NoneType' object has no attribute 'rank' (<Pod object at 0x7f{i:02x}>)")
           for i in range(12)]
    other = KeyError("attempt")
    start = _crashes()
    delays, rec = _run(bug[:6] + [other] + bug[6:] + [None, bug[0]], caplog)
    assert delays == [10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0, 300.0, 300.0, 300.0, 300.0, 300.0, 300.0, 10.0]
    assert _crashes() - start == 14  # every crash is counted

    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name.startswith("kubetrain")]
    assert [r.getMessage() for r in errors] == [
        "reconcile of ml/train crashed: AttributeError: 'NoneType' object has no attribute 'rank' "
        "(<Pod object at 0x7f00>); retrying in 10s",
        "reconcile of ml/train crashed: KeyError: 'attempt'; retrying in 300s",  # another crash: its traceback too
        "reconcile of ml/train crashed: AttributeError: 'NoneType' object has no attribute 'rank' "
        "(<Pod object at 0x7f00>); retrying in 10s",  # once it went through, a crash is news again
    ]
    assert all(r.exc_info and r.exc_info[1] is not None for r in errors)  # each with its traceback
    same = "reconcile of ml/train crashed: AttributeError: 'NoneType' object has no attribute 'rank' (<Pod object at"
    assert logged(caplog, logging.WARNING) == [  # at most one per CRASH_WARNING_EVERY (600 s), with their count
        f"{same} 0x7f06>); retrying in 300s (6 more times in the last 910s)",
        f"{same} 0x7f08>); retrying in 300s (2 more times in the last 600s)",
        f"{same} 0x7f0a>); retrying in 300s (2 more times in the last 600s)",
    ]
    assert not any(r.exc_info for r in caplog.records if r.levelno in (logging.WARNING, logging.DEBUG))
    assert logged(caplog, logging.INFO) == ["reconcile of ml/train no longer crashes (crashes in a row: 13)"]
    assert KEY in rec.backoff.crashes


def test_a_single_crash_then_a_reconcile_that_goes_through_says_so_once(caplog) -> None:
    delays, rec = _run([RuntimeError("boom"), None, None], caplog)
    assert delays == [10.0]
    assert len(logged(caplog, logging.ERROR)) == 1
    assert logged(caplog, logging.INFO) == ["reconcile of ml/train no longer crashes (crashes in a row: 1)"]
    assert KEY not in rec.backoff.crashes


def test_the_resync_leaves_a_crashing_job_to_its_backoff() -> None:
    """Before (with a backoff): the resync woke every job every minute, so a crashing job crashed at least every
    minute whatever its backoff said."""
    woken: list[tuple[str, str]] = []

    async def main() -> None:
        api = Api(client.ApiClient(), threads=1)
        rec = Reconciler(api=api, settings=Settings(resync_seconds=0.01))
        rec.enqueue = lambda key, delay=0.0: woken.append(key)  # type: ignore[method-assign]
        rec.jobs = {KEY: {}, ("ml", "fine"): {}}
        rec.backoff.crashed(KEY, RuntimeError("boom"))
        resync = asyncio.ensure_future(rec.resync())
        await asyncio.sleep(0.05)
        resync.cancel()
        api.close()

    asyncio.run(main())
    assert woken and set(woken) == {("ml", "fine")}
