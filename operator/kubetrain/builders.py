"""Pure builders of the Kubernetes objects a TrainingJob owns.

Each `get_*` returns a plain dict (the JSON the API server stores), never
touches the network, and follows docs/contract.md to the letter: names,
labels, the environment the trainer reads, credentials by secretKeyRef only.
`k8s.py` sends what these return; tests/unit/operator check them offline.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from kubetrain.api import (
    ANNOTATION_SPEC_FINGERPRINT, ANNOTATION_SPEC_GENERATION, API_VERSION, CONTAINER_NAME, GROUP, KIND, LABEL_ATTEMPT,
    LABEL_JOB, LABEL_MANAGED_BY, LABEL_RANK, MANAGED_BY, METRICS_PORT_NAME, SHM_VOLUME, TMP_VOLUME, Job, pod_name,
)
from kubetrain.resources import quantity
from kubetrain.spec import CONTRACT_ENV_NAMES, DEFAULT_METRICS_PORT, Spec
from kubetrain.identity import WebIdentity, get_identity_env, get_identity_volume

DEEPSPEED_DIR = "/etc/kubetrain/deepspeed"
DEEPSPEED_VOLUME = "kubetrain-deepspeed"
HOME_DIR = "/tmp/kubetrain/home"
DEEPSPEED_KEY = "ds_config.json"
LAUNCHER = ("python", "-m", "kubetrain_trainer.launch")
METRICS_PORT = DEFAULT_METRICS_PORT
"""The launcher's /metrics and /progress port (KUBETRAIN_METRICS_PORT, containerPort `metrics`):
the operator polls /progress there, so a NetworkPolicy must let the operator reach it."""


def get_owner_reference(job: Job) -> dict[str, Any]:
    """Controller owner reference: deleting the job garbage-collects the object."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": job.name, "uid": job.uid,
            "controller": True, "blockOwnerDeletion": True}


def get_hostname(job_name: str, rank: int) -> str:
    return f"{job_name}-n{rank}"


def get_master_addr(job: Job) -> str:
    """Stable DNS name of node 0 through the headless Service (same for every attempt)."""
    return f"{get_hostname(job.name, 0)}.{job.name}.{job.namespace}.svc"


def get_checkpoint_uri(job: Job) -> str:
    spec = _spec(job)
    if spec.checkpoint is None:
        return ""
    return f"{spec.checkpoint.uri}/{job.namespace}/{job.name}"


def get_service(*, job: Job) -> dict[str, Any]:
    """The headless Service `<job>` that gives every pod a stable DNS name."""
    spec = _spec(job)
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": job.name, "namespace": job.namespace,
                     "labels": {LABEL_JOB: job.name, LABEL_MANAGED_BY: MANAGED_BY},
                     "ownerReferences": [get_owner_reference(job)]},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {LABEL_JOB: job.name},
                 "ports": [{"name": "rendezvous", "port": spec.master_port,
                            "targetPort": spec.master_port, "protocol": "TCP"}]},
    }


def get_deepspeed_configmap(*, job: Job) -> dict[str, Any]:
    """ConfigMap `<job>-deepspeed` holding the inline DeepSpeed config."""
    spec = _spec(job)
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": f"{job.name}-deepspeed", "namespace": job.namespace,
                     "labels": {LABEL_JOB: job.name, LABEL_MANAGED_BY: MANAGED_BY},
                     "ownerReferences": [get_owner_reference(job)]},
        "data": {DEEPSPEED_KEY: json.dumps(dict(spec.strategy.deepspeed_config or {}), sort_keys=True)},
    }


EVENT_COMPONENT = "kubetrain-operator"
EVENT_MESSAGE_LIMIT = 1024
"""Longest Event message the operator posts (the API server refuses longer ones)."""


def get_event(*, job: Job, type: Literal["Normal", "Warning"], reason: str, message: str, instance: str,
              time: str) -> dict[str, Any]:
    """A core/v1 Event on the TrainingJob (what `kubectl describe tj` and `get events` show);
    `instance` is the reporting operator replica, `time` its RFC 3339 first and last timestamp."""
    return {
        "metadata": {"generateName": f"{job.name}.", "namespace": job.namespace},
        "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": job.name,
                           "namespace": job.namespace, "uid": job.uid},
        "reason": reason, "message": message[:EVENT_MESSAGE_LIMIT], "type": type,
        "source": {"component": EVENT_COMPONENT}, "reportingComponent": f"{GROUP}/operator",
        "reportingInstance": instance, "firstTimestamp": time, "lastTimestamp": time, "count": 1,
    }


def get_env(*, job: Job, attempt: int, rank: int) -> list[dict[str, Any]]:
    """The contract's environment, in the contract's order, then the user's env."""
    spec = _spec(job)
    env: list[dict[str, Any]] = [
        _var("NNODES", spec.nodes),
        _var("NODE_RANK", rank),
        _var("NPROC_PER_NODE", spec.procs_per_node),
        _var("MASTER_ADDR", get_master_addr(job)),
        _var("MASTER_PORT", spec.master_port),
        _var("KUBETRAIN_JOB_NAME", job.name),
        _var("KUBETRAIN_NAMESPACE", job.namespace),
        _var("KUBETRAIN_ATTEMPT", attempt),
        _var("KUBETRAIN_JOB_INCARNATION", job.incarnation),
        {"name": "KUBETRAIN_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        _var("KUBETRAIN_CHECKPOINT_URI", get_checkpoint_uri(job)),
    ]
    ckpt = spec.checkpoint
    if ckpt is not None:
        if ckpt.endpoint:
            env.append(_var("AWS_ENDPOINT_URL", ckpt.endpoint))
        env += get_identity_env(ckpt.identity, session_name=pod_name(job.name, attempt, rank))
        env.append(_var("AWS_REGION", ckpt.region))
    env.append(_var("KUBETRAIN_STRATEGY", spec.strategy.type))
    if spec.strategy.type == "fsdp":
        env.append(_var("KUBETRAIN_FSDP_CONFIG", json.dumps(dict(spec.strategy.fsdp or {}), sort_keys=True)))
    if spec.strategy.type == "zero3":
        key = DEEPSPEED_KEY if spec.strategy.deepspeed_config is not None else spec.strategy.deepspeed_configmap_key
        env.append(_var("KUBETRAIN_DEEPSPEED_CONFIG", f"{DEEPSPEED_DIR}/{key}"))
    if spec.trainer.builtin_task is not None and not spec.trainer.command:
        env.append(_var("KUBETRAIN_BUILTIN_TASK", spec.trainer.builtin_task))
        env.append(_var("KUBETRAIN_TRAINER_ARGS", json.dumps(dict(spec.trainer.builtin_args), sort_keys=True)))
    # The pod's terminationGracePeriodSeconds: the launcher splits it between stopping the workers
    # and uploading the emergency checkpoint.
    env.append(_var("KUBETRAIN_TERMINATION_GRACE_SECONDS", spec.run_policy.termination_grace_period_seconds))
    env.append(_var("KUBETRAIN_METRICS_PORT", METRICS_PORT))
    env.append(_var("HOME", HOME_DIR))  # the root file system is read-only; /tmp is a volume
    return env + [dict(e) for e in spec.env if e.get("name") not in CONTRACT_ENV_NAMES]  # the contract's win


def get_pod(*, job: Job, attempt: int, rank: int) -> dict[str, Any]:
    """Pod `<job>-a<attempt>-n<rank>` of the gang (docs/contract.md)."""
    spec = _spec(job)
    tpl = spec.pod_template
    labels = {**dict(tpl.get("labels") or {}), LABEL_JOB: job.name, LABEL_ATTEMPT: str(attempt),
              LABEL_RANK: str(rank), LABEL_MANAGED_BY: MANAGED_BY}
    command = list(LAUNCHER) + (["--", *spec.trainer.command] if spec.trainer.command else [])
    mounts = [dict(m) for m in tpl.get("volumeMounts") or ()]
    volumes = [dict(v) for v in tpl.get("volumes") or ()]
    token = get_identity_volume(spec.checkpoint.identity) if spec.checkpoint else None
    if token is not None:  # separate from automountServiceAccountToken; no API rights by itself
        volumes.append(token[0])
        mounts.append(token[1])
    if spec.strategy.type == "zero3":
        cm = f"{job.name}-deepspeed" if spec.strategy.deepspeed_config is not None else spec.strategy.deepspeed_configmap
        volumes.append({"name": DEEPSPEED_VOLUME, "configMap": {"name": cm}})
        mounts.append({"name": DEEPSPEED_VOLUME, "mountPath": DEEPSPEED_DIR, "readOnly": True})
    # The root file system is read-only: what the trainer writes goes to volumes (unless the user
    # mounts their own at these paths). /tmp is on the node's disk, limited so that a runaway write gets
    # this pod evicted rather than filling the disk under the node's other pods. /dev/shm is
    # memory-backed: a runtime's default is 64 MiB.
    taken = {m.get("mountPath") for m in mounts}
    tmp = {"sizeLimit": spec.tmp_size} if quantity(spec.tmp_size, "tmpSize") else {}  # 0: no limit
    for name, path, source in ((TMP_VOLUME, "/tmp", tmp),
                               (SHM_VOLUME, "/dev/shm", {"medium": "Memory", "sizeLimit": spec.shm_size})):
        if path not in taken:
            volumes.append({"name": name, "emptyDir": source})
            mounts.append({"name": name, "mountPath": path})
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "command": command,
        "env": get_env(job=job, attempt=attempt, rank=rank),
        "ports": [{"name": "rendezvous", "containerPort": spec.master_port, "protocol": "TCP"},
                  {"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Admitted by PodSecurity "restricted"; HOME is on the /tmp volume (the image's is read-only).
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "readOnlyRootFilesystem": True},
    }
    if spec.image_pull_policy:  # unset: Kubernetes' default (Always for :latest or no tag, else IfNotPresent)
        container["imagePullPolicy"] = spec.image_pull_policy
    if spec.env_from:
        container["envFrom"] = [dict(e) for e in spec.env_from]
    if spec.resources:
        container["resources"] = dict(spec.resources)
    if mounts:
        container["volumeMounts"] = mounts
    if spec.trainer.working_dir:
        container["workingDir"] = spec.trainer.working_dir
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": spec.run_policy.termination_grace_period_seconds,
        "hostname": get_hostname(job.name, rank),
        "subdomain": job.name,
        # The job's user ID (never 0) and group IDs, while runAsNonRoot and the seccomp profile stay
        # kubetrain's: PodSecurity "restricted" keeps admitting the pods.
        "securityContext": {**dict(tpl.get("securityContext") or {}), "runAsNonRoot": True,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        # No API token unless the job asks for one: the trainer needs none, and a token in the pod
        # would hand whatever rights its ServiceAccount has to every library the training code loads.
        "automountServiceAccountToken": tpl.get("automountServiceAccountToken") is True,
    }
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "schedulerName",
                "serviceAccountName", "imagePullSecrets"):
        if tpl.get(key):
            pod_spec[key] = tpl[key]
    if spec.checkpoint is not None and isinstance(spec.checkpoint.identity, WebIdentity):
        pod_spec["serviceAccountName"] = spec.checkpoint.identity.service_account
    if volumes:
        pod_spec["volumes"] = volumes
    metadata: dict[str, Any] = {
        "name": pod_name(job.name, attempt, rank), "namespace": job.namespace, "labels": labels,
        "ownerReferences": [get_owner_reference(job)],
    }
    annotations = dict(tpl.get("annotations") or {})
    if job.generation is not None:
        annotations[ANNOTATION_SPEC_GENERATION] = str(job.generation)
    if job.spec_fingerprint:
        annotations[ANNOTATION_SPEC_FINGERPRINT] = job.spec_fingerprint
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def _var(name: str, value: Any) -> dict[str, str]:
    return {"name": name, "value": str(value)}


def _spec(job: Job) -> Spec:
    if job.spec is None:
        raise ValueError(f"TrainingJob {job.namespace}/{job.name} has no usable spec: {job.spec_error}")
    return job.spec
