"""What the reconciler remembers of a pod that is gone (`Reconciler.pod_event`): the reason the cluster
took it away, for the Preempted event, or that it had succeeded, so that its rank counts as done
(`supervise`): a gang still finishing is not restarted because PodGC or a user removed a finished pod."""

from __future__ import annotations

import asyncio

from kubetrain.observe import GONE_SUCCEEDED
from kubetrain.reconciler import Reconciler
from kubetrain.config import Settings
from kubetrain_factories import pod_body


def test_a_deleted_pod_is_remembered_as_succeeded_or_by_its_disruption_and_otherwise_forgotten():
    async def main() -> dict[str, str]:
        rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type] - no API call on this path
        key = ("", "tj")
        rec.jobs[key] = {"metadata": {"name": "tj"}}
        try:
            rec.pod_event("DELETED", pod_body(rank=0, phase="Succeeded", exit_code=0))
            rec.pod_event("DELETED", pod_body(rank=1, phase="Running", disruption="PreemptionByScheduler"))
            rec.pod_event("DELETED", pod_body(rank=2, phase="Running"))  # deleted by someone: supervise's default
            # A pod that succeeded on a node being drained afterwards is still a success.
            rec.pod_event("DELETED", pod_body(rank=3, phase="Succeeded", exit_code=0, disruption="EvictionByEvictionAPI"))
            return dict(rec.gone.get(key, {}))
        finally:
            rec.forget(key)

    gone = asyncio.run(main())
    assert gone == {"tj-a1-n0": GONE_SUCCEEDED, "tj-a1-n1": "PreemptionByScheduler", "tj-a1-n3": GONE_SUCCEEDED}
