"""No node counts as missing before kopf has indexed the nodes (`Reconciler.node_view`). The TrainingJobs
come from our own informer, so after an operator restart a job can be reconciled before kopf has listed the
nodes; its pods' nodes looked missing then, and a job with `nodeLostGraceSeconds: 0` restarted at once.
kopf calls the node event handler only once its index is filled: the first node event opens the gate."""

from __future__ import annotations

import asyncio
import datetime as dt

from kubetrain import k8s
from kubetrain.config import Settings
from kubetrain.api import LABEL_JOB
from kubetrain.observe import NodeView, PodView
from kubetrain.reconciler import Reconciler

NOW = dt.datetime(2026, 12, 5, tzinfo=dt.timezone.utc)


def test_a_node_absent_from_the_index_is_missing_only_once_the_index_is_filled():
    async def main() -> None:
        rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type] - no API call here
        rec.nodes_index = {"node-a": [NodeView(name="node-a")]}
        before = rec.node_view("node-b", NOW)
        assert before.exists and before.ready  # not listed yet: nothing known against it
        assert "node-b" not in rec.missing_nodes  # and no grace period started from this moment
        rec.node_event(None, "node-a", True)  # kopf's first node event: its index is complete
        after = rec.node_view("node-b", NOW)
        assert not after.exists and after.since == NOW
        assert rec.node_view("node-a", NOW).exists

    asyncio.run(main())


def test_a_deleted_jobs_workload_is_not_released_before_the_pod_list_is_in(monkeypatch):
    """After a restart the pod index is empty until the informer has listed: releasing the Workload's
    finalizer then would free Kueue's quota while the pods still run."""
    released: list[str] = []

    async def patch_workload(api, namespace, action) -> None:
        released.append(action.name)

    monkeypatch.setattr(k8s, "patch_workload", patch_workload)

    async def main() -> None:
        rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type] - patch_workload is replaced
        task = asyncio.get_running_loop().create_task(rec._release(("ns", "tj"), "uid-1", "wl"))
        await asyncio.sleep(0.2)
        assert released == []  # the pod list is not in: the gang's pods may still be running
        rec.pods_synced.set()
        await asyncio.wait_for(task, 5)
        assert released == ["wl"]  # listed, and none of the job's pods is left

    asyncio.run(main())


def test_deleted_nodes_are_forgotten_once_no_pod_of_ours_is_on_them():
    """Before: every node ever deleted (a scale-down, a spot node taken back) stayed in the reconciler's
    `node_ready` and `missing_nodes` for the operator's lifetime: memory that grew with the cluster's node churn."""
    rec = Reconciler(api=None, settings=Settings())  # type: ignore[arg-type] - no API call here
    rec.jobs[("ml", "train")] = {"metadata": {"name": "train", "namespace": "ml"}}
    rec.enqueue = lambda key, delay=0.0: None  # type: ignore[method-assign]
    rec.pods_index.put(("ml", "train"), "train-a1-n0", ("uid", PodView(name="train-a1-n0", attempt=1, rank=0, node_name="busy")))
    for name in ("idle", "busy"):
        rec.node_event("MODIFIED", name, True)
        rec.node_event("DELETED", name, False)
    assert rec.node_ready == {} and list(rec.missing_nodes) == ["busy"]  # its pod's loss counts from the deletion
    rec.forget_idle_nodes()
    assert list(rec.missing_nodes) == ["busy"]
    rec.pod_event("DELETED", {"metadata": {"name": "train-a1-n0", "namespace": "ml",
                                           "labels": {LABEL_JOB: "train"}}})
    rec.forget_idle_nodes()
    assert rec.missing_nodes == {}
