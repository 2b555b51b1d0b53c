"""Kueue's protocol for an external job integration, as pure functions (issue 14).

A TrainingJob labelled `kueue.x-k8s.io/queue-name` is represented to Kueue by
one Workload (API `kueue.x-k8s.io/v1beta2`) that the operator owns:

- `build_workload` is the Workload's body (name, labels, finalizer, owner,
  queue, priority, `active`, one podSet `workers` whose template is the pod the
  operator creates, from `builders.get_pod`);
- `WorkloadView.from_storage` is what Kueue said (quota reserved, admitted,
  evicted, requeued, finished, why it waits, the admission's flavors and the
  admission checks' pod set updates);
- `kueue_admission.pod_set_info` + `merge_into_pod` put the admission into the
  pods the way Kueue's own integrations do (`pkg/podset`);
- `pods_ready_condition` is the `PodsReady` condition the operator writes
  (Kueue's `generatePodsReadyCondition`).

Field names, condition types and reasons are those of Kueue v0.19.2
(`apis/kueue/v1beta2/workload_types.go`). Nothing here talks to the API
server: the caller reads the ResourceFlavors and the PriorityClass value and
sends what these return.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from kubetrain.api import (ANNOTATION_SPEC_FINGERPRINT, ANNOTATION_SPEC_GENERATION, GROUP as JOB_GROUP, KIND as JOB_KIND,
                          LABEL_ATTEMPT, LABEL_RANK, VERSION as JOB_VERSION, Job)
from kubetrain.builders import get_owner_reference, get_pod

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "Workload"
PLURAL = "workloads"

FRAMEWORK = f"{JOB_KIND}.{JOB_VERSION}.{JOB_GROUP}"
"""How Kueue's configuration names this integration: `integrations.externalFrameworks: [FRAMEWORK]`."""

LABEL_QUEUE_NAME = "kueue.x-k8s.io/queue-name"
LABEL_PRIORITY_CLASS = "kueue.x-k8s.io/priority-class"
"""On a job: the WorkloadPriorityClass that sets its Workload's priority (wins over the pods' PriorityClass)."""
LABEL_JOB_UID = "kueue.x-k8s.io/job-uid"
FINALIZER = "kueue.x-k8s.io/resource-in-use"
PODSET_NAME = "workers"
MAX_NAME_LENGTH = 63
"""Kueue's ShortWorkloadNames length: a Workload's name is also a label value elsewhere."""
_HASH_LENGTH = 5

POD_PRIORITY_GROUP, POD_PRIORITY_KIND = "scheduling.k8s.io", "PriorityClass"
WORKLOAD_PRIORITY_GROUP, WORKLOAD_PRIORITY_KIND = GROUP, "WorkloadPriorityClass"

# Condition types of a Workload.
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
PREEMPTED = "Preempted"
REQUEUED = "Requeued"
FINISHED = "Finished"
PODS_READY = "PodsReady"
DEACTIVATION_TARGET = "DeactivationTarget"

ANNOTATION_SUSPENDED = "kubetrain.io/suspended"
"""Set on a Workload in the same patch that makes it inactive for the job's suspend (or to queue a gang that
changed since its admission again), removed in the one that activates it again: an inactive Workload without
it was deactivated by Kueue itself."""

# Reasons of PodsReady (written by the job's controller: the operator).
WAIT_FOR_START = "WaitForStart"
WAIT_FOR_RECOVERY = "WaitForRecovery"
STARTED = "Started"
RECOVERED = "Recovered"
_NOT_READY_MESSAGE = "Not all pods are ready or succeeded"
_WAITING_FOR_RECOVERY_MESSAGE = "At least one pod has failed, waiting for recovery"
_READY_MESSAGE = "All pods reached readiness and the workload is running"

# Reasons of Evicted (Kueue's).
EVICTED_BY_PREEMPTION = "Preempted"
EVICTED_BY_PODS_READY_TIMEOUT = "PodsReadyTimeout"
EVICTED_BY_DEACTIVATION = "Deactivated"
EVICTED_BY_ADMISSION_CHECK = "AdmissionCheck"
EVICTED_BY_CLUSTER_QUEUE_STOPPED = "ClusterQueueStopped"
EVICTED_BY_LOCAL_QUEUE_STOPPED = "LocalQueueStopped"
EVICTED_DUE_TO_NODE_FAILURES = "NodeFailures"

# Reasons of Finished (written by the operator).
FINISHED_SUCCEEDED = "Succeeded"
FINISHED_FAILED = "Failed"

PENDING = "Pending"
"""The reason of a QuotaReserved=False that Kueue gives without its UnadmittedWorkloadsObservability gate
(the granular reasons, e.g. ExceedsMaxQuota and WaitingForQuota, come with it)."""

# A LocalQueue name (Kueue's LocalQueueName: a DNS subdomain of at most 253 characters); as a label
# value it is at most 63 characters anyway.
_LOCAL_QUEUE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class KueueError(ValueError):
    """The job cannot be represented to Kueue, or Kueue's admission cannot be applied; names the field."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path
        self.message = message


# ------------------------------------------------------------------ the job's side

def queue_name(labels: Mapping[str, str] | None) -> str | None:
    """The LocalQueue a job asks for (its `kueue.x-k8s.io/queue-name` label); None when it is not queued.

    Raises KueueError naming the label when the value cannot be a LocalQueue's name."""
    value = (labels or {}).get(LABEL_QUEUE_NAME)
    if value is None:
        return None
    if not value or len(value) > MAX_NAME_LENGTH or not _LOCAL_QUEUE_NAME.match(value):
        raise KueueError(f"metadata.labels[{LABEL_QUEUE_NAME}]",
                         f"{value!r} is not a LocalQueue name (lower-case letters, digits, '-' and '.', "
                         f"starting and ending with a letter or digit, at most {MAX_NAME_LENGTH} characters)")
    return value


def workload_name(job_name: str, job_uid: str) -> str:
    """`trainingjob-<name>-<hash>`, at most 63 characters: Kueue's own scheme for a job's Workload
    (jobframework.GetWorkloadNameForOwnerWithGVK with ShortWorkloadNames), so the name is stable for
    one job and differs between two jobs of the same name (the uid is hashed in)."""
    digest = hashlib.sha1("\n".join((JOB_KIND, JOB_GROUP, job_name, job_uid)).encode()).hexdigest()
    prefix = f"{JOB_KIND.lower()}-{job_name}"[: MAX_NAME_LENGTH - 1 - _HASH_LENGTH]
    return f"{prefix}-{digest[:_HASH_LENGTH]}"


@dataclass(frozen=True)
class PriorityRef:
    """What sets a Workload's priority: a pod PriorityClass or a Kueue WorkloadPriorityClass."""

    kind: str
    """POD_PRIORITY_KIND or WORKLOAD_PRIORITY_KIND."""
    name: str

    @property
    def group(self) -> str:
        return WORKLOAD_PRIORITY_GROUP if self.kind == WORKLOAD_PRIORITY_KIND else POD_PRIORITY_GROUP

    def as_ref(self) -> dict[str, str]:
        return {"group": self.group, "kind": self.kind, "name": self.name}


def priority_ref(job: Job, labels: Mapping[str, str] | None) -> PriorityRef | None:
    """The label `kueue.x-k8s.io/priority-class` (a WorkloadPriorityClass) if set, else the pods'
    PriorityClass (`spec.podTemplate.priorityClassName`), else None (priority 0 or the default)."""
    label = (labels or {}).get(LABEL_PRIORITY_CLASS)
    if label:
        return PriorityRef(kind=WORKLOAD_PRIORITY_KIND, name=label)
    name = _spec(job).pod_template.get("priorityClassName")
    return PriorityRef(kind=POD_PRIORITY_KIND, name=str(name)) if name else None


def podset_template(job: Job) -> dict[str, Any]:
    """The pod template of the podSet `workers`: the pod the operator creates (rank 0 of a canonical
    attempt 0), with the metadata a Workload allows (labels and annotations) and without what differs
    between attempts (the attempt and rank labels), so the template is a function of the job's spec."""
    pod = get_pod(job=job, attempt=0, rank=0)
    meta = pod["metadata"]
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k not in (LABEL_ATTEMPT, LABEL_RANK)}
    template_meta: dict[str, Any] = {"labels": labels}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items()
                   if k not in (ANNOTATION_SPEC_GENERATION, ANNOTATION_SPEC_FINGERPRINT)}
    if annotations:
        template_meta["annotations"] = annotations
    return {"metadata": template_meta, "spec": pod["spec"]}


def build_workload(job: Job, *, labels: Mapping[str, str] | None, priority: int | None = None) -> dict[str, Any]:
    """The Workload that represents `job` to Kueue.

    `labels` are the job's metadata labels (the queue and the WorkloadPriorityClass label);
    `priority` is the value of the PriorityClass or WorkloadPriorityClass that `priority_ref` names,
    read by the caller (required when there is one). `spec.active` is the opposite of
    `runPolicy.suspend`. Raises KueueError naming the field when the job cannot be queued."""
    spec = _spec(job)
    queue = queue_name(labels)
    if queue is None:
        raise KueueError(f"metadata.labels[{LABEL_QUEUE_NAME}]", "is not set: the job is not queued by Kueue")
    ref = priority_ref(job, labels)
    if ref is not None and priority is None:
        raise KueueError("priority", f"the value of {ref.kind} {ref.name!r} is needed for the Workload")
    body_spec: dict[str, Any] = {
        "queueName": queue,
        "active": not spec.run_policy.suspend,
        "podSets": [{"name": PODSET_NAME, "count": spec.nodes, "template": podset_template(job)}],
    }
    if ref is not None:
        body_spec["priorityClassRef"] = ref.as_ref()
        body_spec["priority"] = priority
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": workload_name(job.name, job.uid),
            "namespace": job.namespace,
            "labels": {LABEL_JOB_UID: job.uid},
            "finalizers": [FINALIZER],
            "ownerReferences": [get_owner_reference(job)],
            **({"annotations": {ANNOTATION_SUSPENDED: "true"}} if spec.run_policy.suspend else {}),
        },
        "spec": body_spec,
    }


# ------------------------------------------------------------------ Kueue's side

@dataclass(frozen=True)
class Condition:
    status: str
    """"True", "False" or "Unknown"."""
    reason: str = ""
    message: str = ""

    @property
    def true(self) -> bool:
        return self.status == "True"

    @classmethod
    def from_storage(cls, raw: Mapping[str, Any]) -> "Condition":
        return cls(status=str(raw.get("status") or "Unknown"), reason=str(raw.get("reason") or ""),
                   message=str(raw.get("message") or ""))


@dataclass(frozen=True)
class Assignment:
    """One entry of `status.admission.podSetAssignments`."""

    name: str
    flavors: Mapping[str, str]
    """Resource name -> ResourceFlavor name."""
    count: int | None = None
    topology: bool = False
    """A topology assignment (or a delayed topology request) is present: unsupported."""


@dataclass(frozen=True)
class PodSetUpdate:
    """One admission check's `podSetUpdates` entry: what it asks to add to the pods."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class WorkloadView:
    """What Kueue says about a Workload, in the terms the operator decides by."""

    name: str
    uid: str = ""
    active: bool = True
    """spec.active (Kueue sets it to False itself when it deactivates a Workload)."""
    conditions: Mapping[str, Condition] = field(default_factory=dict)
    cluster_queue: str = ""
    assignments: tuple[Assignment, ...] = ()
    pod_set_updates: tuple[PodSetUpdate, ...] = ()
    requeue_count: int = 0
    deleting: bool = False
    suspended_by_job: bool = False
    """The operator made it inactive, for the job's suspend or a re-queue (`ANNOTATION_SUSPENDED`)."""

    @classmethod
    def from_storage(cls, body: Mapping[str, Any]) -> "WorkloadView":
        meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
        conds = {str(c.get("type")): Condition.from_storage(c) for c in status.get("conditions") or ()
                 if isinstance(c, Mapping) and c.get("type")}
        admission = status.get("admission") or {}
        assignments = tuple(
            Assignment(name=str(a.get("name") or ""), flavors={str(k): str(v) for k, v in (a.get("flavors") or {}).items()},
                       count=a.get("count"), topology=bool(a.get("topologyAssignment") or a.get("delayedTopologyRequest")))
            for a in admission.get("podSetAssignments") or ())
        updates = tuple(
            PodSetUpdate(name=str(u.get("name") or ""), labels=dict(u.get("labels") or {}),
                         annotations=dict(u.get("annotations") or {}), node_selector=dict(u.get("nodeSelector") or {}),
                         tolerations=tuple(dict(t) for t in u.get("tolerations") or ()))
            for check in status.get("admissionChecks") or () for u in check.get("podSetUpdates") or ())
        return cls(
            name=str(meta.get("name") or ""), uid=str(meta.get("uid") or ""),
            active=spec.get("active") is not False, conditions=conds,
            cluster_queue=str(admission.get("clusterQueue") or ""), assignments=assignments,
            pod_set_updates=updates, requeue_count=int((status.get("requeueState") or {}).get("count") or 0),
            deleting=bool(meta.get("deletionTimestamp")),
            suspended_by_job=(meta.get("annotations") or {}).get(ANNOTATION_SUSPENDED) == "true",
        )

    def condition(self, kind: str) -> Condition | None:
        return self.conditions.get(kind)

    def _is(self, kind: str) -> bool:
        cond = self.conditions.get(kind)
        return cond is not None and cond.true

    @property
    def quota_reserved(self) -> bool:
        return self._is(QUOTA_RESERVED)

    @property
    def admitted(self) -> bool:
        """Admitted=True: the only state in which the gang's pods may exist."""
        return self._is(ADMITTED)

    @property
    def evicted(self) -> Condition | None:
        """Evicted=True (reason Preempted, PodsReadyTimeout, Deactivated, ...), else None."""
        return self.conditions.get(EVICTED) if self._is(EVICTED) else None

    @property
    def requeued(self) -> Condition | None:
        return self.conditions.get(REQUEUED)

    @property
    def finished(self) -> Condition | None:
        return self.conditions.get(FINISHED) if self._is(FINISHED) else None

    @property
    def pods_ready(self) -> Condition | None:
        return self.conditions.get(PODS_READY)

    @property
    def pending(self) -> Condition | None:
        """Why Kueue has not reserved quota (QuotaReserved=False: e.g. ExceedsMaxQuota, WaitingForQuota, or
        Pending with a message), while the job is queued; None once reserved or before Kueue said anything."""
        cond = self.conditions.get(QUOTA_RESERVED)
        return cond if cond is not None and cond.status == "False" else None

    @property
    def topology_assigned(self) -> bool:
        """Kueue assigned a topology (TAS): unsupported, the job must not start."""
        return any(a.topology for a in self.assignments)

    def deactivated_by_kueue(self, *, suspended: bool) -> Condition | None:
        """Kueue deactivated the Workload itself (requeuing limit, maximum execution time): spec.active is
        false although the job is not suspended. The condition (DeactivationTarget while Kueue has not yet
        evicted, then Evicted/Deactivated) carries Kueue's message; None otherwise, and None for a Workload
        the operator deactivated for a suspend (marked so in the same write), even once the job is resumed
        but the reactivation has not been written yet."""
        if suspended or (self.suspended_by_job and not self.active):
            return None
        if self._is(DEACTIVATION_TARGET):
            return self.conditions[DEACTIVATION_TARGET]
        if not self.active:
            evicted = self.evicted
            return evicted if evicted is not None else Condition(status="True", reason=EVICTED_BY_DEACTIVATION,
                                                                 message="The workload is deactivated")
        return None


# ------------------------------------------------------------------ PodsReady

def pods_ready_condition(*, admitted: bool, all_ready: bool, current: Condition | None) -> Condition:
    """The Workload's PodsReady condition, as Kueue's own integrations compute it
    (jobframework.generatePodsReadyCondition):

    - not admitted (yet, or evicted): False/WaitForStart;
    - all pods Ready: True/Started the first time, True/Recovered after a WaitForRecovery;
    - not all Ready after they all were (a gang being recreated): False/WaitForRecovery, which stays
      until they are all Ready again;
    - otherwise: False/WaitForStart.

    `current` is the condition the Workload holds now (None when absent). Kueue's waitForPodsReady
    evicts a gang whose condition stays False past its timeout (WaitForStart) or recovery timeout."""
    if not admitted:
        return Condition("False", WAIT_FOR_START, _NOT_READY_MESSAGE)
    if all_ready:
        recovering = current is not None and current.reason in (WAIT_FOR_RECOVERY, RECOVERED)
        return Condition("True", RECOVERED if recovering else STARTED, _READY_MESSAGE)
    if current is not None and (current.true or current.reason == WAIT_FOR_RECOVERY):
        return Condition("False", WAIT_FOR_RECOVERY, _WAITING_FOR_RECOVERY_MESSAGE)
    return Condition("False", WAIT_FOR_START, _NOT_READY_MESSAGE)


def _spec(job: Job):
    if job.spec is None:
        raise KueueError("spec", f"TrainingJob {job.namespace}/{job.name} has no usable spec: {job.spec_error}")
    return job.spec
