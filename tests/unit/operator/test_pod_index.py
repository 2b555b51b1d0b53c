"""The pod index finds a node's jobs without walking every job (issue 12, item 5: no per-event cost that
grows with the number of jobs), and follows pods as they are bound, rebound and deleted."""

from __future__ import annotations

from kubetrain.config import Settings
from kubetrain.observe import PodIndex, PodView
from kubetrain.reconciler import Reconciler


def _view(name: str, node: str | None) -> tuple[str, PodView]:
    return "uid-1", PodView(name=name, attempt=1, rank=int(name[-1]), node_name=node)


def test_index_follows_pods_from_unbound_to_bound_to_deleted() -> None:
    index = PodIndex()
    a, b = ("ns", "a"), ("ns", "b")
    index.put(a, "a-a1-n0", _view("a-a1-n0", None))
    assert index.jobs_on("kwok-0") == []
    index.put(a, "a-a1-n0", _view("a-a1-n0", "kwok-0"))
    index.put(a, "a-a1-n1", _view("a-a1-n1", "kwok-0"))
    index.put(b, "b-a1-n0", _view("b-a1-n0", "kwok-1"))
    assert index.jobs_on("kwok-0") == [a] and index.jobs_on("kwok-1") == [b]
    index.discard(a, "a-a1-n0")
    assert index.jobs_on("kwok-0") == [a]  # its other pod is still there
    index.put(a, "a-a1-n1", _view("a-a1-n1", "kwok-1"))  # a re-created pod of the same name, elsewhere
    assert index.jobs_on("kwok-0") == [] and sorted(index.jobs_on("kwok-1")) == [a, b]
    index.discard(a, "a-a1-n1")
    index.discard(b, "b-a1-n0")
    assert index.jobs_on("kwok-1") == [] and a not in index and b not in index
    assert index._on_node == {}  # nothing left behind for nodes without pods


class _CountingIndex(PodIndex):
    """Counts how many jobs' pod lists were read."""

    reads = 0

    def __getitem__(self, key: tuple[str, str]) -> list[tuple[str, PodView]]:
        self.reads += 1
        return super().__getitem__(key)


class _Recording(Reconciler):
    def __init__(self) -> None:
        super().__init__(api=None, settings=Settings())  # type: ignore[arg-type]  # node events write nothing
        self.woken: list[tuple[str, str]] = []

    def enqueue(self, key: tuple[str, str], delay: float = 0.0) -> None:
        self.woken.append(key)


def test_a_node_event_wakes_only_that_nodes_jobs_and_reads_no_other_jobs_pods() -> None:
    rec = _Recording()
    rec.pods_index = index = _CountingIndex()
    for j in range(2000):
        key = ("ns", f"job{j}")
        rec.jobs[key] = {"metadata": {"name": key[1], "namespace": "ns"}}
        for r in range(4):
            index.put(key, f"job{j}-a1-n{r}", _view(f"job{j}-a1-n{r}", f"node-{j}"))
    rec.node_event("MODIFIED", "node-7", ready=True)  # first sight of the node: a change
    rec.node_event("MODIFIED", "node-7", ready=False)
    rec.node_event("DELETED", "node-9", ready=False)
    assert rec.woken == [("ns", "job7"), ("ns", "job7"), ("ns", "job9")]
    assert index.reads == 0, f"a node event read the pods of {index.reads} jobs"
    rec.node_event("MODIFIED", "node-7", ready=False)  # a heartbeat: no change, nothing woken
    assert len(rec.woken) == 3
