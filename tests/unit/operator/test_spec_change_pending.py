"""Condition SpecChangePending: a running job edited in a field that takes effect only at its next attempt says so,
until the next attempt or until the edit is undone; an edit that applies at once (runPolicy's limits) says nothing."""

from __future__ import annotations

import copy
from typing import Any

from kubetrain.actions import PatchStatus
from kubetrain.api import Job
from kubetrain.builders import get_pod
from kubetrain.kueue import podset_template
from kubetrain.observe import Observed, PodView
from kubetrain.plan import plan
from kubetrain.status import Status
from kubetrain_factories import at, pod_body, started

SPEC = {"image": "img:1", "nodes": 2, "trainer": {"builtin": {"task": "regression"}},
        "runPolicy": {"backoffSeconds": 10, "backoffLimit": 3}}


def job(generation: int = 1, status: dict[str, Any] | None = None, **edits: Any) -> Job:
    spec = copy.deepcopy(SPEC)
    for path, value in edits.items():  # runPolicy__backoffLimit=5
        *parents, leaf = path.split("__")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return Job.from_storage({"metadata": {"name": "tj", "namespace": "ns", "uid": "uid-1", "generation": generation},
                             "spec": spec, "status": status or started()})


def gang(built_from: Job, **kw: Any) -> Observed:
    """The running attempt's pods as the operator built them from `built_from`."""
    pods = []
    for rank in range(2):
        annotations = get_pod(job=built_from, attempt=1, rank=rank)["metadata"]["annotations"]
        view = PodView.from_storage(pod_body(rank=rank, annotations=annotations, **kw))
        assert view is not None
        pods.append(view)
    return Observed(pods=tuple(pods), nodes={})


def pending(status: Status | None) -> tuple[str, str, str] | None:
    cond = status.condition("SpecChangePending") if status is not None else None
    return None if cond is None else (cond.status, cond.reason, cond.message)


def test_an_edit_of_a_running_job_that_waits_for_the_next_attempt_says_so() -> None:
    """Before: a new image (or resources, env...) on a running job showed nothing on the job: the edit looked
    ignored, or applied, until the next restart."""
    edited = job(generation=2, image="img:2")
    result = plan(edited, gang(job()), at(30))
    assert result.status is not None and result.status.phase == "Running"
    status, reason, message = pending(result.status)
    assert (status, reason) == ("True", "EditedWhileRunning")
    assert message.startswith("the spec was edited (generation 2) after attempt 1 started from generation 1")
    assert "takes effect at the next attempt" in message
    again = plan(Job(**{**edited.__dict__, "status": result.status}), gang(job()), at(40))
    assert not any(isinstance(a, PatchStatus) for a in again.actions), "said once, not written at every reconcile"


def test_an_edit_that_applies_at_once_says_nothing() -> None:
    result = plan(job(generation=2, runPolicy__backoffLimit=5, runPolicy__activeDeadlineSeconds=3600),
                  gang(job()), at(30))
    assert pending(result.status) is None
    assert pending(plan(job(generation=2, runPolicy__terminationGracePeriodSeconds=300), gang(job()), at(30))
                   .status)[0] == "True"  # a pod field, in runPolicy


def test_an_edit_undone_clears_it() -> None:
    said = plan(job(generation=2, image="img:2"), gang(job()), at(30)).status
    undone = plan(job(generation=3, status=said.for_storage()), gang(job()), at(60))
    assert pending(undone.status) == ("False", "SpecCurrent", "attempt 1 runs the current spec")


def test_it_turns_false_when_the_attempt_ends_and_stays_so_for_the_next_one() -> None:
    said = plan(job(generation=2, image="img:2"), gang(job()), at(30)).status
    preempted = plan(job(generation=2, image="img:2", status=said.for_storage()),
                     gang(job(), disruption="PreemptionByScheduler"), at(60))
    assert preempted.status.phase == "Restarting"
    assert pending(preempted.status)[:2] == ("False", "AttemptEnded")
    current = job(generation=2, image="img:2", status=started(attempt=2, phase="Running"))
    current = Job(**{**current.__dict__, "status": Status.from_storage({
        **started(attempt=2), "conditions": [c.for_storage() for c in preempted.status.conditions]})})
    pods = [PodView.from_storage(pod_body(attempt=2, rank=r, annotations=get_pod(
        job=current, attempt=2, rank=r)["metadata"]["annotations"])) for r in range(2)]
    nxt = plan(current, Observed(pods=tuple(pods), nodes={}), at(90))
    assert pending(nxt.status or current.status)[0] == "False"


def test_pods_without_the_digest_say_nothing() -> None:
    """Pods an older operator made: their spec is unknown, so no guess."""
    pods = Observed(pods=tuple(PodView.from_storage(pod_body(rank=r, annotations={
        "kubetrain.io/spec-generation": "1"})) for r in range(2)), nodes={})
    assert pending(plan(job(generation=2, image="img:2"), pods, at(30)).status) is None


def test_the_digest_is_stamped_on_pods_and_left_out_of_kueues_template() -> None:
    meta = get_pod(job=job(), attempt=1, rank=0)["metadata"]
    assert meta["annotations"]["kubetrain.io/spec-fingerprint"] == job().spec_fingerprint
    assert job(generation=5, runPolicy__backoffLimit=9).spec_fingerprint == job().spec_fingerprint
    assert job(image="img:2").spec_fingerprint != job().spec_fingerprint
    assert "kubetrain.io/spec-fingerprint" not in (podset_template(job())["metadata"].get("annotations") or {})


def test_a_trailing_slash_added_to_the_checkpoint_uri_says_nothing() -> None:
    """The CRD lets an edit add or drop checkpoint.uri's trailing '/' (a re-apply of the manifest spelt the other way),
    and the operator strips it: the pods are the same, so the job must not say the edit waits for the next attempt."""
    ckpt = {"uri": "s3://bucket/jobs", "credentialsSecret": {"name": "s3"}}
    built = job(checkpoint=ckpt)
    edited = job(generation=2, checkpoint={**ckpt, "uri": "s3://bucket/jobs/"})
    assert edited.spec is not None and edited.spec.checkpoint is not None
    assert edited.spec.checkpoint.uri == built.spec.checkpoint.uri  # the same pods
    assert edited.spec_fingerprint == built.spec_fingerprint
    assert pending(plan(edited, gang(built), at(30)).status) is None
    moved = job(generation=2, checkpoint={**ckpt, "uri": "s3://bucket/jobs/x"})  # not an edit the CRD lets through,
    assert moved.spec_fingerprint != built.spec_fingerprint                     # but a digest that still tells apart
