"""Reconciles wait for the pod list and for kopf's node index (`handlers._synced`): with the TrainingJobs from
our own informer, a job can be known before kopf has listed the nodes, and a reconcile then would see every
node of every running pod as missing (NodeLost at once for `nodeLostGraceSeconds: 0`)."""

from __future__ import annotations

import asyncio

from kubetrain import handlers


def test_synced_waits_for_both_the_pods_and_the_first_node_event():
    async def main() -> None:
        pods, nodes, synced = asyncio.Event(), asyncio.Event(), asyncio.Event()
        task = asyncio.get_running_loop().create_task(handlers._synced(pods, nodes, synced))
        nodes.set()
        await asyncio.sleep(0.05)
        assert not synced.is_set()  # nodes indexed, the pod list not in yet
        nodes.clear()
        pods.set()
        await asyncio.sleep(0.05)
        assert not synced.is_set()  # pods listed, no node event yet
        nodes.set()
        await asyncio.wait_for(task, 1)
        assert synced.is_set()

    asyncio.run(main())


def test_a_cluster_without_nodes_does_not_hold_reconciles_forever(monkeypatch):
    monkeypatch.setattr(handlers, "NODES_SYNC_SECONDS", 0.1)

    async def main() -> None:
        pods, nodes, synced = asyncio.Event(), asyncio.Event(), asyncio.Event()
        pods.set()
        await asyncio.wait_for(handlers._synced(pods, nodes, synced), 2)
        assert synced.is_set()

    asyncio.run(main())
