"""Supervision of a started attempt: classify what happened to its pods (pure, no I/O).

Every pod of the current attempt is sorted into one of:
- fatal: exit code 82 (invalid configuration, with the trainer's failure record),
  a container that can never start, or a transient start error that outlasted
  runPolicy.startupGraceSeconds: the job fails;
- disruption: the cluster took the pod away (DisruptionTarget, eviction, exit
  code 83, a lost node, a missing pod): the gang restarts and maxPreemptions
  counts it;
- failure: the user's code failed: the gang restarts with backoff and
  backoffLimit counts it;
- otherwise it runs, starts or succeeded: readiness, CheckpointsLagging and
  StartupDelayed follow, and the attempt is Running or Succeeded.
The first class found wins in that order; restarts write their intent to the
status before the pods are deleted (see `plan.py`).
"""

from __future__ import annotations

import datetime as dt
import re

from kubetrain.api import EXIT_INVALID_CONFIG, EXIT_PREEMPTED, FAILURE_REASONS, SHM_VOLUME, TMP_VOLUME, pod_name
from kubetrain.values import format_time, parse_time
from kubetrain.draft import Draft, delete_pods, excerpt, fail, ttl
from kubetrain.observe import GONE_SUCCEEDED, Observed, PodView
from kubetrain.progress import FROM_PROGRESS, lagging_message

FATAL_WAITING_REASONS = frozenset({"InvalidImageName", "ErrImageNeverPull"})
"""Container waiting reasons that can never resolve by themselves: fail at once."""

TRANSIENT_WAITING_REASONS = frozenset({
    "ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError", "CreateContainerError",
})
"""Container waiting reasons that may resolve by themselves (a registry rate limit while a
preempted gang pulls on new nodes, a Secret its controller writes moments after the job):
the kubelet retries, and the job fails only once one persists for runPolicy.startupGraceSeconds."""

SELF_INFLICTED_EVICTION = re.compile(
    r"exceeds the total limit of containers|Usage of EmptyDir volume .* exceeds the limit"
    r"|exceeded its local ephemeral storage limit|has larger consumption of")
"""Kubelet eviction messages that blame the pod itself (it overused ephemeral storage beyond
its limits, or memory/storage beyond its requests under node pressure): an application
failure that spends backoffLimit, not a preemption (restarting would only repeat it)."""

EMPTYDIR_OVER_LIMIT = re.compile(r'Usage of EmptyDir volume "([^"]+)" exceeds the limit')
"""The kubelet's eviction message for an emptyDir over its sizeLimit; the group is the volume's name."""

VOLUME_SETTINGS = {
    TMP_VOLUME: "spec.tmpSize (the size limit of each pod's /tmp: the node's local checkpoints until they "
                "are uploaded, library caches and what the training code writes there; 0 for no limit)",
    SHM_VOLUME: "spec.shmSize (the size limit of each pod's /dev/shm, memory-backed: DataLoader workers and "
                "NCCL use it)",
}
"""The setting a job raises when the kubelet evicts its pod for one of kubetrain's own volumes."""

DISRUPTION_POD_REASONS = frozenset({
    "Evicted", "Preempting", "Shutdown", "NodeShutdown", "Terminated", "NodeLost",
    "UnexpectedAdmissionError",
})
"""`pod.status.reason` values the node or the cluster set when it took the pod away."""


def supervise(d: Draft, observed: Observed) -> None:
    """Watch a started attempt: classify failures, detect success and readiness."""
    spec = d.job.spec
    assert spec is not None
    attempt = d.status.attempt
    total = d.status.nodes_total or spec.nodes
    current = {p.rank: p for p in observed.pods if p.attempt == attempt and p.rank < total}
    stale = [p for p in observed.pods if p.attempt != attempt or p.rank >= total]

    fatal: tuple[str, str] | None = None
    disruptions: list[tuple[str, str]] = []
    failed: list[PodView] = []
    blocked: tuple[str, str, dt.datetime] | None = None
    done_and_gone = 0  # ranks whose pod succeeded and was deleted since: done, not taken away
    for rank in range(total):
        pod = current.get(rank)
        if pod is None:
            name = pod_name(d.job.name, attempt, rank)
            why = observed.gone.get(name)
            if why == GONE_SUCCEEDED:
                done_and_gone += 1
                continue
            disruptions.append((why, f"pod {name}: {why} (deleted)") if why else
                               ("Deleted", f"pod {name} was deleted by someone else"))
            continue
        if pod.phase == "Failed" and pod.exit_code == EXIT_INVALID_CONFIG:
            fatal = fatal or _invalid_configuration(d, pod)
        elif pod.waiting_reason in FATAL_WAITING_REASONS:
            detail = excerpt(pod.waiting_message)
            fatal = fatal or (pod.waiting_reason or "", f"pod {pod.name}: {pod.waiting_reason}"
                                                        + (f": {detail}" if detail else ""))
        elif (problem := _startup_problem(d, pod)) is not None:
            reason, message, deadline = problem
            if d.now >= deadline:
                grace = d.job.spec.run_policy.startup_grace_seconds if d.job.spec else 0
                fatal = fatal or (reason, f"{message} (still failing after runPolicy.startupGraceSeconds={grace}s)")
            elif blocked is None or deadline < blocked[2]:
                blocked = problem
        why = _disruption(pod, d, observed)
        if why:
            disruptions.append(why)
        elif pod.phase == "Failed":
            failed.append(pod)

    if fatal:
        fail(d, observed, reason=fatal[0], message=fatal[1])
        return
    if disruptions:
        _restart_after_preemption(d, observed, disruptions)
        return
    if failed and (unsettled := _unsettled_node([p for p in current.values() if p.active], observed)):
        # A rank that fails while a peer's node is unreachable most likely failed because of it (its collectives
        # timed out): the node's verdict decides, at the end of its grace (`_node_lost` set the wake-up; past it,
        # that peer is a disruption above). Finished pods are no such peer (nor the failed one's own node).
        d.update(message=f"attempt {attempt}: pod {failed[0].name} exited with code {failed[0].exit_code}"
                         f"{_exit_reason(failed[0])} while "
                         f"{unsettled}; waiting for the node (runPolicy.nodeLostGraceSeconds) before counting an "
                         "application failure")
        return
    if failed:
        _restart_after_failure(d, observed, failed[0])
        return
    delete_pods(d, observed, stale)
    _startup_condition(d, blocked)
    pods = [current[r] for r in range(total) if r in current]
    _scheduling_condition(d, pods)
    _slow_container_creation(d, pods)
    lagging = next((p.checkpoint_sync for p in pods if p.checkpoint_sync and p.active), "")
    polled = lagging_message(d.status.progress)  # None: no reading to go by (unreachable, not polled)
    if lagging or polled:
        # The annotation is the pod's to write: cut and redacted like every other text a pod reports.
        d.cond("CheckpointsLagging", "True", "UploadsLagging", excerpt(lagging) if lagging else polled or "")
    elif (c := d.status.condition("CheckpointsLagging")) is not None and c.status == "True" \
            and (polled is not None or d.status.progress is None or not c.message.endswith(FROM_PROGRESS)):
        # Set from the pods' annotation (now gone): cleared; from /progress: only by a reading that says so.
        d.cond("CheckpointsLagging", "False", "UploadsCaughtUp", "checkpoint uploads caught up")
    if all(p.phase == "Succeeded" for p in pods):  # every rank's pod succeeded (some may be deleted since)
        msg = f"attempt {attempt}: all {total} pod(s) succeeded"
        d.update(phase="Succeeded", message=msg, completion_time=format_time(d.now), nodes_ready=0)
        d.cond("Running", "False", "Succeeded", msg)
        d.cond("Succeeded", "True", "Succeeded", msg)
        d.event("Normal", "Succeeded", msg)
        ttl(d)
        return
    running = sum(p.phase in ("Running", "Succeeded") for p in pods) + done_and_gone
    ready = sum(p.phase == "Running" and p.ready for p in pods)
    if d.status.phase == "Running" or running == total or d.status != d.job.status:
        # While a gang starts, its pods come up in a burst: one status write when all
        # run, not one per pod (the API server is the bottleneck of big launches).
        d.update(nodes_ready=ready)
    if running == total and d.status.phase != "Running":
        msg = f"attempt {attempt}: all {total} pod(s) running"
        d.update(phase="Running", message=msg)
        d.cond("Running", "True", "AllPodsRunning", msg)
        d.event("Normal", "Running", msg)


def gang_succeeded(d: Draft, observed: Observed) -> bool:
    """Every rank of the started attempt succeeded (its pod Succeeded, or deleted after it succeeded):
    the run is done, whatever the clock says now (activeDeadlineSeconds is not checked against it)."""
    total = d.status.nodes_total or (d.job.spec.nodes if d.job.spec else 0)
    current = {p.rank: p for p in observed.pods if p.attempt == d.status.attempt and p.rank < total}
    return total > 0 and all(
        current[r].phase == "Succeeded" if r in current
        else observed.gone.get(pod_name(d.job.name, d.status.attempt, r)) == GONE_SUCCEEDED
        for r in range(total))


def _disruption(pod: PodView, d: Draft, observed: Observed) -> tuple[str, str] | None:
    """(cause, why) when this pod was taken away by the cluster (not by the user's code). The
    cause is a CamelCase word for metrics: the DisruptionTarget reason, the pod's reason,
    Deleted, TrainerPreempted, NoExitCode or NodeLost."""
    if pod.phase == "Succeeded" or _evicted_for_own_usage(pod):
        return None
    if pod.disruption:
        return pod.disruption, f"pod {pod.name}: {pod.disruption}"
    if pod.terminating:
        return "Deleted", f"pod {pod.name} was deleted by someone else"
    if pod.phase == "Failed":
        if pod.exit_code == EXIT_PREEMPTED:
            return "TrainerPreempted", f"pod {pod.name} exited with code {EXIT_PREEMPTED} (preempted)"
        if pod.reason in DISRUPTION_POD_REASONS:
            return pod.reason, f"pod {pod.name}: {pod.reason}"
        if pod.exit_code is None:
            return "NoExitCode", f"pod {pod.name} failed without an exit code ({pod.reason or 'no reason'})"
    lost = _node_lost(pod, d, observed)
    return ("NodeLost", lost) if lost else None


def _node_lost(pod: PodView, d: Draft, observed: Observed) -> str | None:
    """Why the pod's node (or the pod itself) counts as lost; schedules a wake-up
    for the end of the grace period when it is not lost *yet*."""
    grace = dt.timedelta(seconds=d.job.spec.run_policy.node_lost_grace_seconds if d.job.spec else 60)
    node = observed.nodes.get(pod.node_name) if pod.node_name else None
    if node is not None and not (node.ready and node.exists):
        since = node.since or d.now
        if d.now >= since + grace:
            state = "was deleted" if not node.exists else "is NotReady"
            return f"node {node.name} {state} for more than {int(grace.total_seconds())}s"
        d.wake_at(since + grace)
    if pod.phase == "Unknown":
        since = pod.ready_changed or d.now
        if d.now >= since + grace:
            return f"pod {pod.name} is in phase Unknown for more than {int(grace.total_seconds())}s"
        d.wake_at(since + grace)
    return None


def _unsettled_node(pods: list[PodView], observed: Observed) -> str:
    """What is unreachable under these (running) pods, within its grace (past it, a disruption): "" if nothing."""
    for pod in pods:
        node = observed.nodes.get(pod.node_name) if pod.node_name else None
        if node is not None and not (node.ready and node.exists):
            return f"node {node.name} (pod {pod.name}) is {'NotReady' if node.exists else 'gone'}"
        if pod.phase == "Unknown":
            return f"pod {pod.name} is in phase Unknown"
    return ""


def _setting_to_raise(pod: PodView) -> str:
    """" Raise spec.tmpSize (...)" when the kubelet evicted the pod for one of kubetrain's volumes, else ""."""
    found = EMPTYDIR_OVER_LIMIT.search(pod.status_message)
    setting = VOLUME_SETTINGS.get(found.group(1)) if found else None
    return f" Raise {setting}" if setting else ""


def _evicted_for_own_usage(pod: PodView) -> bool:
    return pod.phase == "Failed" and pod.reason == "Evicted" and bool(SELF_INFLICTED_EVICTION.search(pod.status_message))


def _startup_problem(d: Draft, pod: PodView) -> tuple[str, str, dt.datetime] | None:
    """(reason, message, deadline) when the pod fails to start for a possibly transient reason."""
    if pod.waiting_reason not in TRANSIENT_WAITING_REASONS:
        return None
    grace = d.job.spec.run_policy.startup_grace_seconds if d.job.spec else 0
    since = pod.starting_since or parse_time(d.status.start_time) or d.now
    detail = excerpt(pod.waiting_message)
    message = f"pod {pod.name}: {pod.waiting_reason}" + (f": {detail}" if detail else "")
    return pod.waiting_reason or "", message, since + dt.timedelta(seconds=grace)


def _startup_condition(d: Draft, blocked: tuple[str, str, dt.datetime] | None) -> None:
    """Condition StartupDelayed while a pod fails to start for a possibly transient reason
    (a Warning event when it begins or its reason changes); the wake-up at the deadline
    turns a persisting one into Failed."""
    current = d.status.condition("StartupDelayed")
    if blocked is None:
        if current is not None and current.status == "True":
            d.cond("StartupDelayed", "False", "PodsStarted", "no pod is failing to start")
            _waiting_message(d, ended=" (retrying)")
        return
    reason, message, deadline = blocked
    text = (f"{message}; the kubelet retries, the job fails if this persists until "
            f"{format_time(deadline)} (runPolicy.startupGraceSeconds)")
    if current is None or current.status != "True" or _family(current.reason) != _family(reason):
        d.event("Warning", "StartupDelayed", text)  # not again when the kubelet flips ErrImagePull <-> BackOff
    if current is None or current.status != "True" or current.reason != reason or current.message != text:
        d.cond("StartupDelayed", "True", reason, text)
        d.update(message=f"attempt {d.status.attempt}: {message} (retrying)")
    d.wake_at(deadline)


def _scheduling_condition(d: Draft, pods: list[PodView]) -> None:
    """Condition Unschedulable (and a Warning event when it begins) while the scheduler cannot place a pod
    of the gang, with its message (insufficient nvidia.com/gpu, a node selector no node matches, a missing
    PersistentVolumeClaim). Not a failure: a cluster autoscaler or a finishing job may make room."""
    current = d.status.condition("Unschedulable")
    stuck = next((p for p in pods if p.unschedulable and p.phase == "Pending" and not p.node_name), None)
    if stuck is None:
        # False only once every pod is on a node: a pod the scheduler has not looked at yet proves nothing.
        if current is not None and current.status == "True" and all(p.node_name for p in pods):
            d.cond("Unschedulable", "False", "PodsScheduled", "every pod of the gang is scheduled")
            if d.status.phase == "Pending" and d.status.message.startswith(f"attempt {d.status.attempt}: waiting "
                                                                            "for the gang to be scheduled"):
                d.update(message=f"attempt {d.status.attempt}: {len(pods)} pod(s) scheduled, waiting for them to run")
        return
    text = f"pod {stuck.name} cannot be scheduled: {excerpt(stuck.unschedulable)}"
    if current is None or current.status != "True":
        d.event("Warning", "Unschedulable", text)
    # Rewritten when the reasons change, not when only a count does ("0/8 nodes are available: 3 Insufficient
    # nvidia.com/gpu" moves with every node an autoscaler adds): one status write per change of reason.
    if current is None or current.status != "True" or message_shape(current.message) != message_shape(text):
        d.cond("Unschedulable", "True", "Unschedulable", text)
        d.update(message=f"attempt {d.status.attempt}: waiting for the gang to be scheduled: {text}")


def _waiting_message(d: Draft, *, ended: str) -> None:
    """The job's message once the start problem it named (its text ends with `ended`) is gone: the pods are
    waiting to run, no longer failing (it said ImagePullBackOff until the whole gang ran)."""
    if d.status.phase == "Pending" and d.status.message.endswith(ended):
        d.update(message=f"attempt {d.status.attempt}: {d.status.nodes_total} pod(s) created, waiting for them to run")


SLOW_START_MIN_SECONDS = 120
"""The least time a container may take to be created before the job names it (startupGraceSeconds may be 0)."""


def _slow_container_creation(d: Draft, pods: list[PodView]) -> None:
    """Condition StartupSlow while a pod on its node is still creating its container after
    runPolicy.startupGraceSeconds (at least SLOW_START_MIN_SECONDS): it names the pod and where to look (a Secret
    or ConfigMap volume that cannot mount shows only in the pod's FailedMount events; the job said "waiting for
    them to run" forever), with one Warning event when it turns True. Not a failure (a large image can take that
    long to pull), and it gives way to StartupDelayed and Unschedulable, which say more."""
    grace = max(d.job.spec.run_policy.startup_grace_seconds if d.job.spec else 0, SLOW_START_MIN_SECONDS)
    slow = None
    for pod in pods:
        if pod.waiting_reason == "ContainerCreating" and pod.node_name and pod.starting_since is not None:
            due = pod.starting_since + dt.timedelta(seconds=grace)
            if d.now >= due:
                slow = slow or pod
            else:
                d.wake_at(due)
    current = d.status.condition("StartupSlow")
    louder = any((c := d.status.condition(t)) is not None and c.status == "True"
                 for t in ("StartupDelayed", "Unschedulable"))
    if slow is None or louder or d.status.phase != "Pending":
        if current is not None and current.status == "True":
            d.cond("StartupSlow", "False", "ContainersCreated", "no pod is slow to create its container")
            _waiting_message(d, ended="shows the kubelet's events)")
        return
    message = (f"pod {slow.name} has been creating its container on node {slow.node_name} for more than {grace}s: "
               f"a large image still pulling, or a volume that cannot mount (kubectl describe pod {slow.name} "
               "shows the kubelet's events)")
    if current is None or current.status != "True":
        d.cond("StartupSlow", "True", "ContainerCreating", message)
        d.update(message=f"attempt {d.status.attempt}: {message}")
        d.event("Warning", "StartupSlow", message)


def message_shape(message: str) -> str:
    """A message with its numbers blanked: the same refusal or scheduling verdict with other counts."""
    return re.sub(r"[0-9]+", "#", message)


def _family(reason: str) -> str:
    return "ImagePull" if reason in ("ErrImagePull", "ImagePullBackOff") else reason


def _invalid_configuration(d: Draft, pod: PodView) -> tuple[str, str]:
    """(reason, message) of a pod that exited 82: InvalidConfiguration, or the reason of its
    failure record with the store's code and the location (only one inside this job's own
    checkpoint prefix: the operator publishes no other place a pod names)."""
    what = f"pod {pod.name} exited with code {EXIT_INVALID_CONFIG} (invalid configuration)"
    failure = pod.failure
    if failure is None:
        return "InvalidConfiguration", what + _tail(d, pod)
    prefix = d.job.checkpoint_uri
    where = failure.where if failure.where and prefix and (
        failure.where == prefix or failure.where.startswith(prefix + "/")) else None
    details = ", ".join([failure.reason] + ([f"code {failure.code}"] if failure.code else [])
                        + ([f"at {where}"] if where else []))
    return failure.reason, f"{what}: {FAILURE_REASONS[failure.reason]} ({details}){_tail(d, pod)}"


def _tail(d: Draft, pod: PodView) -> str:
    """Where to read why a pod failed. Its output is never copied into status or events:
    logs can carry credentials, and a pod's text is not the operator's to publish."""
    return f"; its log says why: kubectl logs -n {d.job.namespace} {pod.name}"


def _restart(d: Draft, observed: Observed, *, reason: str, message: str, delay: float) -> None:
    d.update(phase="Restarting", message=message, nodes_ready=0,
             next_attempt_time=format_time(d.now + dt.timedelta(seconds=delay)))
    d.cond("Running", "False", reason, message)
    d.cond("Restarting", "True", reason, message)
    delete_pods(d, observed, observed.pods)
    if delay > 0:
        d.wake_at(d.now + dt.timedelta(seconds=delay))


def _restart_after_preemption(d: Draft, observed: Observed, disruptions: list[tuple[str, str]]) -> None:
    attempt = d.status.attempt
    count = d.status.preemptions + 1
    first = disruptions[0][1] + (f" (and {len(disruptions) - 1} more)" if len(disruptions) > 1 else "")
    d.update(preemptions=count)
    d.event("Warning", "Preempted", f"attempt {attempt}: {first}", cause=disruptions[0][0])
    limit = d.job.spec.run_policy.max_preemptions if d.job.spec else None
    if limit is not None and count > limit:
        fail(d, observed, reason="MaxPreemptionsExceeded",
              message=f"{count} preemptions exceed maxPreemptions {limit}; last: {first}")
        return
    msg = f"attempt {attempt} preempted ({first}); restarting the gang as attempt {attempt + 1}"
    _restart(d, observed, reason="Preempted", message=msg, delay=0)
    d.event("Normal", "Restarting", f"restarting the whole gang as attempt {attempt + 1} "
                                    f"(preemption {count}, backoffLimit untouched)")


def _exit_reason(pod: PodView) -> str:
    """The kubelet's reason for the exit, when it says more than the code (OOMKilled: the memory limit)."""
    if pod.exit_reason == "OOMKilled":
        return " (OOMKilled: the trainer container reached its memory limit, spec.resources.limits.memory)"
    if pod.exit_reason and pod.exit_reason not in ("Error", "Completed"):
        return f" ({pod.exit_reason})"
    return ""


def _restart_after_failure(d: Draft, observed: Observed, pod: PodView) -> None:
    policy = d.job.spec.run_policy
    attempt = d.status.attempt
    failures = d.status.failures + 1
    d.update(failures=failures)
    if _evicted_for_own_usage(pod):
        what = (f"pod {pod.name} (node rank {pod.rank}) was evicted for its own resource usage: "
                f"{excerpt(pod.status_message)}{_setting_to_raise(pod)}")
    else:
        what = f"pod {pod.name} (node rank {pod.rank}) exited with code {pod.exit_code}{_exit_reason(pod)}"
    # A rank that waited for a peer the scheduler never placed times out in its rendezvous: name the cause.
    stuck = [p for p in observed.pods if p.attempt == attempt and p.unschedulable and not p.node_name]
    if stuck:
        what += (f", while {len(stuck)} pod(s) of the gang could not be scheduled ({stuck[0].name}: "
                 f"{excerpt(stuck[0].unschedulable, 160)})")
    if failures > policy.backoff_limit:
        fail(d, observed, reason="BackoffLimitExceeded",
              message=f"{what}; {failures} application failure(s) exceed backoffLimit "
                      f"{policy.backoff_limit}{_tail(d, pod)}")
        return
    delay = policy.backoff_delay(failures)
    msg = (f"attempt {attempt} failed: {what}; restarting as attempt {attempt + 1} in {delay:g}s "
           f"(failure {failures} of backoffLimit {policy.backoff_limit})")
    _restart(d, observed, reason="BackoffRestart", message=msg, delay=delay)
    d.event("Warning", "BackoffRestart", msg)
