"""The operator's pod informer against the real API server: list, then watch adds, changes and deletions.

(Expiry, 410 Gone -> relist, is in tests/unit/operator/test_informer_relist.py: a fresh
testbed has not compacted yet, so an old resourceVersion is not reliably expired here.)"""

from __future__ import annotations

import asyncio
import time

import pytest
from kubernetes import client

from kubetrain.informer import PodInformer

pytestmark = pytest.mark.integration
OURS = {"app.kubernetes.io/managed-by": "kubetrain", "kubetrain.io/job-name": "j"}
SELECTOR = "app.kubernetes.io/managed-by=kubetrain"


def _pod(name: str, labels: dict[str, str]) -> dict:
    # Unschedulable on purpose: it stays Pending, so only our own writes change it.
    return {"metadata": {"name": name, "labels": dict(labels)},
            "spec": {"containers": [{"name": "c", "image": "kubetrain/none"}],
                     "nodeSelector": {"kubetrain.io/no-such-node": "1"}}}


async def _until(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("clusterwide", [False, True], ids=["one-namespace", "cluster-wide"])
def test_lists_what_exists_then_streams_adds_changes_and_deletions(kube_api, namespace, clusterwide):
    core = client.CoreV1Api(kube_api)
    core.create_namespaced_pod(namespace, _pod("before", OURS))
    core.create_namespaced_pod(namespace, _pod("not-ours", {"app": "other"}))
    events: list[tuple[str, str, str]] = []

    async def main() -> None:
        def record(kind: str, obj: dict) -> None:
            meta = obj["metadata"]
            if meta["namespace"] == namespace:  # cluster-wide, other tests' pods may show up too
                events.append((kind, meta["name"], meta["labels"].get("kubetrain.io/job-name", "")))

        informer = PodInformer(kube_api, namespaces=() if clusterwide else (namespace,), label_selector=SELECTOR,
                               on_event=record)
        informer.start()
        try:
            await asyncio.wait_for(informer.synced.wait(), 120)
            assert events[0] == ("MODIFIED", "before", "j")  # listed before the watch began
            await asyncio.to_thread(core.create_namespaced_pod, namespace, _pod("after", OURS))
            await asyncio.to_thread(core.patch_namespaced_pod, "after", namespace,
                                    {"metadata": {"annotations": {"touched": "yes"}}})
            await asyncio.to_thread(core.delete_namespaced_pod, "before", namespace, grace_period_seconds=0)
            await _until(lambda: ("DELETED", "before", "j") in events
                         and any(e[:2] == ("MODIFIED", "after") for e in events))
        finally:
            informer.stop()

    asyncio.run(main())
    names = [e[1] for e in events]
    assert "not-ours" not in names  # the label selector is applied by the server
    assert events.index(("ADDED", "after", "j")) < next(
        i for i, e in enumerate(events) if e[:2] == ("MODIFIED", "after"))

