"""Live progress: rank 0's /progress record is read strictly, and the planner turns it into
status.progress, status.lastCheckpoint (with size and timings), the CheckpointsLagging condition,
and at most one write per observation (docs/contract.md, "Metrics and progress endpoint")."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from kubetrain.api import Job
from kubetrain.spec import Spec, SpecError
from kubetrain.status import LastCheckpoint
from kubetrain.values import Progress
from kubetrain.observe import Observed
from kubetrain.plan import plan
from kubetrain.progress import ProgressObservation, RecordError, next_progress, parse_progress_record
from kubetrain_factories import at, gang, job, started

STORAGE = {"checkpoint": {"uri": "s3://b/p", "credentialsSecret": {"name": "s3"}}}


def record(**overrides: Any) -> dict[str, Any]:
    """A valid /progress record of attempt 1 (the trainer's side writes exactly these keys)."""
    body: dict[str, Any] = {
        "kind": "kubetrain.io/progress", "step": 120, "maxSteps": 400, "epoch": 0.3, "loss": 2.5,
        "learningRate": 0.0003, "samplesPerSecond": 64.0, "tokensPerSecond": 8192.0, "etaSeconds": 42.5,
        "attempt": 1, "incarnation": 1796302800, "updatedAt": "2026-01-01T12:00:00Z", "pendingUploads": 0,
        "uploadLagSteps": 0,
        "lastCheckpoint": {"kind": "kubetrain.io/last-checkpoint", "step": 100,
                           "uri": "s3://b/p/ns/tj/checkpoint-100", "time": "2026-01-01T11:59:00Z",
                           "sizeBytes": 123456789, "saveSeconds": 1.5, "uploadSeconds": 12.25},
    }
    body.update(overrides)
    return body


def observe(seconds: float = 5, attempt: int = 1, **overrides: Any) -> ProgressObservation:
    report = parse_progress_record(json.dumps(record(**{"attempt": attempt, **overrides})), at=at(seconds),
                                   attempt=attempt)
    return ProgressObservation(attempt=attempt, at=at(seconds), report=report)


def unreachable(seconds: float = 5, attempt: int = 1) -> ProgressObservation:
    return ProgressObservation(attempt=attempt, at=at(seconds), reason="Timeout", message="no answer within 3s")


def running(**status: Any) -> Job:
    return job(status=started(nodesReady=2, **status), spec=STORAGE)


def test_a_valid_record_becomes_progress_and_a_checkpoint_with_its_timings() -> None:
    report = observe().report
    assert report is not None
    p = report.progress
    assert (p.step, p.max_steps, p.steps, p.loss, p.samples_per_second, p.eta_seconds) == (
        120, 400, "120/400", 2.5, 64.0, 42.5)
    assert p.observed_at == "2026-01-01T12:00:05Z" and p.reachable
    assert report.checkpoint == LastCheckpoint(step=100, uri="s3://b/p/ns/tj/checkpoint-100",
                                               time="2026-01-01T11:59:00Z", size_bytes=123456789,
                                               save_seconds=1.5, upload_seconds=12.25)


@pytest.mark.parametrize("overrides, field", [
    ({"kind": "something/else"}, "kind"),
    ({"step": "120"}, "step"),
    ({"step": -1}, "step"),
    ({"step": True}, "step"),
    ({"maxSteps": 1.5}, "maxSteps"),
    ({"loss": float("nan")}, "loss"),
    ({"samplesPerSecond": float("inf")}, "samplesPerSecond"),
    ({"etaSeconds": -3}, "etaSeconds"),
    ({"pendingUploads": None}, "pendingUploads"),
    ({"attempt": 2}, "attempt"),
    ({"updatedAt": "yesterday"}, "updatedAt"),
    ({"lastCheckpoint": {"step": 100, "uri": "s3://b/p/ns/tj/checkpoint-100"}}, "lastCheckpoint"),
    ({"lastCheckpoint": {**record()["lastCheckpoint"], "sizeBytes": "big"}}, "lastCheckpoint"),
    ({"lastCheckpoint": {**record()["lastCheckpoint"], "uploadSeconds": -1}}, "lastCheckpoint"),
])
def test_an_invalid_record_is_refused_naming_the_field(overrides: dict, field: str) -> None:
    text = json.dumps(record(**overrides)).replace("NaN", "NaN").replace("Infinity", "Infinity")
    with pytest.raises(RecordError) as err:
        parse_progress_record(text, at=at(0), attempt=1)
    assert err.value.field == field


@pytest.mark.parametrize("text", ["not json", "[1, 2]", json.dumps(record()) + " " * 70000, "[" * 5000])
def test_what_is_not_one_json_record_is_refused(text: str) -> None:
    with pytest.raises(RecordError):
        parse_progress_record(text, at=at(0))


def test_nulls_are_allowed_where_the_contract_allows_them() -> None:
    report = parse_progress_record(json.dumps(record(maxSteps=None, loss=None, etaSeconds=None, lastCheckpoint=None)),
                                   at=at(0))
    assert report.progress.steps == "120" and report.progress.loss is None and report.checkpoint is None


def test_a_failed_read_keeps_the_last_values_and_says_why() -> None:
    before = observe().report.progress
    after = next_progress(before, unreachable())
    assert (after.reachable, after.reason, after.step, after.loss) == (False, "Timeout", 120, 2.5)
    assert next_progress(None, unreachable()).step is None


def test_a_read_that_changes_nothing_keeps_observed_at() -> None:
    first = observe(5).report.progress
    assert next_progress(first, observe(35)) is first
    assert next_progress(first, observe(35, step=121)).observed_at == "2026-01-01T12:00:35Z"


# ------------------------------------------------------------------ the planner


def test_an_observation_is_written_once_into_status() -> None:
    tj = running()
    result = plan(tj, Observed(pods=gang(), progress=observe()), at(5))
    st = result.status
    assert st is not None and st.progress.step == 120 and st.progress.steps == "120/400"
    assert st.last_checkpoint.step == 100 and st.last_checkpoint.upload_seconds == 12.25
    stored = Job.from_storage({"metadata": {"name": "tj", "namespace": "ns", "uid": "uid-1", "generation": 1},
                               "spec": {"image": "img:1", "nodes": 2, **STORAGE},
                               "status": json.loads(json.dumps(st.for_storage()))})
    assert plan(stored, Observed(pods=gang(), progress=observe()), at(6)).status is None, "no second write"
    assert plan(stored, Observed(pods=gang(), progress=observe(35)), at(35)).status is None, "nothing moved"
    assert plan(stored, Observed(pods=gang(), progress=observe(35, step=130)), at(35)).status.progress.step == 130


def test_an_observation_of_another_attempt_or_of_a_finished_job_is_not_written() -> None:
    assert plan(running(attempt=2), Observed(pods=gang(attempt=2), progress=observe()), at(5)).status is None
    done = job(status={**started(), "phase": "Succeeded", "completionTime": "2026-01-01T12:00:00Z"}, spec=STORAGE)
    assert plan(done, Observed(pods=(), progress=observe()), at(5)).status is None


def test_a_checkpoint_outside_the_jobs_prefix_is_not_taken() -> None:
    elsewhere = {**record()["lastCheckpoint"], "uri": "s3://b/p/ns/other/checkpoint-100"}
    st = plan(running(), Observed(pods=gang(), progress=observe(lastCheckpoint=elsewhere)), at(5)).status
    assert st.progress.step == 120 and st.last_checkpoint is None


def test_unreachable_rank_0_shows_in_status_and_keeps_the_values() -> None:
    first = plan(running(), Observed(pods=gang(), progress=observe()), at(5)).status
    tj = running(progress=first.for_storage()["progress"])
    st = plan(tj, Observed(pods=gang(), progress=unreachable(35)), at(35)).status
    assert st.progress.reachable is False and st.progress.reason == "Timeout" and st.progress.step == 120
    stored = running(progress=json.loads(json.dumps(st.for_storage()["progress"])))
    assert plan(stored, Observed(pods=gang(), progress=unreachable(65)), at(65)).status is None, "no write per failure"


def lagging(status: Any) -> tuple[str, str] | None:
    cond = status.condition("CheckpointsLagging")
    return (cond.status, cond.reason) if cond else None


def test_checkpoints_lagging_appears_when_uploads_fall_behind_and_clears() -> None:
    st = plan(running(), Observed(pods=gang(), progress=observe(pendingUploads=1, uploadLagSteps=20)), at(5)).status
    assert lagging(st) is None, "one upload in flight is normal"
    st = plan(running(), Observed(pods=gang(), progress=observe(pendingUploads=3, uploadLagSteps=60)), at(5)).status
    assert lagging(st) == ("True", "UploadsLagging")
    assert "3 checkpoint(s) wait for upload" in st.condition("CheckpointsLagging").message
    tj = running(progress=st.for_storage()["progress"], conditions=[c.for_storage() for c in st.conditions])
    still = plan(tj, Observed(pods=gang(), progress=unreachable(35)), at(35)).status
    assert lagging(still) == ("True", "UploadsLagging"), "an unreachable pod proves nothing"
    caught = plan(tj, Observed(pods=gang(), progress=observe(65, step=200, pendingUploads=0)), at(65)).status
    assert lagging(caught) == ("False", "UploadsCaughtUp")


# ------------------------------------------------------------------ conditions


def test_conditions_have_the_metav1_shape_with_observed_generation() -> None:
    tj = job(status=started(phase="Pending"), generation=3)
    st = plan(tj, Observed(pods=gang()), at(5)).status
    for cond in st.conditions:
        stored = cond.for_storage()
        assert set(stored) == {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}
        assert stored["observedGeneration"] == 3 and stored["reason"] and stored["lastTransitionTime"]
    assert (st.condition("Ready").status, st.condition("Running").status) == ("True", "True")


def test_ready_is_false_with_the_phase_as_reason_once_the_job_ends() -> None:
    tj = job(status=started(nodesReady=2))
    st = plan(tj, Observed(pods=gang(phase="Succeeded", exit_code=0)), at(5)).status
    assert st.condition("Succeeded").status == "True"
    assert (st.condition("Ready").status, st.condition("Ready").reason) == ("False", "Succeeded")


def test_a_preemption_event_carries_its_cause() -> None:
    result = plan(job(status=started(nodesReady=2)),
                  Observed(pods=(gang()[0], replace(gang()[1], disruption="EvictionByEvictionAPI"))), at(5))
    assert [(e.reason, e.cause) for e in result.events if e.reason == "Preempted"] == [
        ("Preempted", "EvictionByEvictionAPI")]


# ------------------------------------------------------------------ spec


@pytest.mark.parametrize("value, ok", [(None, 120), (15, 15), (600, 600), (14, None), (0, None), (-1, None),
                                       ("120", None)])
def test_termination_grace_defaults_to_120_and_refuses_values_that_cannot_work(value: Any, ok: int | None) -> None:
    body = {"image": "i", "runPolicy": {} if value is None else {"terminationGracePeriodSeconds": value}}
    if ok is None:
        with pytest.raises(SpecError) as err:
            Spec.from_storage(body)
        assert "runPolicy.terminationGracePeriodSeconds" in str(err.value)
    else:
        assert Spec.from_storage(body).run_policy.termination_grace_period_seconds == ok


def test_the_metrics_port_is_not_a_master_port() -> None:
    with pytest.raises(SpecError, match="masterPort"):
        Spec.from_storage({"image": "i", "masterPort": 9410})


def test_progress_round_trips_through_storage() -> None:
    p = observe().report.progress
    stored = json.loads(json.dumps(p.for_storage()))
    assert stored["steps"] == "120/400" and Progress.from_storage(stored) == p


def _stored(tj: Job, st: Any) -> Job:
    return replace(tj, status=type(st).from_storage(json.loads(json.dumps(st.for_storage()))))


def test_a_finished_job_keeps_its_last_reading_marked_with_no_eta_or_rate() -> None:
    """Before, a Succeeded job showed `970/1000, 31 s left, reachable` forever (the last poll before the end)."""
    tj = _stored(running(), plan(running(), Observed(pods=gang(), progress=observe()), at(5)).status)
    done = plan(tj, Observed(pods=gang(phase="Succeeded", exit_code=0)), at(30)).status
    assert done.phase == "Succeeded"
    p = done.progress
    assert (p.step, p.max_steps, p.loss, p.attempt) == (120, 400, 2.5, 1), "the last values stay"
    assert (p.reachable, p.reason) == (False, "AttemptEnded") and "attempt 1 ended" in p.message
    assert (p.eta_seconds, p.samples_per_second, p.tokens_per_second) == (None, None, None)
    assert plan(_stored(tj, done), Observed(pods=()), at(60)).status is None, "marked once"


def test_a_restart_marks_the_old_attempts_reading_and_the_new_attempt_shows_no_0_while_it_restores() -> None:
    """Before: attempt 1's ETA through the restart, then Step 0 while attempt 2 restored its checkpoint."""
    tj = _stored(running(), plan(running(), Observed(pods=gang(), progress=observe()), at(5)).status)
    restarting = plan(tj, Observed(pods=(gang()[0], replace(gang()[1], phase="Failed", exit_code=1))), at(30)).status
    assert restarting.phase == "Restarting" and restarting.progress.reason == "AttemptEnded"
    assert restarting.progress.eta_seconds is None and restarting.progress.step == 120
    attempt2 = running(attempt=2, progress=json.loads(json.dumps(restarting.for_storage()["progress"])))
    nothing_yet = observe(40, attempt=2, step=0, maxSteps=None, epoch=None, loss=None, learningRate=None,
                          samplesPerSecond=None, tokensPerSecond=None, etaSeconds=None, lastCheckpoint=None)
    st = plan(attempt2, Observed(pods=gang(attempt=2), progress=nothing_yet), at(40)).status
    assert st is None or st.progress.step == 120, "not 0: attempt 1's last values, still marked ended"
    restored = observe(45, attempt=2, step=100, maxSteps=None, epoch=None, loss=None, learningRate=None,
                       samplesPerSecond=None, tokensPerSecond=None, etaSeconds=None, lastCheckpoint=None)
    st = plan(attempt2, Observed(pods=gang(attempt=2), progress=restored), at(45)).status
    assert (st.progress.step, st.progress.attempt, st.progress.reachable) == (100, 2, True)
    st = plan(attempt2, Observed(pods=gang(attempt=2), progress=observe(50, attempt=2, step=130)), at(50)).status
    assert (st.progress.step, st.progress.reason, st.progress.eta_seconds) == (130, "", 42.5)


def test_a_fresh_job_at_step_0_shows_step_0() -> None:
    st = plan(running(), Observed(pods=gang(), progress=observe(step=0, maxSteps=None, loss=None)), at(5)).status
    assert st.progress.step == 0 and st.progress.reachable


def test_lagging_set_from_the_pods_annotation_clears_when_it_goes_even_with_progress_unreachable() -> None:
    """Behind a NetworkPolicy on 9410 every read fails: the condition the annotation set stayed True for the rest
    of the attempt after uploads caught up. One set from /progress still waits for a reading that says so."""
    from kubetrain_factories import pod

    lag = {"kubetrain.io/checkpoint-sync": "2 checkpoint(s) waiting: s3 unreachable"}
    tj = running()
    tj = _stored(tj, plan(tj, Observed(pods=(pod(rank=0, annotations=lag), pod(rank=1)), progress=unreachable(5)),
                          at(5)).status)
    assert lagging(tj.status) == ("True", "UploadsLagging")
    after = plan(tj, Observed(pods=gang(), progress=unreachable(600)), at(600)).status
    assert lagging(after) == ("False", "UploadsCaughtUp")
    polled = observe(pendingUploads=3, uploadLagSteps=60)
    from_progress = _stored(running(), plan(running(), Observed(pods=gang(), progress=polled), at(5)).status)
    kept = plan(from_progress, Observed(pods=gang(), progress=unreachable(600)), at(600)).status
    assert lagging(kept or from_progress.status) == ("True", "UploadsLagging"), "no reading says it caught up"
