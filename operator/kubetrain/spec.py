"""The typed spec of a TrainingJob, with its defaults, parsed strictly from the stored dict.

The CRD (crds/trainingjob.yaml) is the source of truth for field names and
validation; the API server applies its defaults and CEL rules before the
operator ever sees an object. `Spec.from_storage` turns `.spec` into frozen
dataclasses so the planner and the builders never touch raw dicts, and applies
the same defaults and rules again (objects stored before a default or a rule
existed, unit tests). A spec the API server let through but the operator cannot
use raises `SpecError`, a permanent error that names the field.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from kubetrain.identity import IdentityError, StorageIdentity, WebIdentity, parse_identity
from kubetrain.resources import QUALIFIED_NAME, ResourceError, parse_pod_security_context, parse_resources, quantity

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
DEFAULT_TMP_SIZE = "0"
"""spec.tmpSize when unset (the CRD's default): no limit. A default limit that a model's checkpoints outgrow would
evict jobs that ran before (and spend their backoffLimit); a user who wants the node's disk guarded sets one."""
_SIZE = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
"""A size in bytes as the CRD's rule for spec.tmpSize takes it (no m, u or n: fractions of a byte)."""
DEFAULT_METRICS_PORT = 9410
"""The launcher's metrics and progress endpoint (KUBETRAIN_METRICS_PORT, containerPort `metrics`)."""


class SpecError(ValueError):
    """A permanent problem with the spec: retrying cannot help. Names the field."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"spec.{field_path}: {message}")
        self.field_path = field_path


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


NEXT_ATTEMPT_RUN_POLICY = frozenset({"terminationGracePeriodSeconds"})
"""runPolicy's pod fields: an edit takes effect at the next attempt, as one of the rest of the spec (runPolicy's
limits, deadlines, grace periods and suspend apply at once)."""


def pod_fingerprint(spec: Mapping[str, Any] | None) -> str:
    """A digest of what a stored `.spec` builds pods from (all of it but runPolicy's fields that apply at once):
    the spec a running attempt's pods were made from differs from the current one only if their digests do."""
    spec = dict(spec or {})
    policy = spec.pop("runPolicy", None)
    kept = {k: v for k, v in policy.items() if k in NEXT_ATTEMPT_RUN_POLICY} if isinstance(policy, Mapping) else {}
    if kept:
        spec["runPolicy"] = kept
    checkpoint = spec.get("checkpoint")
    if isinstance(checkpoint, Mapping) and isinstance(checkpoint.get("uri"), str):
        # As `_checkpoint` reads it: the CRD lets an edit add or drop the trailing '/', which builds the same pods.
        spec["checkpoint"] = {**checkpoint, "uri": checkpoint["uri"].rstrip("/")}
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
    image_pull_policy: str | None = None
    """None: the pod leaves it out and Kubernetes decides (Always for :latest or no tag, else IfNotPresent)."""
    nodes: int = 1
    procs_per_node: int = 1
    master_port: int = 29500
    shm_size: str = "1Gi"
    """sizeLimit of the memory-backed /dev/shm volume."""
    tmp_size: str = DEFAULT_TMP_SIZE
    """sizeLimit of the /tmp emptyDir on the node's disk (local checkpoints, HOME); "0": no limit."""
    resources: Mapping[str, Any] = field(default_factory=dict)
    trainer: Trainer = field(default_factory=Trainer)
    env: tuple[Mapping[str, Any], ...] = ()
    env_from: tuple[Mapping[str, Any], ...] = ()
    strategy: Strategy = field(default_factory=Strategy)
    checkpoint: Checkpoint | None = None
    run_policy: RunPolicy = field(default_factory=RunPolicy)
    pod_template: Mapping[str, Any] = field(default_factory=dict)
    """Overrides merged into every pod (labels, nodeSelector, volumes, securityContext's IDs, ...)."""

    @classmethod
    def from_storage(cls, spec: Mapping[str, Any] | None, *, default_image: str | None = None,
                     started: bool = False) -> "Spec":
        """Parse `.spec` of a stored TrainingJob; raises SpecError naming the field. A `started` job (one that ran an
        attempt) is not held to the checks added after it could have started (an operator upgraded under it must
        not fail it): procsPerNode against the GPUs, the built-in trainer's strategy arguments."""
        spec = dict(spec or {})
        image = spec.get("image") or default_image
        if not image:
            raise SpecError("image", "is required (and no KUBETRAIN_DEFAULT_IMAGE is set)")
        if spec.get("masterPort") == DEFAULT_METRICS_PORT:
            raise SpecError("masterPort", f"must not be {DEFAULT_METRICS_PORT}: the launcher serves /metrics and "
                                          "/progress there (KUBETRAIN_METRICS_PORT)")
        procs = _int(spec, "procsPerNode", 1, minimum=1)
        try:
            resources = parse_resources(spec.get("resources"))
        except ResourceError as exc:
            raise SpecError(exc.field_path, exc.message) from None
        trainer, strategy = _trainer(spec.get("trainer")), _strategy(spec.get("strategy"))
        if not started:
            _check_builtin_strategy_args(trainer.builtin_args, strategy.type)
            _check_gpus_per_process(procs, resources, trainer)
        return cls(
            image=str(image),
            image_pull_policy=str(spec["imagePullPolicy"]) if spec.get("imagePullPolicy") else None,
            nodes=_int(spec, "nodes", 1, minimum=1),
            procs_per_node=procs,
            master_port=_int(spec, "masterPort", 29500, minimum=1024, maximum=65535),
            shm_size=str(spec["shmSize"]) if spec.get("shmSize") is not None else "1Gi",
            tmp_size=_size(spec, "tmpSize", DEFAULT_TMP_SIZE),
            resources=resources,
            trainer=trainer,
            env=_env(spec.get("env")),
            env_from=_env_from(spec.get("envFrom")),
            strategy=strategy,
            checkpoint=_checkpoint(spec.get("checkpoint"), spec.get("podTemplate")),
            run_policy=_run_policy(spec.get("runPolicy")),
            pod_template=_pod_template(spec.get("podTemplate")),
        )


def _size(obj: Mapping[str, Any], key: str, default: str) -> str:
    """A size in bytes (20Gi, 500Mi, 200G or an integer), 0 for no limit; SpecError naming the field otherwise."""
    value = obj.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not _SIZE.fullmatch(str(value)):  # as the CRD's rule: string(self).matches(...)
        raise SpecError(key, f"must be a size in bytes such as 50Gi, 500Mi or 200G (binary Ki, Mi, Gi, Ti, Pi or "
                             f"decimal k, M, G, T, P; no m, which is a thousandth), or 0 for no limit; got {value!r}")
    return str(value)


def _int(obj: Mapping[str, Any], key: str, default: int | None, *, path: str = "",
         minimum: int | None = None, maximum: int | None = None, ceiling: int | None = None) -> int | None:
    """The integer at `key` (or `default`); below `minimum` or above `maximum` is an error naming the field,
    above `ceiling` is read as `ceiling`."""
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
    return min(value, ceiling) if ceiling is not None else value


def _check_gpus_per_process(procs: int | None, resources: Mapping[str, Any], trainer: Trainer) -> None:
    """The built-in trainer on GPUs takes one per process (its local rank's); a user's own command may map its
    devices itself, and `use_cpu` takes none."""
    if trainer.command or str(trainer.builtin_args.get("use_cpu")).lower() in ("true", "1"):
        return
    for name, value in dict(resources.get("limits") or {}).items():
        gpus = quantity(value, f"resources.limits.{name}")
        if name.endswith("/gpu") and 0 < gpus < (procs or 1):
            raise SpecError("procsPerNode", f"is {procs}, more than the {gpus} {name} of each pod "
                                            f"(resources.limits.{name}): the built-in trainer runs one process per GPU")


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


FSDP_SPEC_OPTIONS = {"reshard_after_forward": "reshardAfterForward", "cpu_offload": "cpuOffload",
                     "mixed_precision": "mixedPrecision"}
"""The FSDP options spec.strategy.fsdp has a field for (trainer argument name: CRD name)."""


def _check_builtin_strategy_args(args: Mapping[str, Any], kind: str) -> None:
    """The strategy and its config are spec.strategy's: the built-in trainer's arguments may not say otherwise
    (the trainer would train another strategy than the pods' layout and the checkpoints follow, and
    spec.strategy.type cannot change while the arguments can)."""
    p = "trainer.builtin.args."
    if args.get("strategy") is not None and args["strategy"] != kind:
        raise SpecError(f"{p}strategy", f"{args['strategy']!r} differs from spec.strategy.type ({kind!r}): "
                                        "set spec.strategy.type instead and remove it here")
    if args.get("deepspeed"):
        raise SpecError(f"{p}deepspeed", "the DeepSpeed config is spec.strategy.deepspeed's (config or configMapRef, "
                                         "with spec.strategy.type zero3): set it there and remove it here")
    options = args.get("fsdp_config")
    if not options:
        return
    if kind != "fsdp":
        raise SpecError(f"{p}fsdp_config", f"only with spec.strategy.type fsdp (it is {kind!r})")
    if isinstance(options, Mapping):
        for key in options:
            name = re.sub(r"(?<!^)(?=[A-Z])", "_", str(key)).lower()
            if name in FSDP_SPEC_OPTIONS:
                raise SpecError(f"{p}fsdp_config.{key}", f"set spec.strategy.fsdp.{FSDP_SPEC_OPTIONS[name]} "
                                                         "instead and remove it here")


def _strategy(raw: Any) -> Strategy:
    raw = dict(raw or {})
    kind = raw.get("type") or "ddp"
    if kind not in ("ddp", "fsdp", "zero3"):
        raise SpecError("strategy.type", f"must be one of ddp, fsdp, zero3, got {kind!r}")
    deepspeed = dict(raw.get("deepspeed") or {})
    ref = dict(deepspeed.get("configMapRef") or {})
    if kind == "zero3" and not deepspeed.get("config") and not ref.get("name"):
        raise SpecError("strategy.deepspeed", "zero3 needs a DeepSpeed config: a non-empty config or "
                                              "configMapRef.name")
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


INT32_MAX = 2**31 - 1
"""The largest activeDeadlineSeconds and ttlSecondsAfterFinished (about 68 years; the CRD says the same)."""


def _run_policy(raw: Any) -> RunPolicy:
    raw = dict(raw or {})
    p = "runPolicy."
    return RunPolicy(
        # The CRD's bounds, applied as a ceiling to a value stored before a bound existed (failing a running
        # job over a number that worked would be worse): past them the planner's datetimes would overflow.
        backoff_limit=_int(raw, "backoffLimit", 3, path=p, minimum=0, ceiling=1000),
        backoff_seconds=_int(raw, "backoffSeconds", 10, path=p, minimum=0, ceiling=3600),
        max_preemptions=_int(raw, "maxPreemptions", DEFAULT_MAX_PREEMPTIONS, path=p, minimum=0, ceiling=100000),
        active_deadline_seconds=_int(raw, "activeDeadlineSeconds", None, path=p, minimum=1, ceiling=INT32_MAX),
        ttl_seconds_after_finished=_int(raw, "ttlSecondsAfterFinished", None, path=p, minimum=0, ceiling=INT32_MAX),
        suspend=bool(raw.get("suspend") or False),
        node_lost_grace_seconds=_int(raw, "nodeLostGraceSeconds", 60, path=p, minimum=0, ceiling=86400),
        startup_grace_seconds=_int(raw, "startupGraceSeconds", DEFAULT_STARTUP_GRACE_SECONDS, path=p, minimum=0,
                                   ceiling=86400),
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
CONTRACT_ENV_NAMES: frozenset[str] = frozenset({
    "NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "KUBETRAIN_JOB_NAME", "KUBETRAIN_NAMESPACE",
    "KUBETRAIN_ATTEMPT", "KUBETRAIN_JOB_INCARNATION", "KUBETRAIN_POD_NAME", "KUBETRAIN_CHECKPOINT_URI",
    "KUBETRAIN_STRATEGY", "KUBETRAIN_FSDP_CONFIG", "KUBETRAIN_DEEPSPEED_CONFIG", "KUBETRAIN_TRAINER_ARGS",
    "KUBETRAIN_RESUME_FROM", "KUBETRAIN_BUILTIN_TASK", "KUBETRAIN_TERMINATION_GRACE_SECONDS", "KUBETRAIN_METRICS_PORT",
})
"""The contract's variables (docs/contract.md), which spec.env cannot override: the CRD refuses them, and the
pod builder leaves out any that a spec stored before that rule has (the user's env comes after the contract's,
and the kubelet lets the last of two equal names win). Not refused here: that would fail a running job at an
operator upgrade. HOME is kubetrain's default, and a user's wins."""
RESERVED_MOUNT_PATHS: frozenset[str] = frozenset({"/", "/dev", "/dev/termination-log", "/proc"})
RESERVED_MOUNT_TREES: tuple[str, ...] = ("/proc", "/etc/kubetrain", "/tmp/kubetrain")
"""Mount points kubetrain or the runtime owns: the paths themselves and everything below them."""

def _env_from(raw: Any) -> tuple[Mapping[str, Any], ...]:
    if raw and (not isinstance(raw, list) or not all(isinstance(source, Mapping) for source in raw)):
        raise SpecError("envFrom", "must be a list of {configMapRef} or {secretRef} objects")
    return tuple(raw or ())


def _env(raw: Any) -> tuple[Mapping[str, Any], ...]:
    if raw and not isinstance(raw, list):
        raise SpecError("env", "must be a list of {name, value} or {name, valueFrom} objects")
    env = tuple(raw or ())
    for i, var in enumerate(env):
        if not isinstance(var, Mapping) or not isinstance(var.get("name"), str):
            raise SpecError(f"env[{i}]", "must be an object with a name and a value or valueFrom")
        name = var["name"]
        if name in CREDENTIAL_ENV_NAMES and var.get("value"):
            raise SpecError(f"env[{i}].value", f"{name} is a credential and must not be written into the "
                                               "TrainingJob; take it from a Secret with valueFrom.secretKeyRef")
    return env


def _pod_template(raw: Any) -> dict[str, Any]:
    tpl = dict(raw or {})
    p = "podTemplate."
    for key in ("labels", "nodeSelector", "annotations"):
        for name in dict(tpl.get(key) or {}):
            if not QUALIFIED_NAME.match(name.lower() if key == "annotations" else name):
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
    if tpl.get("securityContext") is not None:
        try:
            tpl["securityContext"] = parse_pod_security_context(tpl["securityContext"])
        except ResourceError as exc:
            raise SpecError(exc.field_path, exc.message) from None
    return tpl
