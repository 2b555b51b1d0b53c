"""A deleted job's Workload is held by Kueue's `resource-in-use` finalizer until the operator lets it go
(`Reconciler._release`); a release that keeps failing for a while (Kueue's webhook down while its controller
restarts: HTTP 500 "failed calling webhook" on every update of a Workload) must not leave it Terminating forever."""

from __future__ import annotations

import asyncio

from kubetrain import k8s
from kubetrain.config import Settings
from kubetrain.errors import TemporaryError, WorkloadRejectedError
from kubetrain.reconciler import Reconciler


def test_a_release_refused_for_a_while_is_tried_until_it_goes_through(monkeypatch):
    """Before: six tries within 15 s, then a WARNING 'could not release Workload' and never again: with no job
    of that name left nothing woke it up, and the Workload stayed Terminating with its finalizer."""
    tries: list[str] = []

    async def patch_workload(api, namespace, action) -> None:
        tries.append(action.name)
        if len(tries) <= 8:  # Kueue's webhook is down for the first eight tries (about two minutes)
            raise WorkloadRejectedError("AdmissionWebhookUnavailable", "patch workload wl: failed calling webhook",
                                        create=False)
        if len(tries) == 9:
            raise TemporaryError("patch workload wl: HTTP 503")

    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        sleeps.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(k8s, "patch_workload", patch_workload)
    monkeypatch.setattr(asyncio, "sleep", sleep)

    async def main() -> None:
        rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type] - patch_workload is replaced
        rec.pods_synced.set()
        await asyncio.wait_for(rec._release(("ns", "tj"), "uid-1", "wl"), 5)

    asyncio.run(main())
    assert len(tries) == 10  # released at last
    assert max(sleeps) <= 60.0 and sleeps[:4] == [0.5, 1.0, 2.0, 4.0]  # backs off, at most a minute apart
