"""The reconcile logic, as a pure function: (job, observed, now) -> Plan.

No I/O happens here: `k8s.py` carries out the actions, `reconciler.py` feeds the
observations (`observe.py`). Everything the operator decides (when a gang
starts, which pod failure is a preemption and which one spends `backoffLimit`,
when a job is done) is decided here and in the modules this one calls
(`supervise.py` for a started attempt, `draft.py` for the shared steps), and
table-tested in tests/unit/operator.

State lives in the job's status only, and the status is written as an
*intent* before destructive actions: a restart first records `Restarting`
(with the counters already moved) and then deletes pods, so an operator
killed between the two resumes the deletion instead of counting again.
A new attempt is recorded after its pods were created: `status.attempt == N`
with phase Pending/Running means every pod of attempt N was created, so a
missing pod of a started attempt was deleted by someone else.
"""

from __future__ import annotations

import datetime as dt

from kubetrain.actions import CreatePod, CreateService, EnsureDeepSpeedConfigMap, Plan
from kubetrain.api import Job, pod_name
from kubetrain.status import STARTED_PHASES, LastCheckpoint
from kubetrain.values import format_time, parse_time
from kubetrain.draft import MESSAGE_LIMIT, Draft, delete_pods, excerpt, fail, ttl
from kubetrain.edits import spec_change
from kubetrain.identity import describe
from kubetrain.observe import Observed
from kubetrain.progress import next_progress, usable_checkpoint
from kubetrain.supervise import gang_succeeded, message_shape, supervise


def plan(job: Job, observed: Observed, now: dt.datetime) -> Plan:
    """Decide what to do about one TrainingJob. Pure and deterministic."""
    if job.deleting:
        return Plan()
    d = Draft(job, now)
    newest = _newest_checkpoint(job, observed)
    if newest != job.status.last_checkpoint:
        d.update(last_checkpoint=newest)
    if observed.progress is not None and observed.progress.attempt == job.status.attempt and not job.status.terminal:
        d.update(progress=next_progress(job.status.progress, observed.progress))
    if job.status.terminal:
        _finished(d, observed)
        return d.build()
    if job.spec is None:
        fail(d, observed, reason="InvalidSpec", message=job.spec_error or "invalid spec")
        return d.build()
    policy = job.spec.run_policy
    deadline = _deadline(job)
    started = d.status.attempt >= 1 and d.status.phase in STARTED_PHASES
    if deadline is not None and not policy.suspend and job.status.phase != "Suspended":
        if now >= deadline and not (started and gang_succeeded(d, observed)):  # done in time, seen late: Succeeded
            # One Warning (Failed, as every failure): a DeadlineExceeded event before it said the same words again.
            fail(d, observed, reason="DeadlineExceeded",
                 message=f"activeDeadlineSeconds={policy.active_deadline_seconds} exceeded")
            return d.build()
        d.wake_at(deadline)
    if policy.suspend:
        _suspend(d, observed)
        return d.build()
    if job.status.phase == "Suspended":
        _resume(d)
    started = d.status.attempt >= 1 and d.status.phase in STARTED_PHASES
    if started:
        supervise(d, observed)
        spec_change(d, observed)
    else:
        _start_next_attempt(d, observed)
    return d.build()


def _resume(d: Draft) -> None:
    """Suspended -> Restarting: the next attempt starts now, and its deadline counts from its start."""
    d.update(phase="Restarting", next_attempt_time=format_time(d.now), start_time=None,
             message=f"resumed: starting attempt {d.status.attempt + 1}")
    d.cond("Suspended", "False", "Resumed", "the job was resumed")
    d.cond("Restarting", "True", "Resumed", "starting a new attempt after suspension")
    d.event("Normal", "Resumed", f"resumed: starting attempt {d.status.attempt + 1}")


def _deadline(job: Job) -> dt.datetime | None:
    seconds = job.spec.run_policy.active_deadline_seconds if job.spec else None
    start = parse_time(job.status.start_time)
    if seconds is None or start is None:
        return None
    return start + dt.timedelta(seconds=seconds)


def _newest_checkpoint(job: Job, observed: Observed) -> LastCheckpoint | None:
    """The highest reported step, from records that point into this job's own storage prefix
    (a record elsewhere is not this job's checkpoint, whoever wrote it): the pods' termination
    messages and annotations, and rank 0's /progress."""
    best = job.status.last_checkpoint
    prefix = job.checkpoint_uri
    current = observed.progress if (observed.progress and observed.progress.attempt == job.status.attempt
                                    and not job.status.terminal) else None
    polled = usable_checkpoint(current.report if current else None, prefix)
    for ckpt in [pod.checkpoint for pod in observed.pods] + [polled]:
        if ckpt and prefix and ckpt.uri.startswith(prefix + "/") and (best is None or ckpt.step > best.step):
            best = ckpt
    return best


def _finished(d: Draft, observed: Observed) -> None:
    for pod in observed.pods:
        if pod.active and not pod.terminating:
            d.delete(pod)
    ttl(d)


def _suspend(d: Draft, observed: Observed) -> None:
    if d.status.phase != "Suspended":
        # A job created suspended (or suspended before its pods were all accepted) had no attempt: it said
        # "suspended at attempt 0: deleting its pods" when there was neither.
        first = d.status.attempt == 0
        d.update(phase="Suspended", nodes_ready=0, next_attempt_time=None,
                 message="suspended before its first attempt: no pod starts until spec.runPolicy.suspend is false"
                 if first else "suspended: pods deleted, the job is kept")
        d.cond("Suspended", "True", "Suspended", "spec.runPolicy.suspend is true")
        if d.status.condition("Running"):
            d.cond("Running", "False", "Suspended", "suspended")
        if (restarting := d.status.condition("Restarting")) is not None and restarting.status == "True":
            d.cond("Restarting", "False", "Suspended", "suspended: no attempt starts until resumed")
        d.event("Normal", "Suspended", f"suspended at attempt {d.status.attempt}: deleting its pods" if not first
                else "suspended before its first attempt" + (": deleting its pods" if observed.pods else ""))
    delete_pods(d, observed, observed.pods)


def _start_next_attempt(d: Draft, observed: Observed) -> None:
    spec = d.job.spec
    assert spec is not None
    attempt = d.status.attempt + 1
    blocking = [p for p in observed.pods if p.attempt != attempt or p.terminating]
    # Pods of this attempt made from an earlier spec (a launch cut short, then the job edited): made again.
    outdated = [p for p in observed.pods if p.attempt == attempt and p.generation is not None
                and d.job.generation is not None and p.generation != d.job.generation]
    if blocking or outdated:
        # Attempts never overlap: the old gang must be gone before the new one starts.
        delete_pods(d, observed, blocking + [p for p in outdated if not p.terminating])
        previous = [p for p in blocking if p.attempt != attempt]
        if d.status.phase != "Restarting" and previous:
            d.update(phase="Restarting")
        d.update(message=f"waiting for {len(previous)} pod(s) of the previous attempt to be gone" if previous
                 else f"attempt {attempt}: the spec changed while its pods were being created: recreating "
                      f"{len(outdated)} pod(s) made from generation {outdated[0].generation}" if outdated
                 else f"attempt {attempt}: waiting for {len(blocking)} deleted pod(s) to be gone")
        return
    ready_at = parse_time(d.status.next_attempt_time)
    if ready_at is not None and d.now < ready_at:
        d.wake_at(ready_at)
        return
    existing = {p.rank for p in observed.pods if p.attempt == attempt}
    d.before.append(CreateService())
    if spec.strategy.type == "zero3" and spec.strategy.deepspeed_config is not None:
        d.before.append(EnsureDeepSpeedConfigMap())
    for rank in range(spec.nodes):
        if rank not in existing:
            d.before.append(CreatePod(attempt=attempt, rank=rank))
    d.update(
        phase="Pending", attempt=attempt, restarts=d.status.restarts + (1 if attempt > 1 else 0),
        start_time=d.status.start_time or format_time(d.now), completion_time=None,
        next_attempt_time=None, nodes_total=spec.nodes, nodes_ready=0,
        message=f"attempt {attempt}: {spec.nodes} pod(s) created, waiting for them to run",
    )
    # Which identity the pods present to checkpoint storage (never a credential: names only).
    identity = f"; checkpoint identity: {describe(spec.checkpoint.identity)}" if spec.checkpoint else ""
    d.cond("Created", "True", "PodsCreated", f"attempt {attempt}: {spec.nodes} pod(s) created{identity}")
    d.cond("Running", "False", "PodsPending", f"attempt {attempt}: waiting for pods to run")
    if attempt > 1 or d.status.condition("Restarting"):
        d.cond("Restarting", "False", "AttemptStarted", f"attempt {attempt} started")
    d.event("Normal", "Created", f"attempt {attempt}: created {spec.nodes} pod(s) "
                                 f"{pod_name(d.job.name, attempt, 0)}..{pod_name(d.job.name, attempt, spec.nodes - 1)}"
                                 + identity)


def fail_plan(job: Job, observed: Observed, now: dt.datetime, *, reason: str, message: str) -> Plan:
    """The plan that fails a job outright (e.g. the API server rejected its pods)."""
    d = Draft(job, now)
    fail(d, observed, reason=reason, message=excerpt(message, MESSAGE_LIMIT * 2))
    return d.build()


def rejected_plan(job: Job, now: dt.datetime, *, reason: str, message: str) -> Plan:
    """The API server refused to create the next attempt's pods for a reason that can pass
    (a full ResourceQuota, RBAC not yet granted): the job waits, showing why. Condition
    Created=False with the API server's (redacted) message, a Warning event when the reason or
    message changes, phase Pending (Restarting stays Restarting: `status.attempt` is not moved,
    so the pods already created are completed, never duplicated, on the next try)."""
    d = Draft(job, now)
    if job.status.phase == "Suspended":  # resumed in the plan whose creates were refused: its status never went out
        _resume(d)
    text = excerpt(message)
    current = d.status.condition("Created")
    earlier = reason == "NameInUse"  # a pod or Service of the same name, left by an earlier job being deleted
    if current is not None and current.status == "False" and current.reason == reason \
            and message_shape(current.message) == message_shape(text):
        text = current.message  # the same refusal with other counts (a quota's `used`): no event, no status write
    else:
        d.event("Warning", reason, f"attempt {job.status.attempt + 1}: "
                                   f"{'' if earlier else 'the API server refused a pod: '}{text}; retrying with backoff")
        d.cond("Created", "False", reason, text)
    queued = d.status.condition("Queued")
    if queued is not None and queued.status == "True":  # Kueue admitted it (its pods are created only then)
        d.cond("Queued", "False", "Admitted", "admitted by Kueue; the API server refused its pods")
    what = ("waiting for quota" if reason in ("QuotaExceeded", "QuotaPending") else "waiting for an earlier job of "
            "this name to be cleaned up" if earlier else "waiting for the ServiceAccount" if reason ==
            "ServiceAccountMissing" else "waiting for the API server to accept the pods")
    # Pending only before the first attempt: with attempt >= 1, Pending would mean "attempt N's pods all
    # exist" (a resumed or restarting job whose next pods are refused stays Restarting).
    # The deadline counts from the first try to start (as a Job's startTime): a gang whose pods stay refused
    # (a quota that never admits all of them, the ones created holding theirs) fails on it, never waits forever.
    d.update(phase="Pending" if job.status.attempt == 0 else "Restarting",
             message=f"attempt {job.status.attempt + 1}: {what}: {text}",
             start_time=d.status.start_time or format_time(now))
    return d.build()
