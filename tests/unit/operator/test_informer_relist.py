"""A relist replaces the informer's view: what vanished meanwhile comes out as DELETED."""

from __future__ import annotations

from kubernetes import client

from kubetrain.informer import PodInformer


def _pod(ns: str, name: str, job: str) -> dict:
    return {"metadata": {"namespace": ns, "name": name, "labels": {"kubetrain.io/job-name": job}}, "status": {}}


def test_relist_reports_vanished_pods_as_deleted_with_their_labels_and_sets_synced():
    events: list[tuple[str, str, str]] = []
    informer = PodInformer(client.ApiClient(), namespaces=("a", "b"), label_selector="x=y",
                           on_event=lambda kind, obj: events.append(
                               (kind, obj["metadata"]["name"], obj["metadata"]["labels"]["kubetrain.io/job-name"])))
    informer._replace("a", [_pod("a", "p0", "j"), _pod("a", "p1", "j")])
    assert not informer.synced.is_set()  # namespace b has not listed yet
    informer._replace("b", [_pod("b", "q0", "k")])
    assert informer.synced.is_set()
    events.clear()

    informer._deliver("DELETED", "a", _pod("a", "p0", "j"))
    informer._replace("a", [_pod("a", "p2", "j")])  # after a 410: p1 went away while we were not looking

    assert events == [("DELETED", "p0", "j"), ("DELETED", "p1", "j"), ("MODIFIED", "p2", "j")]
    informer._replace("b", [])
    assert events[-1] == ("DELETED", "q0", "k")
