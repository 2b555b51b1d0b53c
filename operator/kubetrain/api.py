"""The TrainingJob API: its names (group, labels, annotations, exit codes) and the typed `Job`.

The names are the operator's side of docs/contract.md (the trainer's copy is
`kubetrain_trainer/contract.py`; tests/unit/test_contract.py holds the two
equal). `Job.from_storage` turns a stored TrainingJob into frozen values: its
spec (`spec.py`, or the `SpecError` that makes the job fail as InvalidSpec)
and its status (`status.py`).
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from kubetrain.spec import Spec, SpecError, pod_fingerprint
from kubetrain.status import Status
from kubetrain.values import parse_time_or_none

GROUP = "kubetrain.io"
VERSION = "v1alpha1"
PLURAL = "trainingjobs"
KIND = "TrainingJob"
API_VERSION = f"{GROUP}/{VERSION}"

# Names and labels shared by the builders and the planner (docs/contract.md).
LABEL_JOB = "kubetrain.io/job-name"
LABEL_ATTEMPT = "kubetrain.io/attempt"
LABEL_RANK = "kubetrain.io/node-rank"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "kubetrain"
ANNOTATION_LAST_CHECKPOINT = "kubetrain.io/last-checkpoint"
ANNOTATION_CHECKPOINT_SYNC = "kubetrain.io/checkpoint-sync"
"""Set by node rank 0 while checkpoint uploads lag behind (S3 unreachable)."""
ANNOTATION_SPEC_GENERATION = "kubetrain.io/spec-generation"
"""The job's metadata.generation a pod was built from: a launch cut short (refused creates, an operator
restart) and then edited does not finish with pods of two specs."""
ANNOTATION_SPEC_FINGERPRINT = "kubetrain.io/spec-fingerprint"
"""`spec.pod_fingerprint` of the spec a pod was built from: whether an edit since waits for the next attempt."""
CONTAINER_NAME = "trainer"
METRICS_PORT_NAME = "metrics"
TMP_VOLUME = "kubetrain-tmp"
"""The pods' /tmp (an emptyDir limited to spec.tmpSize); the kubelet names it when it evicts a pod for it."""
SHM_VOLUME = "kubetrain-shm"
"""The pods' /dev/shm (a memory-backed emptyDir limited to spec.shmSize)."""
EXIT_INVALID_CONFIG = 82
EXIT_PREEMPTED = 83
FAILURE_RECORD_KIND = "kubetrain.io/failure"
"""`kind` of the record a pod that exits 82 may leave in its termination message (docs/contract.md)."""
FAILURE_REASONS: Mapping[str, str] = {
    "StorageAccessDenied": "checkpoint storage refused access",
    "StorageRequestInvalid": "checkpoint storage refused a request as invalid",
}
"""The failure record's reasons, the only ones the operator accepts (it becomes the Failed
condition's reason), with what each means for status and events."""
FAILURE_CODE = re.compile(r"^[A-Za-z][A-Za-z0-9]{0,62}$")
"""A failure record's `code` (the store's error code, e.g. AccessDenied), or the record is refused."""


def pod_name(job: str, attempt: int, rank: int) -> str:
    """`<job>-a<attempt>-n<rank>`: deterministic, so a re-create is an AlreadyExists."""
    return f"{job}-a{attempt}-n{rank}"


@dataclass(frozen=True)
class Job:
    """The parts of a stored TrainingJob the planner needs."""

    name: str
    namespace: str
    uid: str
    generation: int | None
    spec: Spec | None
    """None when the spec could not be parsed (see `spec_error`)."""
    status: Status
    deleting: bool = False
    spec_error: str | None = None
    created: dt.datetime | None = None
    """metadata.creationTimestamp: orders incarnations of a name (a name is unique at any moment,
    so a job re-created under it is always created later than the one it replaces)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """metadata.labels (the Kueue queue and priority labels, `kueue.py`)."""
    spec_fingerprint: str = ""
    """`spec.pod_fingerprint` of the stored spec (`ANNOTATION_SPEC_FINGERPRINT` on the pods built from it)."""

    @property
    def incarnation(self) -> int:
        """KUBETRAIN_JOB_INCARNATION: the creation time in epoch seconds (0 when unknown)."""
        return int(self.created.timestamp()) if self.created else 0

    @property
    def checkpoint_uri(self) -> str:
        """Where this job's checkpoints go (KUBETRAIN_CHECKPOINT_URI); "" without storage."""
        if self.spec is None or self.spec.checkpoint is None:
            return ""
        return f"{self.spec.checkpoint.uri}/{self.namespace}/{self.name}"

    @classmethod
    def from_storage(cls, body: Mapping[str, Any], *, default_image: str | None = None) -> "Job":
        meta = body.get("metadata") or {}
        status = Status.from_storage(body.get("status"))
        started = status.attempt >= 1
        try:
            spec, error = Spec.from_storage(body.get("spec"), default_image=default_image, started=started), None
        except SpecError as exc:
            spec, error = None, str(exc)
        except (TypeError, ValueError, AttributeError, KeyError) as exc:
            if started:  # it ran with this spec: a parsing bug must not fail it for good (the reconcile is retried)
                raise
            # A value of a type the CRD's schema refuses (an object stored before the schema had it, or written
            # around it): the job fails as InvalidSpec instead of its reconcile crashing every 10 s, forever.
            spec, error = None, f"spec: a value does not have the type the CRD's schema gives it ({exc!r:.200})"
        return cls(
            name=meta["name"], namespace=meta.get("namespace") or "default", uid=meta.get("uid") or "",
            generation=meta.get("generation"), spec=spec, status=status,
            deleting=bool(meta.get("deletionTimestamp")), spec_error=error,
            created=parse_time_or_none(meta.get("creationTimestamp")),
            labels={str(k): str(v) for k, v in (meta.get("labels") or {}).items()},
            spec_fingerprint=pod_fingerprint(body.get("spec")) if spec is not None else "",
        )
