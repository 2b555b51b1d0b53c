"""Typed views of a TrainingJob: the spec with its defaults, and the status.

The CRD (crds/trainingjob.yaml) is the source of truth for field names and
validation; the API server applies its defaults and CEL rules before the
operator ever sees an object. This module turns the stored dict into frozen
dataclasses so the planner never touches raw dicts, applies the same defaults
again (objects created before a default existed, unit tests), and turns a
`Status` back into the dict stored under `.status`.

A spec the API server let through but the operator cannot use raises
`SpecError`, a permanent error that names the field.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any, Literal, Mapping

from kubetrain.values import (  # re-exported: the time helpers are used across the operator
    Progress, format_time, parse_time, parse_time_or_none, real_number, whole_number,
)

from kubetrain.identity import IdentityError, StorageIdentity, WebIdentity, parse_identity

GROUP = "kubetrain.io"
VERSION = "v1alpha1"
PLURAL = "trainingjobs"
KIND = "TrainingJob"
API_VERSION = f"{GROUP}/{VERSION}"

Phase = Literal["Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
TERMINAL_PHASES: frozenset[str] = frozenset({"Succeeded", "Failed"})
STARTED_PHASES: frozenset[str] = frozenset({"Pending", "Running"})
StrategyType = Literal["ddp", "fsdp", "zero3"]
BACKOFF_CAP_SECONDS = 300
DEFAULT_MAX_PREEMPTIONS = 30
"""runPolicy.maxPreemptions when unset: a bound on restarts the job did not cause."""
DEFAULT_STARTUP_GRACE_SECONDS = 300
"""runPolicy.startupGraceSeconds when unset: the window for a transient pod start error."""
DEFAULT_TERMINATION_GRACE_SECONDS = 120
"""runPolicy.terminationGracePeriodSeconds when unset: the launcher gives the workers what their
emergency save needs (at most two thirds) and the upload the rest (at least a third, so 40 s or
more here); the pod API's own default of 30 s left about 8 s for the upload
(docs/contract.md, "The grace period after SIGTERM")."""
MIN_TERMINATION_GRACE_SECONDS = 15
"""Below this no emergency checkpoint can be taken (a step, a save and an upload), so the job
would lose everything since its last periodic checkpoint on every preemption."""

# Names and labels shared by the builders and the planner (docs/contract.md).
LABEL_JOB = "kubetrain.io/job-name"
LABEL_ATTEMPT = "kubetrain.io/attempt"
LABEL_RANK = "kubetrain.io/node-rank"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "kubetrain"
ANNOTATION_LAST_CHECKPOINT = "kubetrain.io/last-checkpoint"
ANNOTATION_CHECKPOINT_SYNC = "kubetrain.io/checkpoint-sync"
"""Set by node rank 0 while checkpoint uploads lag behind (S3 unreachable)."""
CONTAINER_NAME = "trainer"
METRICS_PORT_NAME = "metrics"
DEFAULT_METRICS_PORT = 9410
"""The launcher's metrics and progress endpoint (KUBETRAIN_METRICS_PORT, containerPort `metrics`)."""
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


class SpecError(ValueError):
    """A permanent problem with the spec: retrying cannot help. Names the field."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"spec.{field_path}: {message}")
        self.field_path = field_path


# --------------------------------------------------------------------- time

MAX_URI_LENGTH = 2048

_SECRET_SHAPED = re.compile(
    r"(?P<akid>\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}\b)"
    r"|(?P<kv>(?i:[\w.-]*(?:secret|password|passwd|token|credential|api[_-]?key|access[_-]?key|session)[\w.-]*)"
    r"\s*[=:]\s*)(?P<value>\"[^\"]*\"|'[^']*'|\S+)"
    r"|(?P<bearer>(?i:bearer|basic)\s+)[A-Za-z0-9._~+/=-]{8,}"
    r"|(?P<userinfo>\b[a-z][a-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@"
    r"|(?P<pem>-----BEGIN [A-Z ]*PRIVATE KEY-----)[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)"
)


def redact(text: str) -> str:
    """`text` with anything secret-shaped replaced by `***`: AWS access key ids, values of
    key=value / key: value pairs whose key names a secret, token or password, bearer/basic
    credentials, user:password@ in URLs and private keys. Applied to everything that pods or
    the API server say before it is copied into status or events."""
    def sub(m: re.Match[str]) -> str:
        if m.group("akid"):
            return "***"
        if m.group("kv") is not None:
            return f"{m.group('kv')}***"
        if m.group("bearer"):
            return f"{m.group('bearer')}***"
        if m.group("userinfo"):
            return f"{m.group('userinfo')}***@"
        return "-----PRIVATE KEY REDACTED-----"
    return _SECRET_SHAPED.sub(sub, text)


# --------------------------------------------------------------------- spec

@dataclass(frozen=True)
class Trainer:
    """What the training container runs: the built-in trainer or a command."""

    builtin_task: str | None = None
    """`causal-lm` or `regression` for the built-in trainer; None with a command."""
    builtin_args: Mapping[str, Any] = field(default_factory=dict)
    """Arguments of the built-in trainer, passed as KUBETRAIN_TRAINER_ARGS JSON."""
    command: tuple[str, ...] = ()
    """An arbitrary command run by the launcher after `--`."""
    working_dir: str | None = None
    """The container's working directory, when set."""


@dataclass(frozen=True)
class Strategy:
    """The distributed strategy and its options."""

    type: StrategyType = "ddp"
    fsdp: Mapping[str, Any] | None = None
    """FSDP options, passed as KUBETRAIN_FSDP_CONFIG JSON (fsdp only)."""
    deepspeed_config: Mapping[str, Any] | None = None
    """Inline DeepSpeed config: the operator writes it into ConfigMap `<job>-deepspeed`."""
    deepspeed_configmap: str | None = None
    """Name of a user ConfigMap that holds the DeepSpeed JSON."""
    deepspeed_configmap_key: str = "ds_config.json"


@dataclass(frozen=True)
class Checkpoint:
    """Remote checkpoint storage and the identity the pods use for it (kubetrain.identity):
    keys only ever from a Secret, or temporary credentials (web identity, ambient)."""

    uri: str
    identity: StorageIdentity
    endpoint: str | None = None
    region: str = "us-east-1"


@dataclass(frozen=True)
class RunPolicy:
    """How failures, preemptions, deadlines and suspension are handled."""

    backoff_limit: int = 3
    """Application failures allowed before the job is Failed."""
    backoff_seconds: int = 10
    """Base of the exponential backoff between failed attempts."""
    max_preemptions: int | None = DEFAULT_MAX_PREEMPTIONS
    """Preemptions allowed before the job is Failed; unlimited when None (only a stored
    object written before the CRD had a default lacks it)."""
    active_deadline_seconds: int | None = None
    ttl_seconds_after_finished: int | None = None
    suspend: bool = False
    node_lost_grace_seconds: int = 60
    """How long a node may be NotReady (or a pod Unknown) before it counts as lost."""
    startup_grace_seconds: int = DEFAULT_STARTUP_GRACE_SECONDS
    """How long a pod may fail to start for a possibly transient reason before the job fails."""
    termination_grace_period_seconds: int = DEFAULT_TERMINATION_GRACE_SECONDS
    """The pods' terminationGracePeriodSeconds (KUBETRAIN_TERMINATION_GRACE_SECONDS): the time
    from SIGTERM to SIGKILL in which the trainer stops and uploads its emergency checkpoint."""

    def backoff_delay(self, failures: int) -> float:
        """Seconds to wait before the attempt that follows the `failures`-th failure."""
        if failures <= 0:
            return 0.0
        return float(min(BACKOFF_CAP_SECONDS, self.backoff_seconds * 2 ** (failures - 1)))


@dataclass(frozen=True)
class Spec:
    """A TrainingJob's spec, with defaults applied."""

    image: str
    image_pull_policy: str = "IfNotPresent"
    nodes: int = 1
    procs_per_node: int = 1
    master_port: int = 29500
    shm_size: str = "1Gi"
    """sizeLimit of the memory-backed /dev/shm volume."""
    resources: Mapping[str, Any] = field(default_factory=dict)
    trainer: Trainer = field(default_factory=Trainer)
    env: tuple[Mapping[str, Any], ...] = ()
    env_from: tuple[Mapping[str, Any], ...] = ()
    strategy: Strategy = field(default_factory=Strategy)
    checkpoint: Checkpoint | None = None
    run_policy: RunPolicy = field(default_factory=RunPolicy)
    pod_template: Mapping[str, Any] = field(default_factory=dict)
    """Overrides merged into every pod (labels, nodeSelector, volumes, ...)."""

    @classmethod
    def from_storage(cls, spec: Mapping[str, Any] | None, *, default_image: str | None = None) -> "Spec":
        """Parse `.spec` of a stored TrainingJob; raises SpecError naming the field."""
        spec = dict(spec or {})
        image = spec.get("image") or default_image
        if not image:
            raise SpecError("image", "is required (and no KUBETRAIN_DEFAULT_IMAGE is set)")
        if spec.get("masterPort") == DEFAULT_METRICS_PORT:
            raise SpecError("masterPort", f"must not be {DEFAULT_METRICS_PORT}: the launcher serves /metrics and "
                                          "/progress there (KUBETRAIN_METRICS_PORT)")
        return cls(
            image=str(image),
            image_pull_policy=str(spec.get("imagePullPolicy") or "IfNotPresent"),
            nodes=_int(spec, "nodes", 1, minimum=1),
            procs_per_node=_int(spec, "procsPerNode", 1, minimum=1),
            master_port=_int(spec, "masterPort", 29500, minimum=1024, maximum=65535),
            shm_size=str(spec.get("shmSize") or "1Gi"),
            resources=_resources(spec.get("resources")),
            trainer=_trainer(spec.get("trainer")),
            env=_env(spec.get("env")),
            env_from=tuple(spec.get("envFrom") or ()),
            strategy=_strategy(spec.get("strategy")),
            checkpoint=_checkpoint(spec.get("checkpoint"), spec.get("podTemplate")),
            run_policy=_run_policy(spec.get("runPolicy")),
            pod_template=_pod_template(spec.get("podTemplate")),
        )


def _int(obj: Mapping[str, Any], key: str, default: int | None, *, path: str = "",
         minimum: int | None = None, maximum: int | None = None) -> int | None:
    value = obj.get(key)
    name = f"{path}{key}"
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(name, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise SpecError(name, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SpecError(name, f"must be <= {maximum}, got {value}")
    return value


def _trainer(raw: Any) -> Trainer:
    raw = dict(raw or {})
    builtin = raw.get("builtin")
    command = raw.get("command")
    if builtin and command:
        raise SpecError("trainer", "set exactly one of builtin or command")
    if command is not None:
        if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
            raise SpecError("trainer.command", "must be a non-empty list of strings")
        return Trainer(command=tuple(command), working_dir=raw.get("workingDir"))
    builtin = dict(builtin or {})
    args = builtin.get("args") or {}
    if not isinstance(args, Mapping):
        raise SpecError("trainer.builtin.args", "must be an object")
    return Trainer(builtin_task=str(builtin.get("task") or "causal-lm"), builtin_args=dict(args),
                   working_dir=raw.get("workingDir"))


def _strategy(raw: Any) -> Strategy:
    raw = dict(raw or {})
    kind = raw.get("type") or "ddp"
    if kind not in ("ddp", "fsdp", "zero3"):
        raise SpecError("strategy.type", f"must be one of ddp, fsdp, zero3, got {kind!r}")
    deepspeed = dict(raw.get("deepspeed") or {})
    ref = dict(deepspeed.get("configMapRef") or {})
    if kind == "zero3" and not deepspeed.get("config") and not ref.get("name"):
        raise SpecError("strategy.deepspeed", "zero3 needs config or configMapRef")
    return Strategy(
        type=kind,
        fsdp=dict(raw["fsdp"]) if kind == "fsdp" and raw.get("fsdp") is not None else ({} if kind == "fsdp" else None),
        deepspeed_config=dict(deepspeed["config"]) if kind == "zero3" and deepspeed.get("config") else None,
        deepspeed_configmap=ref.get("name") if kind == "zero3" else None,
        deepspeed_configmap_key=ref.get("key") or "ds_config.json",
    )


def _checkpoint(raw: Any, pod_template: Any = None) -> Checkpoint | None:
    if not raw:
        return None
    raw = dict(raw)
    uri = raw.get("uri")
    if not uri or not str(uri).startswith("s3://"):
        raise SpecError("checkpoint.uri", f"must be an s3:// URI, got {uri!r}")
    path = str(uri)[len("s3://"):]
    if any(seg in ("", ".", "..") for seg in (path[:-1] if path.endswith("/") else path).split("/")):
        raise SpecError("checkpoint.uri", f"must be s3://bucket[/prefix] whose prefix has no '.', '..' or "
                                          f"empty ('//') segments, got {uri!r}")
    try:
        identity = parse_identity(raw)
    except IdentityError as e:
        raise SpecError(e.field_path, e.message) from None
    account = dict(pod_template or {}).get("serviceAccountName")
    if isinstance(identity, WebIdentity) and account and account != identity.service_account:
        raise SpecError("podTemplate.serviceAccountName", f"must equal spec.checkpoint.webIdentity.serviceAccountName "
                                                          f"({identity.service_account}) or be unset: the pods present "
                                                          "that ServiceAccount's token")
    return Checkpoint(uri=str(uri).rstrip("/"), identity=identity, endpoint=raw.get("endpoint") or None,
                      region=raw.get("region") or "us-east-1")


def _run_policy(raw: Any) -> RunPolicy:
    raw = dict(raw or {})
    p = "runPolicy."
    return RunPolicy(
        backoff_limit=_int(raw, "backoffLimit", 3, path=p, minimum=0),
        backoff_seconds=_int(raw, "backoffSeconds", 10, path=p, minimum=0),
        max_preemptions=_int(raw, "maxPreemptions", DEFAULT_MAX_PREEMPTIONS, path=p, minimum=0),
        active_deadline_seconds=_int(raw, "activeDeadlineSeconds", None, path=p, minimum=1),
        ttl_seconds_after_finished=_int(raw, "ttlSecondsAfterFinished", None, path=p, minimum=0),
        suspend=bool(raw.get("suspend") or False),
        node_lost_grace_seconds=_int(raw, "nodeLostGraceSeconds", 60, path=p, minimum=0),
        startup_grace_seconds=_int(raw, "startupGraceSeconds", DEFAULT_STARTUP_GRACE_SECONDS, path=p, minimum=0),
        termination_grace_period_seconds=_int(
            raw, "terminationGracePeriodSeconds", DEFAULT_TERMINATION_GRACE_SECONDS, path=p,
            minimum=MIN_TERMINATION_GRACE_SECONDS, maximum=86400),
    )


# The CRD refuses all of the following at admission; the operator checks them again (cheaply)
# so that a spec stored before a rule existed fails as InvalidSpec naming the field, instead of
# as pods the API server refuses on every attempt.

CREDENTIAL_ENV_NAMES: frozenset[str] = frozenset({
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_WEB_IDENTITY_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN",
})
"""Variables that carry (or select) AWS credentials: only ever from a Secret, never a literal
value stored in the TrainingJob (crds/trainingjob.yaml, spec.env[].value)."""
RESERVED_MOUNT_PATHS: frozenset[str] = frozenset({"/", "/dev", "/dev/termination-log", "/proc"})
RESERVED_MOUNT_TREES: tuple[str, ...] = ("/proc", "/etc/kubetrain", "/tmp/kubetrain")
"""Mount points kubetrain or the runtime owns: the paths themselves and everything below them."""

_QUALIFIED_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_QUANTITY = re.compile(r"^\+?([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]{1,3})?$")
_SUFFIX = {"": 1, "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "k": 10**3,
           "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           **{s: 2 ** (10 * (i + 1)) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))}}


def _quantity(value: Any, path: str) -> Fraction:
    """A resource quantity (4, "500m", "16Gi", "1e3") as an exact number; negative is an error."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = Fraction(value)
    else:
        m = _QUANTITY.match(value) if isinstance(value, str) else None
        if m is None:
            raise SpecError(path, f"must be a non-negative quantity such as 4, 500m or 16Gi, got {value!r}")
        suffix = m.group(2) or ""
        scale = Fraction(10) ** int(suffix[1:]) if suffix[:1] in ("e", "E") else _SUFFIX[suffix]
        number = Fraction(m.group(1)) * scale
    if number < 0:
        raise SpecError(path, f"must be a non-negative quantity such as 4, 500m or 16Gi, got {value!r}")
    return number


def _is_extended(name: str) -> bool:
    """A resource outside the kubernetes.io domain (e.g. nvidia.com/gpu): integer, never overcommitted."""
    return "/" in name and "kubernetes.io/" not in name


def _resources(raw: Any) -> dict[str, Any]:
    raw = dict(raw or {})
    parsed: dict[str, dict[str, Fraction]] = {}
    for which in ("requests", "limits"):
        parsed[which] = {}
        for name, value in dict(raw.get(which) or {}).items():
            path = f"resources.{which}.{name}"
            if "/" in name:
                if not _QUALIFIED_NAME.match(name) or name.startswith("requests."):
                    raise SpecError(path, "is not a container resource: use cpu, memory, ephemeral-storage, "
                                          "hugepages-<size> or an extended resource <domain>/<name>")
            elif name not in ("cpu", "memory", "ephemeral-storage") and not name.startswith("hugepages-"):
                raise SpecError(path, "is not a container resource: use cpu, memory, ephemeral-storage, "
                                      "hugepages-<size> or an extended resource <domain>/<name>")
            number = parsed[which][name] = _quantity(value, path)
            if _is_extended(name) and number.denominator != 1:
                raise SpecError(path, f"must be a whole number: an extended resource cannot be split, got {value!r}")
    requests, limits = parsed["requests"], parsed["limits"]
    for name, number in requests.items():
        if (_is_extended(name) or name.startswith("hugepages-")) and limits.get(name) != number:
            raise SpecError(f"resources.requests.{name}", "must be set in limits too, and equal to the limit "
                                                         "(extended resources and hugepages cannot be overcommitted)")
        if name in limits and number > limits[name]:
            raise SpecError(f"resources.requests.{name}", f"must not exceed resources.limits.{name}")
    return raw


def _env(raw: Any) -> tuple[Mapping[str, Any], ...]:
    env = tuple(raw or ())
    for i, var in enumerate(env):
        name = var.get("name") if isinstance(var, Mapping) else None
        if name in CREDENTIAL_ENV_NAMES and var.get("value"):
            raise SpecError(f"env[{i}].value", f"{name} is a credential and must not be written into the "
                                               "TrainingJob; take it from a Secret with valueFrom.secretKeyRef")
    return env


def _pod_template(raw: Any) -> dict[str, Any]:
    tpl = dict(raw or {})
    p = "podTemplate."
    for key in ("labels", "nodeSelector", "annotations"):
        for name in dict(tpl.get(key) or {}):
            if not _QUALIFIED_NAME.match(name.lower() if key == "annotations" else name):
                raise SpecError(f"{p}{key}", f"{name!r} is not a valid key: an optional DNS subdomain prefix "
                                             "and '/', then at most 63 letters, digits, '-', '_' or '.'")
    for i, mount in enumerate(tpl.get("volumeMounts") or ()):
        where = f"{p}volumeMounts[{i}]"
        path, sub = str(mount.get("mountPath") or ""), mount.get("subPath")
        segments = path.split("/")[1:]
        if not path.startswith("/") or any(seg in ("", ".", "..") for seg in segments):
            raise SpecError(f"{where}.mountPath", f"{path!r} must be a clean absolute path: no '.', '..' or "
                                                  "empty segments and no trailing /")
        if path in RESERVED_MOUNT_PATHS or any(path == t or path.startswith(t + "/") for t in RESERVED_MOUNT_TREES):
            raise SpecError(f"{where}.mountPath", f"{path} is reserved: /, /dev, /dev/termination-log, /proc, "
                                                  "/etc/kubetrain and /tmp/kubetrain (and below them)")
        if sub and (str(sub).startswith("/") or any(seg in (".", "..") for seg in str(sub).split("/"))):
            raise SpecError(f"{where}.subPath", f"{sub!r} must be a relative path inside the volume, "
                                                "without '.' or '..' segments")
    for i, tol in enumerate(tpl.get("tolerations") or ()):
        where = f"{p}tolerations[{i}]"
        if not tol.get("key") and tol.get("operator") != "Exists":
            raise SpecError(f"{where}.operator", "must be Exists when key is empty (a toleration of every taint)")
        if tol.get("tolerationSeconds") is not None and tol.get("effect") != "NoExecute":
            raise SpecError(f"{where}.effect", "must be NoExecute when tolerationSeconds is set")
        if tol.get("operator") == "Exists" and tol.get("value"):
            raise SpecError(f"{where}.value", "must be empty when operator is Exists")
    return tpl


# ------------------------------------------------------------------- status

@dataclass(frozen=True)
class Condition:
    """A standard Kubernetes condition."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str
    last_transition_time: str | None = None
    observed_generation: int | None = None
    """metav1.Condition's observedGeneration: the spec generation the condition was set from."""

    def for_storage(self) -> dict[str, Any]:
        out = {"type": self.type, "status": self.status, "reason": self.reason,
               "message": self.message, "lastTransitionTime": self.last_transition_time}
        if self.observed_generation is not None:
            out["observedGeneration"] = self.observed_generation
        return out


@dataclass(frozen=True)
class LastCheckpoint:
    """The newest checkpoint the trainer reported as committed."""

    step: int
    uri: str
    time: str | None = None
    size_bytes: int | None = None
    """Bytes of the checkpoint's files (all nodes)."""
    save_seconds: float | None = None
    """How long writing it locally took."""
    upload_seconds: float | None = None
    """How long uploading and committing it took: with save_seconds, what an emergency
    checkpoint needs of runPolicy.terminationGracePeriodSeconds."""

    @classmethod
    def from_storage(cls, raw: Any) -> "LastCheckpoint | None":
        """Parse a stored value or a pod's record; None unless every field is one the status
        schema accepts (a pod-provided value must never make status patches fail): an
        optional field that is present but invalid refuses the whole record."""
        if not isinstance(raw, Mapping):
            return None
        step, uri, time = raw.get("step"), raw.get("uri"), raw.get("time")
        if whole_number(step) is None:
            return None
        extra = {key: check(raw.get(name)) for key, name, check in _CHECKPOINT_EXTRAS}
        if any(extra[key] is None and raw.get(name) is not None for key, name, _ in _CHECKPOINT_EXTRAS):
            return None
        if not isinstance(uri, str) or not uri.startswith("s3://") or len(uri) > MAX_URI_LENGTH \
                or any(c.isspace() or not c.isprintable() for c in uri):
            return None
        try:
            when = format_time(parse_time(time)) if isinstance(time, str) else None
        except (ValueError, OverflowError):
            when = None
        return cls(step=step, uri=uri, time=when, **extra)

    def for_storage(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "uri": self.uri}
        if self.time:
            out["time"] = self.time
        out.update({name: getattr(self, key) for key, name, _ in _CHECKPOINT_EXTRAS
                    if getattr(self, key) is not None})
        return out


_CHECKPOINT_EXTRAS = (("size_bytes", "sizeBytes", whole_number), ("save_seconds", "saveSeconds", real_number),
                      ("upload_seconds", "uploadSeconds", real_number))


@dataclass(frozen=True)
class Status:
    """A TrainingJob's status. `attempt == 0` means no attempt has started yet."""

    phase: str = ""
    message: str = ""
    conditions: tuple[Condition, ...] = ()
    attempt: int = 0
    restarts: int = 0
    preemptions: int = 0
    failures: int = 0
    nodes_ready: int = 0
    nodes_total: int = 0
    start_time: str | None = None
    completion_time: str | None = None
    next_attempt_time: str | None = None
    last_checkpoint: LastCheckpoint | None = None
    observed_generation: int | None = None
    progress: Progress | None = None

    @classmethod
    def from_storage(cls, raw: Mapping[str, Any] | None) -> "Status":
        raw = dict(raw or {})

        def num(key: str) -> int:
            value = raw.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else 0

        return cls(
            phase=str(raw.get("phase") or ""),
            message=str(raw.get("message") or ""),
            conditions=tuple(
                Condition(type=str(c.get("type")), status=c.get("status") or "Unknown",
                          reason=str(c.get("reason") or ""), message=str(c.get("message") or ""),
                          last_transition_time=c.get("lastTransitionTime"),
                          observed_generation=whole_number(c.get("observedGeneration")))
                for c in raw.get("conditions") or () if isinstance(c, Mapping) and c.get("type")
            ),
            attempt=num("attempt"), restarts=num("restarts"), preemptions=num("preemptions"),
            failures=num("failures"), nodes_ready=num("nodesReady"), nodes_total=num("nodesTotal"),
            start_time=raw.get("startTime") or None,
            completion_time=raw.get("completionTime") or None,
            next_attempt_time=raw.get("nextAttemptTime") or None,
            last_checkpoint=LastCheckpoint.from_storage(raw.get("lastCheckpoint")),
            observed_generation=raw.get("observedGeneration"),
            progress=Progress.from_storage(raw.get("progress")),
        )

    def for_storage(self) -> dict[str, Any]:
        """The dict for a merge patch of `.status`: None values clear a field."""
        return {
            "phase": self.phase or None,
            "message": self.message,
            "conditions": [c.for_storage() for c in self.conditions],
            "attempt": self.attempt,
            "restarts": self.restarts,
            "preemptions": self.preemptions,
            "failures": self.failures,
            "nodesReady": self.nodes_ready,
            "nodesTotal": self.nodes_total,
            "startTime": self.start_time,
            "completionTime": self.completion_time,
            "nextAttemptTime": self.next_attempt_time,
            "lastCheckpoint": self.last_checkpoint.for_storage() if self.last_checkpoint else None,
            "observedGeneration": self.observed_generation,
            "progress": self.progress.for_storage() if self.progress else None,
        }

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)

    def with_condition(self, type_: str, status: Literal["True", "False", "Unknown"], *,
                       reason: str, message: str, now: dt.datetime) -> "Status":
        """Set one condition; lastTransitionTime moves only when its status changes."""
        old = self.condition(type_)
        when = old.last_transition_time if old is not None and old.status == status else format_time(now)
        new = Condition(type=type_, status=status, reason=reason, message=message, last_transition_time=when,
                        observed_generation=old.observed_generation if old is not None else None)
        others = tuple(c for c in self.conditions if c.type != type_)
        return replace(self, conditions=tuple(sorted(others + (new,), key=lambda c: _CONDITION_ORDER.get(c.type, 99))))

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES


_CONDITION_ORDER = {t: i for i, t in enumerate(
    ("Created", "Ready", "Running", "Restarting", "Suspended", "Succeeded", "Failed", "CheckpointsLagging",
     "StartupDelayed"))}


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
        try:
            spec, error = Spec.from_storage(body.get("spec"), default_image=default_image), None
        except SpecError as exc:
            spec, error = None, str(exc)
        return cls(
            name=meta["name"], namespace=meta.get("namespace") or "default", uid=meta.get("uid") or "",
            generation=meta.get("generation"), spec=spec, status=Status.from_storage(body.get("status")),
            deleting=bool(meta.get("deletionTimestamp")), spec_error=error,
            created=parse_time_or_none(meta.get("creationTimestamp")),
        )
