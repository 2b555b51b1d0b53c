"""Condition SpecChangePending: an edit that the running attempt does not have yet (pure, no I/O).

Running pods are never changed: an edit to a job whose attempt has started takes
effect at its next attempt (a restart, a preemption, or suspend and resume), but
runPolicy's limits, deadlines, grace periods and suspend apply at once (the
CRD's description of `spec`). An edit to the image or the resources of a running
job looked ignored, with nothing on the job saying it was not. Each pod carries
the generation and the digest (`spec.pod_fingerprint`) of the spec it was built
from: while the running attempt's pods come from another generation whose digest
differs, the condition is True, naming both generations. It turns False when the
edit is undone (the digests equal again), and when the attempt ends
(`draft.ATTEMPT_CONDITIONS`): the next one is built from the spec of its start.
A job never edited while running has no such condition; pods of an operator that
did not stamp the digest say nothing either way.
"""

from __future__ import annotations

from kubetrain.draft import Draft
from kubetrain.observe import Observed
from kubetrain.status import STARTED_PHASES

SPEC_CHANGE_PENDING = "SpecChangePending"


def spec_change(d: Draft, observed: Observed) -> None:
    """Set SpecChangePending from the running attempt's pods (call once the planner has decided the phase)."""
    if d.status.phase not in STARTED_PHASES:
        return  # no attempt runs: the condition is False (draft.attempt_conditions), the next one is current
    attempt, job = d.status.attempt, d.job
    built = next((p for p in observed.pods if p.attempt == attempt and p.spec_fingerprint and p.generation is not None),
                 None)
    current = d.status.condition(SPEC_CHANGE_PENDING)
    if built is not None and job.generation is not None and built.generation != job.generation \
            and built.spec_fingerprint != job.spec_fingerprint:
        message = (f"the spec was edited (generation {job.generation}) after attempt {attempt} started from "
                   f"generation {built.generation}: running pods are never changed, so the edit takes effect at the "
                   "next attempt (a restart, a preemption, or suspend and resume); runPolicy's limits, deadlines "
                   "and grace periods apply already")
        if current is None or current.status != "True" or current.message != message:
            d.cond(SPEC_CHANGE_PENDING, "True", "EditedWhileRunning", message)
    elif current is not None and current.status == "True":
        d.cond(SPEC_CHANGE_PENDING, "False", "SpecCurrent", f"attempt {attempt} runs the current spec")
