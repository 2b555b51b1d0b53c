"""What the test node agent reports, as a kubelet would: container states, the pod's phase and status, the Node.

Pure functions over plain dicts (the pod as the API serves it as JSON) and
`CState` values: no API calls, no processes, no clock (the time comes in as
``now``, an RFC 3339 string). `agent_machine.py` decides when a container
changes state; this module says how each state reads in the API.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

MAX_MESSAGE_BYTES = 4096
"""A kubelet truncates termination messages to 4096 bytes."""


@dataclass(frozen=True)
class CState:
    """The agent's view of one container, as it will appear in containerStatuses."""

    name: str
    state: Literal["waiting", "running", "terminated"] = "waiting"
    reason: str = "ContainerCreating"
    message: str = ""
    started_at: str | None = None
    finished_at: str | None = None
    exit_code: int | None = None
    restart_count: int = 0
    last_terminated: dict | None = None

    def running(self, now: str) -> "CState":
        return replace(self, state="running", reason="", message="", started_at=now, finished_at=None, exit_code=None)

    def terminated(self, *, exit_code: int, reason: str, message: str, now: str) -> "CState":
        return replace(self, state="terminated", exit_code=exit_code, reason=reason, message=message, finished_at=now)

    def waiting(self, reason: str, message: str = "") -> "CState":
        last = self.last_terminated
        if self.state == "terminated":
            last = self.terminated_dict()
        return replace(self, state="waiting", reason=reason, message=message, last_terminated=last)

    def restarting(self) -> "CState":
        """After an exit under restartPolicy Always/OnFailure: CrashLoopBackOff until the next run."""
        waiting = self.waiting("CrashLoopBackOff", f"back-off restarting container {self.name}")
        return replace(waiting, restart_count=self.restart_count + 1)

    def terminated_dict(self) -> dict:
        out = {"exitCode": self.exit_code, "reason": self.reason, "startedAt": self.started_at, "finishedAt": self.finished_at}
        if self.message:
            out["message"] = self.message
        return out


def termination_message(policy: str, exit_code: int, file_text: str, log_tail: str) -> str:
    msg = file_text
    if not msg.strip() and exit_code != 0 and policy == "FallbackToLogsOnError":
        msg = log_tail
    return msg.encode()[-MAX_MESSAGE_BYTES:].decode("utf-8", "replace") if len(msg.encode()) > MAX_MESSAGE_BYTES else msg


def exit_code_of(returncode: int) -> int:
    """Popen's returncode (-N for a signal) as a container runtime reports it (128+N)."""
    return 128 - returncode if returncode < 0 else returncode


def phase_of(restart_policy: str, states: list[CState], *, terminal: bool = False) -> str:
    """``terminal``: the pod is being deleted or its node shuts down, so nothing restarts any more."""
    if terminal:
        restart_policy = "Never"
        if not all(s.state == "terminated" for s in states):
            return "Failed"
    if all(s.state == "terminated" for s in states):
        if restart_policy == "Always":
            return "Running"
        if all(s.exit_code == 0 for s in states):
            return "Succeeded"
        return "Failed" if restart_policy == "Never" else "Running"
    if any(s.started_at for s in states) or any(s.restart_count for s in states):
        return "Running"
    return "Pending"


def _cstatus(s: CState, image: str) -> dict:
    if s.state == "running":
        state = {"running": {"startedAt": s.started_at}}
    elif s.state == "terminated":
        state = {"terminated": s.terminated_dict()}
    else:
        state = {"waiting": {"reason": s.reason, **({"message": s.message} if s.message else {})}}
    out = {
        "name": s.name,
        "state": state,
        "lastState": {"terminated": s.last_terminated} if s.last_terminated else {},
        "ready": s.state == "running",
        "started": s.state == "running",
        "restartCount": s.restart_count,
        "image": image,
        "imageID": "",
        "containerID": f"kubetrain-agent://{s.name}-{s.restart_count}" if s.started_at else None,
    }
    return out


def pod_status(
    pod: dict,
    states: list[CState],
    *,
    now: str,
    start_time: str | None,
    terminal: bool = False,
    reason: str | None = None,
    message: str | None = None,
    extra_conditions: list[dict] | None = None,
) -> dict:
    """A status patch (strategic merge: conditions by type; containerStatuses are replaced whole)."""
    restart_policy = pod["spec"].get("restartPolicy", "Always")
    phase = phase_of(restart_policy, states, terminal=terminal)
    images = {c["name"]: c.get("image", "") for c in pod["spec"]["containers"]}
    ready = phase == "Running" and all(s.state == "running" for s in states)
    not_ready_reason = "PodCompleted" if phase in ("Succeeded", "Failed") else "ContainersNotReady"

    def cond(type_: str, ok: bool, reason: str = "") -> dict:
        old = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}.get(type_, {})
        status = "True" if ok else "False"
        since = old.get("lastTransitionTime") if old.get("status") == status else now
        out = {"type": type_, "status": status, "lastTransitionTime": since or now, "lastProbeTime": None}
        if not ok and reason:
            out["reason"] = reason
        return out

    status = {
        "phase": phase,
        "hostIP": "127.0.0.1",
        "hostIPs": [{"ip": "127.0.0.1"}],
        "podIP": "127.0.0.1",
        "podIPs": [{"ip": "127.0.0.1"}],
        "startTime": start_time or now,
        "conditions": [
            cond("PodReadyToStartContainers", True),
            cond("Initialized", True),
            cond("ContainersReady", ready, not_ready_reason),
            cond("Ready", ready, not_ready_reason),
            *(extra_conditions or []),
        ],
        "containerStatuses": [_cstatus(s, images.get(s.name, "")) for s in states],
    }
    if reason:
        status["reason"] = reason
    if message:
        status["message"] = message
    return status


def node_object(*, name: str, labels: dict[str, str], taints: list[dict]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "kubetrain.io/agent": "true",
                **labels,
            },
        },
        "spec": {"taints": taints},
    }


def node_status(*, capacity: dict[str, str], now: str, since: str, version: str) -> dict:
    """``now`` is the heartbeat; ``since`` the moment the agent started (conditions never flip while it runs)."""

    def cond(type_: str, ok: bool, reason: str, message: str) -> dict:
        return {
            "type": type_,
            "status": "True" if ok else "False",
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": now,
            "lastTransitionTime": since,
        }

    return {
        "capacity": capacity,
        "allocatable": capacity,
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": "localhost"}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
        "nodeInfo": {
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
            "kernelVersion": "",
            "osImage": "kubetrain test node agent",
            "containerRuntimeVersion": "kubetrain-agent://local-processes",
            "kubeletVersion": version,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
        "conditions": [
            cond("Ready", True, "KubeletReady", "kubetrain test node agent is posting ready status"),
            cond("MemoryPressure", False, "KubeletHasSufficientMemory", "no pressure"),
            cond("DiskPressure", False, "KubeletHasNoDiskPressure", "no pressure"),
            cond("PIDPressure", False, "KubeletHasSufficientPID", "no pressure"),
        ],
    }

