"""Fake node manifests for kwok, as pure builders.

A node is fake (simulated by the testbed's kwok) when it carries the
annotation `kwok.x-k8s.io/node: fake`. Tests that need their own small nodes
(e.g. to fill them up for a preemption) build them with `fake_node` too.
"""

from __future__ import annotations

from .config import KWOK_NODE_ANNOTATION, NodePool

GPU_RESOURCE = "nvidia.com/gpu"


def fake_node(
    *,
    name: str,
    cpu: str = "32",
    memory: str = "256Gi",
    pods: str = "110",
    gpus: str = "8",
    labels: dict[str, str] | None = None,
) -> dict:
    """A v1 Node that kwok manages, with the given capacity (== allocatable)."""
    resources = {"cpu": cpu, "memory": memory, "pods": pods, GPU_RESOURCE: gpus}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                **(labels or {}),
            },
        },
        "spec": {},
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


def pool_nodes(pool: NodePool) -> list[dict]:
    labels = {"kubetrain.io/testbed-pool": pool.name, **pool.labels}
    return [
        fake_node(
            name=f"{pool.name}-{i}", cpu=pool.cpu, memory=pool.memory, pods=pool.pods, gpus=pool.gpus, labels=labels
        )
        for i in range(pool.count)
    ]
