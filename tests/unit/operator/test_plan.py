"""Table tests of the pure planner: every row of issue 3's failure semantics."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.api import Job
from kubetrain.actions import CreatePod, CreateService, DeleteJob, DeletePod, EnsureDeepSpeedConfigMap, PatchStatus
from kubetrain.observe import GONE_SUCCEEDED, NodeView, Observed
from kubetrain.plan import plan
from kubetrain_factories import at, gang, iso, job, observed, pod, started


def record(step: int, *, uri: str | None = None, time: str | None = None) -> str:
    """The trainer's last-checkpoint record for job ns/tj (docs/contract.md)."""
    body: dict[str, Any] = {"kind": "kubetrain.io/last-checkpoint", "step": step,
                            "uri": uri or f"s3://b/p/ns/tj/checkpoint-{step}"}
    if time:
        body["time"] = time
    return json.dumps(body)


NO_GPU = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are available."
UNSCHEDULABLE = {"type": "Unschedulable", "status": "True", "reason": "Unschedulable", "lastTransitionTime": iso(0),
                 "message": f"pod tj-a1-n0 cannot be scheduled: {NO_GPU}"}
WAITING = f"attempt 1: waiting for the gang to be scheduled: {UNSCHEDULABLE['message']}"
CKPT = {"checkpoint": {"uri": "s3://b/p", "credentialsSecret": {"name": "s3"}}}


def failure(reason: str, code: str | None = None, where: str | None = None) -> str:
    """The trainer's failure record (docs/contract.md, "Reporting a failure")."""
    body = {"kind": "kubetrain.io/failure", "reason": reason}
    body.update({k: v for k, v in (("code", code), ("where", where)) if v is not None})
    return json.dumps(body)


@dataclass
class Case:
    id: str
    job: Job
    obs: Observed
    now: float = 5
    phase: str | None = None
    """Expected status.phase after the plan; None: no status write expected."""
    counters: dict[str, int] = field(default_factory=dict)
    creates: list[int] | None = None
    """Ranks of CreatePod actions (None: no creation)."""
    deletes: list[str] | None = None
    force: list[str] = field(default_factory=list)
    events: list[str] | None = None
    """Expected event reasons, in order (None: not checked)."""
    requeue: float | None = None
    message: str | None = None
    reason: tuple[str, str] | None = None
    """(condition type, reason) expected among the conditions."""
    extra: Any = None


CASES = [
    # --- start -------------------------------------------------------------
    Case("fresh job creates service and the whole gang", job(nodes=3), observed(),
         phase="Pending", counters={"attempt": 1, "restarts": 0, "nodes_total": 3},
         creates=[0, 1, 2], events=["Created"], reason=("Created", "PodsCreated")),
    Case("restart after crash mid-creation creates only the missing pods", job(nodes=3),
         observed(pod(rank=0, phase="Pending"), pod(rank=2, phase="Pending")),
         phase="Pending", counters={"attempt": 1}, creates=[1], events=["Created"]),
    Case("all pods exist but status not written yet: no creation, status recorded", job(nodes=2),
         observed(*gang(2, phase="Pending")), phase="Pending", counters={"attempt": 1}, creates=[], events=["Created"]),
    Case("pending pods: nothing to do", job(status=started(phase="Pending")),
         observed(*gang(phase="Pending")), phase=None),
    Case("all pods running -> Running with event", job(status=started(phase="Pending")),
         observed(*gang()), phase="Running", counters={"nodes_ready": 2}, events=["Running"],
         reason=("Running", "AllPodsRunning")),
    Case("one pod of a starting gang running: no status write until all run", job(status=started(phase="Pending")),
         observed(pod(rank=0), pod(rank=1, phase="Pending")), phase=None, events=[]),
    Case("running gang loses readiness of one pod: nodesReady follows", job(status=started(nodesReady=2)),
         observed(pod(rank=0), pod(rank=1, ready=False)), phase="Running", counters={"nodes_ready": 1}, events=[]),
    Case("steady running: no writes", job(status=started(nodesReady=2)), observed(*gang()), phase=None),
    # --- success -----------------------------------------------------------
    Case("all pods succeeded -> Succeeded", job(status=started(nodesReady=2)),
         observed(*gang(phase="Succeeded", exit_code=0)), phase="Succeeded", events=["Succeeded"],
         reason=("Succeeded", "Succeeded")),
    Case("one succeeded, one still running: keep waiting", job(status=started(nodesReady=2)),
         observed(pod(rank=0, phase="Succeeded", exit_code=0), pod(rank=1)), phase="Running",
         counters={"nodes_ready": 1}),
    # --- preemption --------------------------------------------------------
    Case("DisruptionTarget (scheduler preemption) -> preemption restart, gang deleted",
         job(status=started()), observed(pod(rank=0, disruption="PreemptionByScheduler", deleting=True), pod(rank=1)),
         phase="Restarting", counters={"preemptions": 1, "failures": 0, "attempt": 1},
         deletes=["tj-a1-n1"], events=["Preempted", "Restarting"], reason=("Restarting", "Preempted")),
    Case("eviction API -> preemption", job(status=started()),
         observed(pod(rank=0, disruption="EvictionByEvictionAPI"), pod(rank=1)),
         phase="Restarting", counters={"preemptions": 1, "failures": 0},
         deletes=["tj-a1-n0", "tj-a1-n1"], events=["Preempted", "Restarting"]),
    Case("pod deleted by someone else (terminating) -> preemption", job(status=started()),
         observed(pod(rank=0, deleting=True), pod(rank=1)), phase="Restarting",
         counters={"preemptions": 1, "failures": 0}, deletes=["tj-a1-n1"]),
    Case("pod gone from a started attempt -> preemption", job(status=started()),
         observed(pod(rank=1)), phase="Restarting", counters={"preemptions": 1}, deletes=["tj-a1-n1"],
         message="tj-a1-n0 was deleted"),
    Case("pod gone after DisruptionTarget: the reason is kept", job(status=started()),
         Observed(pods=(pod(rank=1),), gone={"tj-a1-n0": "EvictionByEvictionAPI"}), phase="Restarting",
         counters={"preemptions": 1}, message="EvictionByEvictionAPI"),
    Case("exit 83 -> preemption, backoffLimit untouched", job(status=started(failures=1)),
         observed(pod(rank=0, phase="Failed", exit_code=83), pod(rank=1)), phase="Restarting",
         counters={"preemptions": 1, "failures": 1}, events=["Preempted", "Restarting"]),
    Case("137 with DisruptionTarget -> preemption", job(status=started()),
         observed(pod(rank=0, phase="Failed", exit_code=137, disruption="TerminationByKubelet"), pod(rank=1)),
         phase="Restarting", counters={"preemptions": 1, "failures": 0}),
    Case("peer crash after a preemption is not an application failure", job(status=started()),
         observed(pod(rank=0, phase="Failed", exit_code=83), pod(rank=1, phase="Failed", exit_code=1)),
         phase="Restarting", counters={"preemptions": 1, "failures": 0}),
    Case("kubelet eviction (status.reason Evicted) -> preemption", job(status=started()),
         observed(pod(rank=0, phase="Failed", reason="Evicted"), pod(rank=1)), phase="Restarting",
         counters={"preemptions": 1, "failures": 0}),
    Case("node-pressure eviction of a pod within its requests -> preemption", job(status=started()),
         observed(pod(rank=0, phase="Failed", reason="Evicted", disruption="TerminationByKubelet",
                      status_message="The node was low on resource: memory. Threshold quantity: 100Mi, "
                                     "available: 80Mi. "), pod(rank=1)),
         phase="Restarting", counters={"preemptions": 1, "failures": 0}),
    Case("evicted for overusing its ephemeral storage limit -> application failure, not preemption",
         job(status=started()),
         observed(pod(rank=0, phase="Failed", reason="Evicted", disruption="TerminationByKubelet",
                      status_message="Pod ephemeral local storage usage exceeds the total limit of containers 1Gi."),
                  pod(rank=1)),
         phase="Restarting", counters={"preemptions": 0, "failures": 1}, events=["BackoffRestart"],
         message="evicted for its own resource usage: Pod ephemeral local storage usage exceeds"),
    Case("evicted for an emptyDir over its sizeLimit -> application failure", job(status=started()),
         observed(pod(rank=0, phase="Failed", reason="Evicted",
                      status_message='Usage of EmptyDir volume "tmp" exceeds the limit "1Gi". '), pod(rank=1)),
         phase="Restarting", counters={"preemptions": 0, "failures": 1}),
    Case("kubetrain-tmp over its sizeLimit: the message names spec.tmpSize, the setting to raise",
         job(status=started(), spec={"tmpSize": "20Gi"}),
         observed(pod(rank=0, phase="Failed", reason="Evicted",
                      status_message='Usage of EmptyDir volume "kubetrain-tmp" exceeds the limit "20Gi". '),
                  pod(rank=1)),
         phase="Restarting", counters={"preemptions": 0, "failures": 1},
         message='exceeds the limit "20Gi". Raise spec.tmpSize (the size limit of each pod\'s /tmp'),
    Case("kubetrain-shm over its sizeLimit: the message names spec.shmSize",
         job(status=started(), spec={"shmSize": "2Gi"}, run_policy={"backoffLimit": 0}),
         observed(pod(rank=0, phase="Failed", reason="Evicted",
                      status_message='Usage of EmptyDir volume "kubetrain-shm" exceeds the limit "2Gi". '),
                  pod(rank=1)),
         phase="Failed", reason=("Failed", "BackoffLimitExceeded"), counters={"failures": 1},
         message="Raise spec.shmSize (the size limit of each pod's /dev/shm"),
    Case("the user's own emptyDir over its sizeLimit names no kubetrain setting",
         job(status=started()),
         observed(pod(rank=0, phase="Failed", reason="Evicted",
                      status_message='Usage of EmptyDir volume "scratch" exceeds the limit "1Gi". '), pod(rank=1)),
         phase="Restarting", counters={"failures": 1}, extra={"has": 'volume "scratch"', "no": "Raise spec."}),
    Case("evicted under memory pressure while using more than requested -> application failure",
         job(status=started()),
         observed(pod(rank=0, phase="Failed", reason="Evicted", disruption="TerminationByKubelet",
                      status_message="The node was low on resource: memory. Threshold quantity: 100Mi, available: "
                                     "80Mi. Container trainer was using 3Gi, request is 1Gi, has larger consumption "
                                     "of memory. "), pod(rank=1)),
         phase="Restarting", counters={"preemptions": 0, "failures": 1}),
    Case("a job evicting itself again and again ends at backoffLimit", job(status=started(failures=3)),
         observed(pod(rank=0, phase="Failed", reason="Evicted",
                      status_message="Container trainer exceeded its local ephemeral storage limit \"1Gi\". "),
                  pod(rank=1)),
         phase="Failed", reason=("Failed", "BackoffLimitExceeded"), counters={"preemptions": 0, "failures": 4}),
    Case("an OOMKilled rank: the message says so, naming the memory limit (137 alone did not)",
         job(status=started(), run_policy={"backoffLimit": 3}),
         observed(pod(rank=0, phase="Failed", exit_code=137, exit_reason="OOMKilled"), pod(rank=1)),
         phase="Restarting", counters={"failures": 1},
         message="exited with code 137 (OOMKilled: the trainer container reached its memory limit"),
    Case("a plain Error reason adds nothing to the exit code",
         job(status=started(), run_policy={"backoffLimit": 3}),
         observed(pod(rank=0, phase="Failed", exit_code=1, exit_reason="Error"), pod(rank=1)),
         phase="Restarting", counters={"failures": 1}, extra={"has": "exited with code 1;", "no": "(Error)"}),
    Case("node NotReady within grace: wait and requeue", job(status=started(), run_policy={"nodeLostGraceSeconds": 30}),
         observed(*gang(), nodes={"kwok-0": NodeView("kwok-0", ready=False, since=at(0))}), now=10,
         phase=None, requeue=20),
    Case("node NotReady beyond grace -> preemption", job(status=started(), run_policy={"nodeLostGraceSeconds": 30}),
         observed(*gang(), nodes={"kwok-0": NodeView("kwok-0", ready=False, since=at(0))}), now=31,
         phase="Restarting", counters={"preemptions": 1, "failures": 0}, message="NotReady",
         force=["tj-a1-n0", "tj-a1-n1"]),
    # A rank that fails while a peer's node is unreachable failed because of it, most likely: the node decides.
    Case("a rank fails while a peer's node is NotReady within grace: no failure counted yet, wait for the node",
         job(status=started(), run_policy={"nodeLostGraceSeconds": 30, "backoffLimit": 0}),
         observed(pod(rank=0, node="n0"), pod(rank=1, node="n1", phase="Failed", exit_code=1),
                  nodes={"n0": NodeView("n0", ready=False, since=at(0)), "n1": NodeView("n1")}), now=10,
         phase="Running", counters={"preemptions": 0, "failures": 0}, requeue=20, message="waiting for the node"),
    Case("... and the node lost at the end of its grace: a preemption, backoffLimit untouched",
         job(status=started(), run_policy={"nodeLostGraceSeconds": 30, "backoffLimit": 0}),
         observed(pod(rank=0, node="n0"), pod(rank=1, node="n1", phase="Failed", exit_code=1),
                  nodes={"n0": NodeView("n0", ready=False, since=at(0)), "n1": NodeView("n1")}), now=31,
         phase="Restarting", counters={"preemptions": 1, "failures": 0}, message="NotReady", force=["tj-a1-n0"]),
    Case("a finished rank's node NotReady is no peer lost: an application failure at once (not held forever)",
         job(status=started(), run_policy={"nodeLostGraceSeconds": 30, "backoffLimit": 0}),
         observed(pod(rank=0, node="n0", phase="Succeeded", exit_code=0),
                  pod(rank=1, node="n1", phase="Failed", exit_code=1),
                  nodes={"n0": NodeView("n0", ready=False, since=at(0)), "n1": NodeView("n1")}), now=10,
         phase="Failed", reason=("Failed", "BackoffLimitExceeded"), counters={"preemptions": 0, "failures": 1}),
    Case("... or the node back: an application failure",
         job(status=started(), run_policy={"nodeLostGraceSeconds": 30, "backoffLimit": 0}),
         observed(pod(rank=0, node="n0"), pod(rank=1, node="n1", phase="Failed", exit_code=1),
                  nodes={"n0": NodeView("n0"), "n1": NodeView("n1")}), now=10,
         phase="Failed", reason=("Failed", "BackoffLimitExceeded"), counters={"preemptions": 0, "failures": 1}),
    Case("node deleted beyond grace -> preemption, pods force-deleted",
         job(status=started(), run_policy={"nodeLostGraceSeconds": 0}),
         observed(*gang(), nodes={"kwok-0": NodeView("kwok-0", exists=False, since=at(5))}), now=5,
         phase="Restarting", counters={"preemptions": 1}, deletes=["tj-a1-n0", "tj-a1-n1"],
         force=["tj-a1-n0", "tj-a1-n1"], message="was deleted"),
    Case("pod phase Unknown beyond grace -> preemption", job(status=started(), run_policy={"nodeLostGraceSeconds": 10}),
         observed(pod(rank=0, phase="Unknown", ready=False, ready_since=iso(0)), pod(rank=1)), now=11,
         phase="Restarting", counters={"preemptions": 1}),
    Case("pod phase Unknown within grace: requeue", job(status=started(), run_policy={"nodeLostGraceSeconds": 10}),
         observed(pod(rank=0, phase="Unknown", ready=False, ready_since=iso(0)), pod(rank=1)), now=4,
         phase="Running", counters={"nodes_ready": 1}, requeue=6),
    Case("maxPreemptions exceeded -> Failed", job(status=started(preemptions=2), run_policy={"maxPreemptions": 2}),
         observed(pod(rank=0, disruption="PreemptionByScheduler"), pod(rank=1)), phase="Failed",
         counters={"preemptions": 3}, events=["Preempted", "Failed"], reason=("Failed", "MaxPreemptionsExceeded")),
    Case("maxPreemptions 0 means none allowed", job(status=started(), run_policy={"maxPreemptions": 0}),
         observed(pod(rank=0, disruption="PreemptionByScheduler"), pod(rank=1)), phase="Failed"),
    Case("maxPreemptions defaults to 30: the 30th preemption restarts", job(status=started(preemptions=29)),
         observed(pod(rank=0, disruption="PreemptionByScheduler"), pod(rank=1)), phase="Restarting",
         counters={"preemptions": 30}),
    Case("maxPreemptions defaults to 30: the 31st fails the job", job(status=started(preemptions=30)),
         observed(pod(rank=0, disruption="PreemptionByScheduler"), pod(rank=1)), phase="Failed",
         reason=("Failed", "MaxPreemptionsExceeded"), message="exceed maxPreemptions 30"),
    # --- application failure --------------------------------------------------
    Case("exit 1 -> failure 1, backoff 10s", job(status=started()),
         observed(pod(rank=0, phase="Failed", exit_code=1), pod(rank=1)), phase="Restarting",
         counters={"failures": 1, "preemptions": 0}, deletes=["tj-a1-n0", "tj-a1-n1"],
         events=["BackoffRestart"], requeue=10, reason=("Restarting", "BackoffRestart"),
         extra={"next_attempt_time": iso(15)}),
    Case("third failure backs off 10*2^2 = 40s", job(status=started(failures=2), run_policy={"backoffLimit": 5}),
         observed(pod(rank=0), pod(rank=1, phase="Failed", exit_code=2)), phase="Restarting",
         counters={"failures": 3}, requeue=40, message="exited with code 2"),
    Case("backoff capped at 300s", job(status=started(failures=9), run_policy={"backoffLimit": 20}),
         observed(pod(rank=0, phase="Failed", exit_code=1), pod(rank=1)), phase="Restarting", requeue=300),
    Case("137 without disruption is an application failure", job(status=started()),
         observed(pod(rank=0, phase="Failed", exit_code=137), pod(rank=1)), phase="Restarting",
         counters={"failures": 1, "preemptions": 0}),
    Case("backoffLimit exceeded -> Failed with exit code and where its log is", job(status=started(failures=3)),
         observed(pod(rank=0, phase="Failed", exit_code=7, message="Traceback: boom"), pod(rank=1)),
         phase="Failed", counters={"failures": 4}, deletes=["tj-a1-n1"], events=["Failed"],
         reason=("Failed", "BackoffLimitExceeded"), message="exited with code 7",
         extra={"no": "Traceback", "has": "kubectl logs -n ns tj-a1-n0"}),
    Case("backoffLimit 0 fails at the first failure", job(status=started(), run_policy={"backoffLimit": 0}),
         observed(pod(rank=0, phase="Failed", exit_code=1), pod(rank=1, phase="Failed", exit_code=1)),
         phase="Failed", deletes=[], message="code 1"),
    # --- cannot ever work ------------------------------------------------------
    Case("exit 82 -> Failed at once, no restart; its output is not copied", job(status=started()),
         observed(pod(rank=0, phase="Failed", exit_code=82, message="unknown arg 'lr' AWS_SECRET_ACCESS_KEY=abc"),
                  pod(rank=1)),
         phase="Failed", counters={"failures": 0}, deletes=["tj-a1-n1"], events=["Failed"],
         reason=("Failed", "InvalidConfiguration"), message="code 82 (invalid configuration)",
         extra={"no": "abc", "has": "kubectl logs -n ns tj-a1-n0"}),
    Case("exit 82 with a storage failure record -> Failed naming the reason, the store's code and the prefix",
         job(status=started(), spec=CKPT),
         observed(pod(rank=0, phase="Failed", exit_code=82, message=failure("StorageAccessDenied", "AccessDenied",
                                                                            "s3://b/p/ns/tj")), pod(rank=1)),
         phase="Failed", counters={"failures": 0}, deletes=["tj-a1-n1"], events=["Failed"],
         reason=("Failed", "StorageAccessDenied"),
         message="code 82 (invalid configuration): checkpoint storage refused access (StorageAccessDenied, "
                 "code AccessDenied, at s3://b/p/ns/tj); its log says why: kubectl logs -n ns tj-a1-n0",
         extra={"has": "code AccessDenied, at s3://b/p/ns/tj"}),
    Case("a failure record's location outside the job's prefix is left out, its reason and code kept",
         job(status=started(), spec=CKPT),
         observed(pod(rank=0, phase="Failed", exit_code=82, message=failure("StorageRequestInvalid", "InvalidBucketName",
                                                                            "s3://b/p/ns/other")), pod(rank=1)),
         phase="Failed", reason=("Failed", "StorageRequestInvalid"),
         message="refused a request as invalid (StorageRequestInvalid, code InvalidBucketName); its log",
         extra={"no": "ns/other"}),
    Case("a failure record without code or location still names the reason", job(status=started(), spec=CKPT),
         observed(pod(rank=0, phase="Failed", exit_code=82, message=failure("StorageAccessDenied")), pod(rank=1)),
         phase="Failed", reason=("Failed", "StorageAccessDenied"),
         message="checkpoint storage refused access (StorageAccessDenied); its log"),
    *[Case(f"a failure record out of shape is refused whole: {why}", job(status=started(), spec=CKPT),
           observed(pod(rank=0, phase="Failed", exit_code=82, message=text), pod(rank=1)),
           phase="Failed", reason=("Failed", "InvalidConfiguration"), message="code 82 (invalid configuration); its",
           extra={"no": leak})
      for why, text, leak in [
          ("a reason not in the set", failure("YourBucketIsOnFire", "AccessDenied"), "OnFire"),
          ("a code with spaces", failure("StorageAccessDenied", "Access denied: key=AKIAABCDEFGHIJKLMNOP"), "AKIA"),
          ("a code too long", failure("StorageAccessDenied", "A" * 64), "A" * 64),
          ("a credential in the location", failure("StorageAccessDenied", "AccessDenied",
                                                   "s3://user:pw@b/p/ns/tj"), "pw@"),
          ("a location with whitespace", failure("StorageAccessDenied", "AccessDenied", "s3://b/p/ns/tj x"), "tj x"),
          ("a location that is not s3://", failure("StorageAccessDenied", "AccessDenied", "https://evil/ns/tj"),
           "evil"),
          ("a key the contract does not have", json.dumps({"kind": "kubetrain.io/failure",
                                                           "reason": "StorageAccessDenied", "message": "leaked"}),
           "leaked"),
          ("a code that is not a string", json.dumps({"kind": "kubetrain.io/failure",
                                                      "reason": "StorageAccessDenied", "code": 403}), "403"),
          ("another kind", json.dumps({"kind": "kubetrain.io/oops", "reason": "StorageAccessDenied"}), "Storage"),
          ("text around the JSON", "boom\n" + failure("StorageAccessDenied", "AccessDenied"), "AccessDenied"),
      ]],
    Case("a failure record with another exit code is not read (the code decides)", job(status=started(), spec=CKPT),
         observed(pod(rank=0, phase="Failed", exit_code=1, message=failure("StorageAccessDenied", "AccessDenied")),
                  pod(rank=1)),
         phase="Restarting", counters={"failures": 1}, reason=("Restarting", "BackoffRestart"),
         extra={"no": "AccessDenied"}),
    Case("exit 82 after committing: the last-checkpoint record is kept, the reason stays InvalidConfiguration",
         job(status=started(), spec=CKPT),
         observed(pod(rank=0, phase="Failed", exit_code=82, message=record(30)), pod(rank=1)),
         phase="Failed", reason=("Failed", "InvalidConfiguration"), extra={"last_checkpoint.step": 30}),
    Case("ImagePullBackOff within startupGraceSeconds: a condition, an event, a wake-up at the deadline",
         job(status=started(phase="Pending"), run_policy={"startupGraceSeconds": 60}),
         observed(pod(rank=0, phase="Pending", waiting="ImagePullBackOff", scheduled=iso(0),
                      waiting_message='Back-off pulling image "reg/x:1"'), pod(rank=1, phase="Pending")),
         now=10, phase="Pending", events=["StartupDelayed"], requeue=50, deletes=[],
         reason=("StartupDelayed", "ImagePullBackOff"), message="tj-a1-n0: ImagePullBackOff",
         extra={"has": 'Back-off pulling image "reg/x:1"'}),
    Case("ImagePullBackOff already reported: no new event or write", job(status=started(phase="Pending", conditions=[
        {"type": "StartupDelayed", "status": "True", "reason": "ImagePullBackOff",
         "message": 'pod tj-a1-n0: ImagePullBackOff: Back-off pulling image "reg/x:1"; the kubelet retries, the job '
                    'fails if this persists until 2026-01-01T12:01:00Z (runPolicy.startupGraceSeconds)'}]),
        run_policy={"startupGraceSeconds": 60}),
         observed(pod(rank=0, phase="Pending", waiting="ImagePullBackOff", scheduled=iso(0),
                      waiting_message='Back-off pulling image "reg/x:1"'), pod(rank=1, phase="Pending")),
         now=30, phase=None, events=[], requeue=30),
    Case("ErrImagePull persisting past startupGraceSeconds -> Failed naming pod, reason and image",
         job(status=started(phase="Pending"), run_policy={"startupGraceSeconds": 60}),
         observed(pod(rank=0, phase="Pending", waiting="ErrImagePull", scheduled=iso(0),
                      waiting_message='pull "reg/typo:1": not found'), pod(rank=1, phase="Pending")),
         now=60, phase="Failed", reason=("Failed", "ErrImagePull"), deletes=["tj-a1-n0", "tj-a1-n1"],
         message='pod tj-a1-n0: ErrImagePull: pull "reg/typo:1": not found (still failing after '
                 'runPolicy.startupGraceSeconds=60s)'),
    Case("the startup window counts from scheduling, not from creation (a pod may wait for a node)",
         job(status=started(phase="Pending"), run_policy={"startupGraceSeconds": 60}),
         observed(pod(rank=0, phase="Pending", waiting="ErrImagePull", scheduled=iso(100)), pod(rank=1, phase="Pending")),
         now=130, phase="Pending", requeue=30, reason=("StartupDelayed", "ErrImagePull")),
    Case("InvalidImageName -> Failed at once", job(status=started(phase="Pending")),
         observed(pod(rank=0, phase="Pending", waiting="InvalidImageName"), pod(rank=1, phase="Pending")),
         phase="Failed", reason=("Failed", "InvalidImageName")),
    Case("CreateContainerConfigError (a Secret not there yet) within the window: wait",
         job(status=started(phase="Pending")),
         observed(pod(rank=0, phase="Pending", waiting="CreateContainerConfigError", scheduled=iso(0),
                      waiting_message='secret "s3-creds" not found'), pod(rank=1, phase="Pending")),
         now=100, phase="Pending", requeue=200, reason=("StartupDelayed", "CreateContainerConfigError")),
    Case("CreateContainerConfigError past the default 300s -> Failed naming the Secret",
         job(status=started(phase="Pending")),
         observed(pod(rank=0, phase="Pending", waiting="CreateContainerConfigError", scheduled=iso(0),
                      waiting_message='secret "s3-creds" not found'), pod(rank=1, phase="Pending")),
         now=300, phase="Failed", reason=("Failed", "CreateContainerConfigError"), message='secret "s3-creds" not found'),
    Case("the pods start after a delayed start: the condition is cleared",
         job(status=started(phase="Pending", conditions=[
             {"type": "StartupDelayed", "status": "True", "reason": "ErrImagePull", "message": "x"}])),
         observed(*gang()), phase="Running", reason=("StartupDelayed", "PodsStarted")),
    Case("a start error's message is redacted", job(status=started(phase="Pending")),
         observed(pod(rank=0, phase="Pending", waiting="ErrImagePull", scheduled=iso(0),
                      waiting_message="pull https://bob:hunter2@reg/x failed, token=abcd1234"),
                  pod(rank=1, phase="Pending")),
         now=1, phase="Pending", extra={"no": "hunter2", "no2": "abcd1234", "has": "https://***@reg/x"}),
    Case("ContainerCreating is not fatal", job(status=started(phase="Pending")),
         observed(pod(rank=0, phase="Pending", waiting="ContainerCreating"), pod(rank=1, phase="Pending")),
         phase=None),
    Case("a pod the scheduler cannot place -> condition Unschedulable with its message, one Warning",
         job(status=started(phase="Pending")),
         observed(pod(rank=0, phase="Pending", unschedulable=NO_GPU), pod(rank=1, phase="Pending")),
         phase="Pending", events=["Unschedulable"], reason=("Unschedulable", "Unschedulable"),
         message="waiting for the gang to be scheduled: pod tj-a1-n0 cannot be scheduled: 0/4 nodes are available"),
    Case("the scheduler placed it -> Unschedulable False, no event",
         job(status=started(phase="Pending", conditions=[UNSCHEDULABLE], message=WAITING)),
         observed(pod(rank=0, phase="Pending"), pod(rank=1, phase="Pending")),
         phase="Pending", events=[], reason=("Unschedulable", "PodsScheduled"), message="scheduled, waiting for them"),
    Case("a new attempt's pods not yet looked at by the scheduler: Unschedulable stays as it is",
         job(status=started(phase="Pending", conditions=[UNSCHEDULABLE], message=WAITING)),
         observed(pod(rank=0, phase="Pending", node=None), pod(rank=1, phase="Pending", node=None)),
         phase=None, events=[], reason=("Unschedulable", "Unschedulable")),
    Case("the deadline passes while unschedulable -> Failed, and Unschedulable False (the attempt ended)",
         job(status=started(phase="Pending", conditions=[UNSCHEDULABLE], message=WAITING),
             run_policy={"activeDeadlineSeconds": 60}),
         observed(pod(rank=0, phase="Pending", unschedulable=NO_GPU), pod(rank=1, phase="Pending")), now=61,
         phase="Failed", reason=("Unschedulable", "AttemptEnded")),
    Case("spec the operator cannot use -> Failed naming the field",
         job(spec={"nodes": "many"}), observed(), phase="Failed", reason=("Failed", "InvalidSpec"),
         message="spec.nodes"),
    # --- restarting ----------------------------------------------------------------
    Case("restarting: old pods still terminating -> wait, create nothing",
         job(status=started(phase="Restarting", nextAttemptTime=iso(0))),
         observed(pod(rank=0, deleting=iso(4)), pod(rank=1, deleting=iso(4))), phase=None, creates=None,
         requeue=29),
    Case("restarting: old pod not yet deleted gets deleted", job(status=started(phase="Restarting", nextAttemptTime=iso(0))),
         observed(pod(rank=0, phase="Failed", exit_code=1)), deletes=["tj-a1-n0"], creates=None),
    Case("restarting: old gang gone -> attempt 2 created", job(status=started(phase="Restarting", nextAttemptTime=iso(0), preemptions=1)),
         observed(), phase="Pending", counters={"attempt": 2, "restarts": 1, "preemptions": 1},
         creates=[0, 1], events=["Created"], reason=("Restarting", "AttemptStarted")),
    Case("restarting: in backoff -> requeue, no creation",
         job(status=started(phase="Restarting", nextAttemptTime=iso(20), failures=1)), observed(), now=5,
         phase=None, creates=None, requeue=15),
    Case("restarting: crash after creating part of attempt 2 -> complete it",
         job(status=started(phase="Restarting", nextAttemptTime=iso(0))), observed(pod(attempt=2, rank=1, phase="Pending")),
         phase="Pending", counters={"attempt": 2}, creates=[0]),
    Case("stuck terminating pod on deleted node is force-deleted",
         job(status=started(phase="Restarting", nextAttemptTime=iso(0))),
         observed(pod(rank=0, deleting=iso(1)), nodes={"kwok-0": NodeView("kwok-0", exists=False, since=at(1))}),
         deletes=["tj-a1-n0"], force=["tj-a1-n0"], creates=None),
    Case("stale pod of an old attempt next to a running gang is deleted", job(status=started(attempt=2, nodesReady=2)),
         observed(pod(attempt=1, rank=0, phase="Failed", exit_code=1), *gang(attempt=2)), deletes=["tj-a1-n0"], phase=None),
    # --- suspend / resume --------------------------------------------------------
    Case("suspend -> Suspended, pods deleted", job(status=started(), run_policy={"suspend": True}),
         observed(*gang()), phase="Suspended", deletes=["tj-a1-n0", "tj-a1-n1"], events=["Suspended"],
         reason=("Suspended", "Suspended")),
    Case("suspended from creation creates nothing", job(run_policy={"suspend": True}), observed(),
         phase="Suspended", counters={"attempt": 0}, creates=None, events=["Suspended"],
         message="suspended before its first attempt: no pod starts until spec.runPolicy.suspend is false",
         extra={"no": "attempt 0", "no pods": "deleting its pods"}),
    Case("resume with pods gone -> new attempt", job(status=started(phase="Suspended")), observed(),
         phase="Pending", counters={"attempt": 2, "restarts": 1}, creates=[0, 1], events=["Resumed", "Created"]),
    Case("resume while old pods terminate -> Restarting, wait", job(status=started(phase="Suspended")),
         observed(pod(rank=0, deleting=iso(4))), phase="Restarting", creates=None, events=["Resumed"]),
    # --- deadline, ttl, deletion ---------------------------------------------------
    Case("activeDeadlineSeconds exceeded -> Failed DeadlineExceeded",
         job(status=started(), run_policy={"activeDeadlineSeconds": 60}), observed(*gang()), now=61,
         phase="Failed", events=["Failed"], reason=("Failed", "DeadlineExceeded"),
         deletes=["tj-a1-n0", "tj-a1-n1"]),
    Case("a gang that succeeded in time, seen after the deadline (a late reconcile, a leader failover) -> Succeeded",
         job(status=started(), run_policy={"activeDeadlineSeconds": 60}),
         observed(*gang(phase="Succeeded", exit_code=0)), now=75,
         phase="Succeeded", events=["Succeeded"], reason=("Succeeded", "Succeeded")),
    Case("... also with a rank's pod deleted after it succeeded",
         job(status=started(), run_policy={"activeDeadlineSeconds": 60}),
         Observed(pods=(pod(rank=0, phase="Succeeded", exit_code=0),), gone={"tj-a1-n1": GONE_SUCCEEDED}), now=75,
         phase="Succeeded", events=["Succeeded"]),
    Case("the deadline passes while one rank still runs -> Failed DeadlineExceeded",
         job(status=started(), run_policy={"activeDeadlineSeconds": 60}),
         observed(pod(rank=0, phase="Succeeded", exit_code=0), pod(rank=1)), now=75,
         phase="Failed", events=["Failed"], reason=("Failed", "DeadlineExceeded")),
    Case("a rank that succeeded and was then deleted (PodGC, tidying up) is done, not a preemption",
         job(status=started(nodesReady=1)),
         Observed(pods=(pod(rank=0),), gone={"tj-a1-n1": GONE_SUCCEEDED}), now=20,
         phase=None, deletes=[], events=[]),
    Case("... and the gang succeeds when the other rank does",
         job(status=started(nodesReady=1)),
         Observed(pods=(pod(rank=0, phase="Succeeded", exit_code=0),), gone={"tj-a1-n1": GONE_SUCCEEDED}), now=20,
         phase="Succeeded", events=["Succeeded"]),
    Case("a rank deleted while it ran is still a preemption",
         job(status=started(nodesReady=2)), Observed(pods=(pod(rank=0),), gone={}), now=20,
         phase="Restarting", counters={"preemptions": 1}),
    Case("deadline not yet reached -> requeue at deadline",
         job(status=started(nodesReady=2), run_policy={"activeDeadlineSeconds": 60}), observed(*gang()), now=20,
         phase=None, requeue=40),
    Case("ttl not reached -> requeue", job(status={**started(phase="Succeeded"), "completionTime": iso(0)},
                                           run_policy={"ttlSecondsAfterFinished": 30}),
         observed(*gang(phase="Succeeded", exit_code=0)), now=10, phase=None, requeue=20),
    Case("ttl reached -> delete the job", job(status={**started(phase="Succeeded"), "completionTime": iso(0)},
                                             run_policy={"ttlSecondsAfterFinished": 30}),
         observed(), now=31, phase=None, extra="DeleteJob"),
    Case("the largest activeDeadlineSeconds (about 68 years) plans without overflowing the clock",
         job(status=started(nodesReady=2), run_policy={"activeDeadlineSeconds": 2**31 - 1}), observed(*gang()),
         now=20, phase=None, requeue=2**31 - 1 - 20),
    Case("the largest ttlSecondsAfterFinished: the job still Succeeds",
         job(status=started(nodesReady=2), run_policy={"ttlSecondsAfterFinished": 2**31 - 1}),
         observed(*gang(phase="Succeeded", exit_code=0)), phase="Succeeded"),
    Case("an activeDeadlineSeconds past the CRD's bound (stored before it) is read as the bound: still running",
         job(status=started(nodesReady=2), run_policy={"activeDeadlineSeconds": 10**12}), observed(*gang()),
         now=20, phase=None, requeue=2**31 - 1 - 20),
    Case("a ttlSecondsAfterFinished past the CRD's bound is read as the bound: the job still Succeeds",
         job(status=started(nodesReady=2), run_policy={"ttlSecondsAfterFinished": 10**12}),
         observed(*gang(phase="Succeeded", exit_code=0)), phase="Succeeded"),
    Case("job being deleted -> nothing (owner references do the rest)", job(deleting=True), observed(*gang()),
         phase=None, creates=None, deletes=None),
    Case("failed job still has a running pod -> it is deleted", job(status={**started(phase="Failed"), "completionTime": iso(0)}),
         observed(pod(rank=0, phase="Failed", exit_code=1), pod(rank=1)), deletes=["tj-a1-n1"], phase=None),
    # --- checkpoints -----------------------------------------------------------------
    Case("checkpoint annotation copied into status", job(status=started(nodesReady=2), spec={"checkpoint": {"uri": "s3://b/p", "credentialsSecret": {"name": "s3"}}}),
         observed(pod(rank=0, annotations={"kubetrain.io/last-checkpoint": record(1200, time="2026-01-01T00:00:00Z")}),
                  pod(rank=1)), phase="Running",
         extra={"last_checkpoint.step": 1200, "last_checkpoint.time": "2026-01-01T00:00:00Z"}),
    Case("termination message checkpoint (higher step) wins",
         job(status=started(nodesReady=2, lastCheckpoint={"step": 50, "uri": "s3://b/p/ns/tj/checkpoint-50"}), spec={"checkpoint": {"uri": "s3://b/p", "credentialsSecret": {"name": "s3"}}}),
         observed(pod(rank=0, phase="Succeeded", exit_code=0, message=record(90)), pod(rank=1)),
         phase="Running", extra={"last_checkpoint.step": 90}),
    Case("an ordinary JSON log line is not a checkpoint record", job(status=started(nodesReady=2), spec={"checkpoint": {"uri": "s3://b/p", "credentialsSecret": {"name": "s3"}}}),
         observed(pod(rank=0, phase="Failed", exit_code=1, message='{"step": 90, "uri": "s3://b/p/ns/tj/checkpoint-90"}'),
                  pod(rank=1)), phase="Restarting", extra={"last_checkpoint": None}),
    Case("a record pointing outside the job's own prefix is ignored", job(status=started(nodesReady=2), spec={"checkpoint": {"uri": "s3://b/p", "credentialsSecret": {"name": "s3"}}}),
         observed(pod(rank=0, annotations={"kubetrain.io/last-checkpoint": record(90, uri="s3://b/p/ns/other/checkpoint-90")}),
                  pod(rank=1)), phase=None, extra={"last_checkpoint": None}),
    Case("a record the status schema would refuse is ignored (no 422 loop)", job(status=started(nodesReady=2), spec={"checkpoint": {"uri": "s3://b/p", "credentialsSecret": {"name": "s3"}}}),
         observed(pod(rank=0, annotations={"kubetrain.io/last-checkpoint": record(2 ** 70)}), pod(rank=1)), phase=None, extra={"last_checkpoint": None}),
    Case("a record with an unparsable time keeps its step, without the time", job(status=started(nodesReady=2), spec={"checkpoint": {"uri": "s3://b/p", "credentialsSecret": {"name": "s3"}}}),
         observed(pod(rank=0, annotations={"kubetrain.io/last-checkpoint": record(7, time="yesterday")}), pod(rank=1)),
         phase="Running", extra={"last_checkpoint.step": 7, "last_checkpoint.time": None}),
    Case("without checkpoint storage, no record is read", job(status=started(nodesReady=2)),
         observed(pod(rank=0, annotations={"kubetrain.io/last-checkpoint": record(7)}), pod(rank=1)), phase=None, extra={"last_checkpoint": None}),
    Case("lagging uploads show as a condition", job(status=started(nodesReady=2)),
         observed(pod(rank=0, annotations={"kubetrain.io/checkpoint-sync": "3 checkpoints waiting: S3 unreachable"}),
                  pod(rank=1)), phase="Running", reason=("CheckpointsLagging", "UploadsLagging")),
    Case("caught-up uploads clear the condition", job(status=started(nodesReady=2, conditions=[
        {"type": "CheckpointsLagging", "status": "True", "reason": "UploadsLagging", "message": "x"}])),
         observed(*gang()), phase="Running", reason=("CheckpointsLagging", "UploadsCaughtUp")),
    Case("older checkpoint never replaces a newer one",
         job(status=started(nodesReady=2, lastCheckpoint={"step": 500, "uri": "s3://b/p/ns/tj/checkpoint-500"}), spec={"checkpoint": {"uri": "s3://b/p", "credentialsSecret": {"name": "s3"}}}),
         observed(pod(rank=0, annotations={"kubetrain.io/last-checkpoint": record(100)}), pod(rank=1)),
         phase=None),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plan_table(case: Case) -> None:
    result = plan(case.job, case.obs, at(case.now))
    status = result.status
    if case.phase is None:
        assert status is None or status.phase == case.job.status.phase, f"unexpected status write {status}"
    else:
        assert status is not None, "expected a status write"
        assert status.phase == case.phase
        assert status.observed_generation == case.job.generation
    for key, value in case.counters.items():
        assert getattr(status or case.job.status, key) == value, key
    creates = [a.rank for a in result.actions if isinstance(a, CreatePod)]
    if case.creates is None:
        assert creates == []
    else:
        assert sorted(creates) == case.creates
    deletes = [a.name for a in result.actions if isinstance(a, DeletePod)]
    if case.deletes is not None:
        assert sorted(deletes) == sorted(case.deletes)
    assert sorted(a.name for a in result.actions if isinstance(a, DeletePod) and a.force) == sorted(case.force)
    if case.events is not None:
        assert [e.reason for e in result.events] == case.events
    if case.requeue is not None:
        assert result.requeue_after == pytest.approx(case.requeue)
    if case.message is not None:
        assert case.message in (status or case.job.status).message
    if case.reason is not None:
        cond = (status or case.job.status).condition(case.reason[0])
        assert cond is not None and cond.reason == case.reason[1], (status or case.job.status).conditions
    if case.extra == "DeleteJob":
        assert any(isinstance(a, DeleteJob) for a in result.actions)
    elif isinstance(case.extra, dict):
        final = status or case.job.status
        texts = [final.message, *(c.message for c in final.conditions), *(e.message for e in result.events)]
        for key, value in case.extra.items():
            if key.startswith("no"):
                assert not any(value in t for t in texts), (value, texts)
                continue
            if key == "has":
                assert any(value in t for t in texts), (value, texts)
                continue
            obj: Any = final
            for part in key.split("."):
                obj = getattr(obj, part)
            assert obj == value, key


def test_pods_are_created_before_the_status_records_the_attempt() -> None:
    result = plan(job(nodes=2), observed(), at(0))
    kinds = [type(a) for a in result.actions]
    assert kinds == [CreateService, CreatePod, CreatePod, PatchStatus]


def test_spec_edits_apply_from_the_next_attempt_as_the_crd_says() -> None:
    """`kubectl explain tj.spec` tells a user who edits a running job (its image, say) why nothing happens yet."""
    crd = yaml.safe_load((Path(__file__).resolve().parents[3] / "crds" / "trainingjob.yaml").read_text())
    text = " ".join(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["description"].split())
    assert "take effect at its next attempt" in text and "running pods are never changed" in text
    edited = job(status=started(nodesReady=2), generation=2, spec={"image": "img:2"})
    result = plan(edited, observed(*gang()), at(10))
    assert [type(a) for a in result.actions] == [PatchStatus] and result.status.observed_generation == 2


def test_restart_status_is_written_before_pods_are_deleted() -> None:
    result = plan(job(status=started()), observed(pod(rank=0, phase="Failed", exit_code=1), pod(rank=1)), at(1))
    kinds = [type(a) for a in result.actions]
    assert kinds == [PatchStatus, DeletePod, DeletePod]


def test_inline_deepspeed_config_gets_a_configmap() -> None:
    tj = job(spec={"strategy": {"type": "zero3", "deepspeed": {"config": {"zero_optimization": {"stage": 3}}}}})
    assert any(isinstance(a, EnsureDeepSpeedConfigMap) for a in plan(tj, observed(), at(0)).actions)


def test_plan_is_idempotent_once_its_status_is_stored() -> None:
    """Applying a plan's status and planning again with the same pods changes nothing."""
    tj = job(status=started(phase="Pending"))
    obs = observed(*gang())
    first = plan(tj, obs, at(1))
    assert first.status is not None
    again = Job(**{**tj.__dict__, "status": first.status})
    second = plan(again, obs, at(2))
    assert second.status is None and second.actions == () and second.events == ()


def test_whole_failure_sequence_until_failed() -> None:
    """Three failures back off 1, 2, 4 s; the fourth fails the job (backoffLimit 3)."""
    tj = job(run_policy={"backoffSeconds": 1, "backoffLimit": 3})
    now = 0.0
    delays = []
    for attempt in range(1, 5):
        start = plan(tj, observed(), at(now))
        tj = Job(**{**tj.__dict__, "status": start.status})
        assert tj.status.attempt == attempt and tj.status.phase == "Pending"
        crashed = observed(pod(attempt=attempt, rank=0, phase="Failed", exit_code=3), pod(attempt=attempt, rank=1))
        result = plan(tj, crashed, at(now))
        tj = Job(**{**tj.__dict__, "status": result.status})
        if attempt < 4:
            assert tj.status.phase == "Restarting"
            delays.append(result.requeue_after)
            now += result.requeue_after
        else:
            assert tj.status.phase == "Failed"
            assert "exited with code 3" in tj.status.message
    assert delays == [1, 2, 4]
    assert tj.status.restarts == 3 and tj.status.failures == 4 and tj.status.preemptions == 0


QUOTA = 'create pod tj-a1-n1: pods "tj-a1-n1" is forbidden: exceeded quota: q, requested: pods=1, used: pods=1, limited: pods=1'


def test_a_refused_pod_create_shows_on_the_job_and_waits() -> None:
    from kubetrain.plan import rejected_plan
    result = rejected_plan(job(), at(0), reason="QuotaExceeded", message=QUOTA)
    st = result.status
    assert st is not None and st.phase == "Pending" and st.attempt == 0, "the attempt is not recorded yet"
    cond = st.condition("Created")
    assert cond is not None and (cond.status, cond.reason) == ("False", "QuotaExceeded") and "exceeded quota" in cond.message
    assert "waiting for quota" in st.message
    assert [(e.type, e.reason) for e in result.events] == [("Warning", "QuotaExceeded")]
    assert "exceeded quota: q" in result.events[0].message
    assert not any(isinstance(a, (CreatePod, DeletePod)) for a in result.actions)
    # The same refusal again: no new event, no write.
    again = rejected_plan(Job(**{**job().__dict__, "status": st}), at(5), reason="QuotaExceeded", message=QUOTA)
    assert again.actions == () and again.events == ()
    # ... or with other counts (another job's pods came and went): still the same refusal, no event, no write.
    counts = QUOTA.replace("used: pods=1", "used: pods=3")
    assert counts != QUOTA
    other = rejected_plan(Job(**{**job().__dict__, "status": st}), at(9), reason="QuotaExceeded", message=counts)
    assert other.actions == () and other.events == ()
    # Once the quota admits them, the next plan completes the gang and clears the condition.
    started_plan = plan(Job(**{**job().__dict__, "status": st}), observed(pod(rank=0, phase="Pending")), at(10))
    assert [a.rank for a in started_plan.actions if isinstance(a, CreatePod)] == [1]
    cond = started_plan.status.condition("Created")
    assert started_plan.status.attempt == 1 and (cond.status, cond.reason) == ("True", "PodsCreated")


def test_a_refused_restart_stays_restarting() -> None:
    from kubetrain.plan import rejected_plan
    restarting = job(status=started(phase="Restarting", nextAttemptTime=iso(0), preemptions=1))
    st = rejected_plan(restarting, at(0), reason="QuotaExceeded", message=QUOTA).status
    assert st is not None and st.phase == "Restarting" and st.attempt == 1 and st.preemptions == 1
    assert "attempt 2: waiting for quota" in st.message


def test_a_refusal_that_cannot_pass_fails_the_job_with_the_message_redacted() -> None:
    from kubetrain.plan import fail_plan
    msg = ('create pod tj-a1-n0: pods "tj-a1-n0" is forbidden: admission webhook "policy" denied the request: '
           'env AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG is not allowed')
    result = fail_plan(job(), observed(), at(0), reason="PodRejected", message=msg)
    assert result.status.phase == "Failed" and result.status.condition("Failed").reason == "PodRejected"
    assert "denied the request" in result.status.message and "wJalrXUtnFEMI" not in result.status.message
    assert [e.reason for e in result.events] == ["Failed"] and "wJalrXUtnFEMI" not in result.events[0].message


def test_a_pod_with_unparsable_fields_is_still_seen() -> None:
    """Pods are written by others: odd values make a field unknown, never the pod invisible."""
    from kubetrain.observe import PodView
    from kubetrain_factories import pod_body
    body = pod_body(rank=1, phase="Failed", exit_code=1)
    body["metadata"]["creationTimestamp"] = "not a time"
    body["status"]["conditions"][0]["lastTransitionTime"] = 12
    body["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] = "1"
    body["metadata"]["annotations"] = {"kubetrain.io/last-checkpoint": "{" * 5000}
    view = PodView.from_storage(body)
    assert view is not None and (view.rank, view.phase, view.exit_code, view.checkpoint) == (1, "Failed", None, None)


def test_a_refused_create_after_resume_stays_restarting_and_is_never_a_preemption() -> None:
    from kubetrain.plan import rejected_plan
    suspended = job(status=started(attempt=2, phase="Suspended"))
    st = rejected_plan(suspended, at(0), reason="QuotaExceeded", message=QUOTA).status
    assert st is not None and st.phase == "Restarting" and st.attempt == 2
    again = plan(Job(**{**suspended.__dict__, "status": st}), observed(), at(10))
    assert again.status.preemptions == 0 and [a.rank for a in again.actions if isinstance(a, CreatePod)] == [0, 1]
    assert again.status.attempt == 3


def test_a_resume_whose_pods_are_refused_is_still_a_resume_and_its_deadline_starts_with_the_resume() -> None:
    # Suspended after 10 minutes of a 1-hour deadline, resumed 2 hours later into a full quota: the resume
    # (its status went out with the refused creates' plan) is kept, and the deadline counts from the resume.
    from kubetrain.plan import rejected_plan
    stopped = {**started(attempt=1, phase="Suspended"),
               "conditions": [{"type": "Suspended", "status": "True", "reason": "Suspended", "message": "",
                               "lastTransitionTime": iso(600)}]}
    suspended = job(status=stopped, run_policy={"activeDeadlineSeconds": 3600})
    refused = rejected_plan(suspended, at(7800), reason="QuotaExceeded", message=QUOTA)
    st = refused.status
    assert st is not None and st.phase == "Restarting" and st.start_time == iso(7800)
    assert st.condition("Suspended").status == "False" and st.condition("Restarting").status == "True"
    assert [e.reason for e in refused.events] == ["Resumed", "QuotaExceeded"]
    later = plan(Job(**{**suspended.__dict__, "status": st}), observed(), at(7830))
    assert later.status.phase == "Pending" and later.status.start_time == iso(7800)
    assert [a.rank for a in later.actions if isinstance(a, CreatePod)] == [0, 1]


def test_suspending_a_job_waiting_to_restart_says_it_no_longer_restarts() -> None:
    waiting = {**started(phase="Restarting"), "nextAttemptTime": iso(30),
               "conditions": [{"type": "Restarting", "status": "True", "reason": "BackoffRestart", "message": "",
                               "lastTransitionTime": iso(0)}]}
    st = plan(job(status=waiting, run_policy={"suspend": True}), observed(), at(5)).status
    assert st.phase == "Suspended"
    assert st.condition("Restarting").status == "False" and st.condition("Restarting").reason == "Suspended"


def test_checkpoints_lagging_turns_false_when_the_attempt_ends() -> None:
    lagging = {**started(), "conditions": [{"type": "CheckpointsLagging", "status": "True", "reason": "UploadsLagging",
                                             "message": "", "lastTransitionTime": iso(0)}]}
    result = plan(job(status=lagging, run_policy={"backoffLimit": 0}),
                  observed(pod(rank=0, phase="Failed", exit_code=1), pod(rank=1)), at(5))
    assert result.status.phase == "Failed"
    assert result.status.condition("CheckpointsLagging").status == "False"


def test_the_kubelet_flipping_between_pull_error_and_backoff_posts_no_new_warning() -> None:
    first = plan(job(status=started(phase="Pending")),
                 observed(pod(rank=0, phase="Pending", waiting="ErrImagePull", scheduled=iso(0)),
                          pod(rank=1, phase="Pending")), at(5))
    assert [e.reason for e in first.events] == ["StartupDelayed"]
    tj = Job(**{**job().__dict__, "status": first.status})
    flipped = plan(tj, observed(pod(rank=0, phase="Pending", waiting="ImagePullBackOff", scheduled=iso(0)),
                                pod(rank=1, phase="Pending")), at(20))
    assert flipped.events == ()


@pytest.mark.parametrize("said", [NO_GPU, NO_GPU.replace("0/4", "0/6").replace("4 Insufficient", "6 Insufficient")],
                         ids=["the same", "only the counts changed (an autoscaler added nodes)"])
def test_a_gang_still_unschedulable_for_the_same_reason_writes_nothing_again(said: str) -> None:
    """The scheduler retries the pod; as long as its reasons stay, the job's status and events stay as they are."""
    still = job(status=started(phase="Pending", conditions=[UNSCHEDULABLE], message=WAITING))
    result = plan(still, observed(pod(rank=0, phase="Pending", unschedulable=said), pod(rank=1, phase="Pending")),
                  at(30))
    assert result.status is None and result.events == ()


def test_a_new_reason_is_written() -> None:
    still = job(status=started(phase="Pending", conditions=[UNSCHEDULABLE], message=WAITING))
    other = "0/4 nodes are available: 4 node(s) didn't match Pod's node affinity/selector."
    result = plan(still, observed(pod(rank=0, phase="Pending", unschedulable=other), pod(rank=1, phase="Pending")),
                  at(30))
    assert result.status is not None and "didn't match Pod's node affinity" in result.status.message
    assert result.events == ()  # still the same episode: one Warning when it began


def test_waiting_for_an_earlier_job_of_the_same_name_shows_on_the_job() -> None:
    """Deleted and applied again at once: the earlier job's pods are still terminating under the same names. The
    new job says why it waits (it had no status at all before) and starts once they are gone."""
    from kubetrain.plan import rejected_plan
    why = "pod ns/tj-a1-n0 still belongs to an earlier TrainingJob tj (deleted and created again); waiting for it"
    result = rejected_plan(job(), at(0), reason="NameInUse", message=why)
    st = result.status
    assert st is not None and st.phase == "Pending" and st.attempt == 0
    assert "waiting for an earlier job of this name to be cleaned up: pod ns/tj-a1-n0" in st.message
    cond = st.condition("Created")
    assert cond is not None and (cond.status, cond.reason) == ("False", "NameInUse")
    assert [(e.type, e.reason) for e in result.events] == [("Warning", "NameInUse")]
    assert "refused" not in result.events[0].message


def test_a_lagging_annotation_reaches_the_condition_cut_and_redacted() -> None:
    """The checkpoint-sync annotation is the pod's to write (anyone who can annotate it): like every other
    text a pod reports, it is redacted and cut before it goes into the job's status."""
    text = "uploads stuck: https://s3.example/b?X-Amz-Signature=SECRET123&token=SECRET123 " + "x" * 100_000
    st = plan(job(status=started(nodesReady=2)),
              observed(pod(rank=0, annotations={"kubetrain.io/checkpoint-sync": text}), pod(rank=1)), at(5)).status
    cond = st.condition("CheckpointsLagging")
    assert cond.status == "True" and cond.message.startswith("uploads stuck")
    assert "SECRET123" not in cond.message and len(cond.message) <= 1024, cond.message[:200]


def test_a_gang_whose_pods_stay_refused_fails_on_its_deadline() -> None:
    """6 of 8 pods created, the quota full (the 6 hold theirs): the job waited forever, past
    activeDeadlineSeconds, since the clock started only once every pod existed."""
    from kubetrain.plan import rejected_plan
    j = job(nodes=8, run_policy={"activeDeadlineSeconds": 600})
    st = rejected_plan(j, at(0), reason="QuotaExceeded", message=QUOTA).status
    assert st.start_time == iso(0) and st.phase == "Pending"
    six = observed(*(pod(rank=r, phase="Running") for r in range(6)))
    waiting = plan(Job(**{**j.__dict__, "status": st}), six, at(300))
    assert waiting.status is None or waiting.status.phase != "Failed"
    again = rejected_plan(Job(**{**j.__dict__, "status": st}), at(300), reason="QuotaExceeded", message=QUOTA).status
    assert again is None, "the same refusal again writes nothing: the clock keeps its start"
    again = st
    late = plan(Job(**{**j.__dict__, "status": again}), six, at(601))
    assert late.status.phase == "Failed" and late.status.condition("Failed").reason == "DeadlineExceeded"
    assert {a.name for a in late.actions if isinstance(a, DeletePod)} == {p.name for p in six.pods}


def test_a_launch_cut_short_and_then_edited_does_not_finish_with_pods_of_two_specs() -> None:
    """Attempt 1's pods 0..2 were made at generation 1 for 4 nodes (then the quota refused the 4th, or the
    operator restarted before its status write); the job is edited to 2 nodes (generation 2). The pods of
    generation 1 (NNODES=4) are deleted and the attempt is made again from the new spec, instead of n0 and
    n1 waiting for 4 peers until their rendezvous times out and spends backoffLimit."""
    gen1 = {"kubetrain.io/spec-generation": "1"}
    edited = job(nodes=2, generation=2)
    old = observed(*(pod(rank=r, phase="Pending", annotations=gen1) for r in range(3)))
    first = plan(edited, old, at(0))
    assert {a.name for a in first.actions if isinstance(a, DeletePod)} == {"tj-a1-n0", "tj-a1-n1", "tj-a1-n2"}
    assert not any(isinstance(a, CreatePod) for a in first.actions)
    assert "spec changed" in first.status.message and first.status.attempt == 0
    going = plan(edited, observed(*(pod(rank=r, phase="Pending", annotations=gen1, deleting=True)
                                    for r in range(3))), at(2))
    assert going.status is None or (going.status.phase != "Restarting" and "previous attempt" not in going.status.message)
    fresh = plan(edited, observed(), at(5))
    assert [a.rank for a in fresh.actions if isinstance(a, CreatePod)] == [0, 1] and fresh.status.nodes_total == 2
    # Pods of the current generation (or unstamped ones, made before the stamp existed) are completed as before.
    for stamp in ({"kubetrain.io/spec-generation": "2"}, None):
        same = plan(edited, observed(pod(rank=0, phase="Pending", annotations=stamp)), at(5))
        assert [a.rank for a in same.actions if isinstance(a, CreatePod)] == [1]
        assert not any(isinstance(a, DeletePod) for a in same.actions)
    # A started attempt is never recreated for an edit: the edit takes effect at the next attempt.
    running = plan(job(nodes=2, generation=2, status=started(nodesReady=2)), observed(*gang(annotations=gen1)), at(5))
    assert not any(isinstance(a, (CreatePod, DeletePod)) for a in running.actions)


def test_a_rank_that_timed_out_waiting_for_an_unschedulable_peer_names_the_peer() -> None:
    """Rank 2 never got a node (insufficient nvidia.com/gpu); rank 0 timed out in its rendezvous and exited 1.
    The restart's message named only the exit code; it now says a peer could not be scheduled, and why."""
    why = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    result = plan(job(nodes=3, status=started(nodesTotal=3)),
                  observed(pod(rank=0, phase="Failed", exit_code=1), pod(rank=1),
                           pod(rank=2, phase="Pending", unschedulable=why)), at(1900))
    assert result.status.phase == "Restarting" and result.status.failures == 1
    assert "exited with code 1, while 1 pod(s) of the gang could not be scheduled (tj-a1-n2" in result.status.message
    assert "Insufficient nvidia.com/gpu" in result.status.message
