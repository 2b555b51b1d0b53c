"""The test node agent's pod state machine: a pod, its observed processes and the time in; next state and actions out.

Pure: no API calls, no processes, no clock, no threads. The I/O shell
(`agent.py`) feeds it what it observed - a pod from the watch, the exits of
processes, the outcome of an action it ran - together with the time (``mono``:
monotonic seconds for deadlines; ``now``: RFC 3339 for the API), and runs the
actions it gets back, in order. Every function returns the pod's new
`PodState` and a tuple of actions. The outcome of an action that matters is
handed back through another function here (`materialized` or `config_error`,
`started` or `start_failed`, `reaped`, `pushed`), whose own actions run before
the rest of the list.

The rules, as far as the e2e tier needs a kubelet's:
- a pod starts once every reference it makes resolves; until then its containers wait in
  CreateContainerConfigError and the start is retried every 2 s;
- under restartPolicy Always (or OnFailure after a failure) an exited container restarts after
  1, 2, 4 ... 20 s (CrashLoopBackOff), never once the pod is being deleted;
- a deletion sends SIGTERM, SIGKILL once the grace period is over, then writes the terminal
  status and finalizes the pod (deletes it with grace 0);
- a pod an earlier agent had started is Failed with ContainerStatusUnknown (its processes were swept);
- a node shutdown ends every live pod Failed, with a DisruptionTarget condition;
- the status is written only when it changed; a write the API refused is retried on the next tick;
  once all containers ended for good and that is written, only a deletion is left to handle.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field, replace
from typing import Mapping, Union

from .agent_pod import projected_token_seconds
from .agent_status import CState, pod_status, termination_message

TOKEN_SECONDS = 3600
"""Lifetime the agent asks for the pod's API token (kubeconfig and ServiceAccount mount)."""
TOKEN_RENEW_AT = 0.8
"""Fraction of the shortest token lifetime after which every token of the pod is renewed."""
RESTART_BACKOFF_MAX = 20.0
CONFIG_RETRY_SECONDS = 2.0
DEFAULT_GRACE_SECONDS = 30
SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."
UNKNOWN_MESSAGE = "the node agent restarted; the container is gone"


@dataclass(frozen=True)
class PodState:
    """What the agent knows of one pod bound to its node. Changed only by the functions below."""

    pod: dict
    containers: Mapping[str, CState]
    """Per container name, in the spec's order."""
    started: bool = False
    """The pod's processes were planned and its files written (its containers were started once)."""
    start_time: str | None = None
    retry_at: float = 0.0
    """When a start that failed on a missing reference is tried again (0: none pending)."""
    restart_at: Mapping[str, float] = field(default_factory=dict)
    kill_at: float | None = None
    """Set once the deletion began: SIGKILL after this time."""
    token_refresh_at: float = 0.0
    done: bool = False
    """The terminal status is in the API; only the deletion is left to handle."""
    finalized: bool = False
    last_pushed: str | None = None
    """The last status written, as a canonical JSON key."""

    @classmethod
    def of(cls, pod: dict) -> PodState:
        return cls(pod=pod, containers={c["name"]: CState(c["name"]) for c in pod["spec"]["containers"]})

    @property
    def uid(self) -> str:
        return self.pod["metadata"]["uid"]

    @property
    def ref(self) -> str:
        return f"{self.pod['metadata']['namespace']}/{self.pod['metadata']['name']}"

    @property
    def running(self) -> tuple[str, ...]:
        """Containers whose process the agent last saw alive."""
        return tuple(n for n, c in self.containers.items() if c.state == "running")

    @property
    def live(self) -> bool:
        """Started and not ended for good: what a node shutdown has to stop."""
        return self.started and not self.done

    def with_container(self, name: str, state: CState) -> PodState:
        return replace(self, containers={**self.containers, name: state})


@dataclass(frozen=True)
class Exit:
    """A container's main process ended: its exit code (128+N after signal N), termination file and log tail."""

    code: int
    file_text: str = ""
    log_tail: str = ""


# ------------------------------------------------------------------ actions
@dataclass(frozen=True)
class Materialize:
    """Plan the pod with fresh credentials and write its files (volumes, tokens, kubeconfig).

    ``start``: then start it; the outcome goes to `materialized` or `config_error`. Otherwise it
    only renews the tokens, and a failure is just logged (the old tokens still hold a while)."""

    start: bool


@dataclass(frozen=True)
class StartContainer:
    """Start the container's process; the outcome goes to `started` or `start_failed`."""

    name: str


@dataclass(frozen=True)
class Signal:
    """Send ``sig`` to the process groups of the named containers that have one."""

    sig: int
    names: tuple[str, ...]
    only_alive: bool = False
    """Skip groups whose main process has already exited."""


@dataclass(frozen=True)
class Reap:
    """Wait (at most 5 s) for each named container's process; each exit goes to `reaped`."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class Push:
    """Write the pod's status from its state (`status_to_write`); the outcome goes to `pushed`."""

    terminal: bool = False
    """The pod is being deleted or its node shuts down: nothing restarts any more."""
    reason: str | None = None
    message: str | None = None
    extra_conditions: tuple[dict, ...] = ()
    settle: bool = False
    """Once written, a status with every container ended for good makes the pod done."""


@dataclass(frozen=True)
class WriteStatus:
    """Write this status of a pod the agent keeps no state for."""

    status: dict


@dataclass(frozen=True)
class Finalize:
    """Delete the pod object with grace 0, on the condition that its uid is still the same."""


Action = Union[Materialize, StartContainer, Signal, Reap, Push, WriteStatus, Finalize]
Step = tuple[PodState, tuple[Action, ...]]


# ------------------------------------------------------------------ the watch
def _deleting(pod: dict) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def admit(pod: dict, *, initial: bool, now: str) -> tuple[PodState | None, tuple[Action, ...]]:
    """A pod bound to this node that the agent has no state for. ``initial``: seen in the agent's first listing."""
    status = pod.get("status") or {}
    deleting = _deleting(pod)
    finalize: tuple[Action, ...] = (Finalize(),) if deleting else ()
    if status.get("phase") in ("Succeeded", "Failed"):
        return None, finalize
    if initial and status.get("startTime"):
        # Started by an earlier agent whose processes are gone (the shell swept them at its start).
        states = [CState(c["name"]).terminated(exit_code=137, reason="ContainerStatusUnknown",
                                               message=UNKNOWN_MESSAGE, now=now)
                  for c in pod["spec"]["containers"]]
        body = pod_status(pod, states, now=now, start_time=status["startTime"], terminal=True)
        return None, (WriteStatus(body), *finalize)
    st = PodState.of(pod)
    if deleting:
        return replace(st, done=True, finalized=True), finalize
    return st, (Materialize(start=True),)


def updated(st: PodState, pod: dict, *, mono: float) -> Step:
    """A newer version of the pod: a deletion begins the termination, or finalizes a pod that has ended."""
    st = replace(st, pod=pod)
    if not _deleting(pod):
        return st, ()
    if st.done and not st.finalized:
        return replace(st, finalized=True), (Finalize(),)
    if st.kill_at is None and not st.done:
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        grace = DEFAULT_GRACE_SECONDS if grace is None else int(grace)
        st = replace(st, restart_at={}, kill_at=mono + grace)
        return st, (Signal(signal.SIGTERM, tuple(st.containers), only_alive=True),)
    return st, ()


def vanished(st: PodState) -> tuple[Action, ...]:
    """The pod object is gone: nothing of it may keep running."""
    return (Signal(signal.SIGKILL, tuple(st.containers)),)


# ------------------------------------------------------------------ starting
def _token_period(pod: dict) -> float:
    return min([TOKEN_SECONDS, *projected_token_seconds(pod)]) * TOKEN_RENEW_AT


def materialized(st: PodState, *, mono: float, now: str) -> Step:
    """The pod's files are written: start every container, then report."""
    st = replace(st, started=True, token_refresh_at=mono + _token_period(st.pod), start_time=st.start_time or now)
    return st, (*(StartContainer(n) for n in st.containers), Push())


def config_error(st: PodState, message: str, *, mono: float) -> Step:
    """A reference of the pod does not resolve (yet): its containers wait, the start is tried again later."""
    states = {n: c.waiting("CreateContainerConfigError", message) for n, c in st.containers.items()}
    return replace(st, containers=states, retry_at=mono + CONFIG_RETRY_SECONDS), (Push(),)


def started(st: PodState, name: str, *, now: str) -> PodState:
    return st.with_container(name, st.containers[name].running(now))


def start_failed(st: PodState, name: str, error: str, *, mono: float, now: str) -> PodState:
    """The process could not be started (no such binary...): exit 128, StartError, as a runtime reports it."""
    c = st.containers[name].running(now).terminated(exit_code=128, reason="StartError", message=error, now=now)
    return _after_exit(st.with_container(name, c), name, mono=mono)


# ------------------------------------------------------------------ exits
def _container(pod: dict, name: str) -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == name)


def _exited(st: PodState, name: str, ex: Exit, *, now: str) -> PodState:
    policy = _container(st.pod, name).get("terminationMessagePolicy") or "File"
    message = termination_message(policy, ex.code, ex.file_text, ex.log_tail)
    c = st.containers[name].terminated(exit_code=ex.code, reason="Completed" if ex.code == 0 else "Error",
                                       message=message, now=now)
    return st.with_container(name, c)


def _after_exit(st: PodState, name: str, *, mono: float) -> PodState:
    """Schedule a restart when the restart policy asks for one and the pod is not being deleted."""
    policy = st.pod["spec"].get("restartPolicy", "Always")
    c = st.containers[name]
    if st.kill_at is None and (policy == "Always" or (policy == "OnFailure" and c.exit_code != 0)):
        delay = min(RESTART_BACKOFF_MAX, 1.0 * 2**c.restart_count)
        return replace(st.with_container(name, c.restarting()), restart_at={**st.restart_at, name: mono + delay})
    return st


def reaped(st: PodState, name: str, ex: Exit, *, now: str) -> PodState:
    """A process waited for after SIGKILL: it ended for good, whatever the restart policy says."""
    return _exited(st, name, ex, now=now)


def tick(st: PodState, *, exits: Mapping[str, Exit], mono: float, now: str) -> Step:
    """The periodic step: take in the processes that exited, restart, retry, kill, renew tokens, report.

    ``exits``: the containers among `PodState.running` whose main process has ended."""
    if st.done:
        return st, ()
    for name, ex in exits.items():
        if st.containers[name].state == "running":
            st = _after_exit(_exited(st, name, ex, now=now), name, mono=mono)
    due = tuple(n for n, at in st.restart_at.items() if mono >= at)
    st = replace(st, restart_at={n: at for n, at in st.restart_at.items() if n not in due})
    actions: list[Action] = [StartContainer(n) for n in due]
    if not st.started and st.kill_at is None and st.retry_at and mono >= st.retry_at:
        return replace(st, retry_at=0.0), (*actions, Materialize(start=True))
    if st.kill_at is not None:
        # No restart is ever due here: a deletion clears them and schedules none.
        alive = st.running
        if alive and mono < st.kill_at:
            return st, tuple(actions)
        ending: tuple[Action, ...] = (Signal(signal.SIGKILL, alive), Reap(alive))
        if st.started:
            ending += (Push(terminal=True),)
        return replace(st, done=True, finalized=True), (*actions, *ending, Finalize())
    if st.started and mono >= st.token_refresh_at:
        st = replace(st, token_refresh_at=mono + _token_period(st.pod))
        actions.append(Materialize(start=False))
    actions.append(Push(settle=True))
    return st, tuple(actions)


# ------------------------------------------------------------------ reporting
def _key(status: dict) -> str:
    return json.dumps(status, sort_keys=True)


def status_to_write(st: PodState, push: Push, *, now: str) -> dict | None:
    """The status ``push`` asks for, or None when it is the one written last."""
    status = pod_status(st.pod, list(st.containers.values()), now=now, start_time=st.start_time,
                        terminal=push.terminal, reason=push.reason, message=push.message,
                        extra_conditions=list(push.extra_conditions) or None)
    return None if _key(status) == st.last_pushed else status


def pushed(st: PodState, push: Push, status: dict | None, *, ok: bool) -> PodState:
    """The outcome of a `Push`: ``status`` None (nothing new to write) or written when ``ok``."""
    if not ok:
        return st  # refused: the next tick writes it again
    if status is not None:
        st = replace(st, last_pushed=_key(status))
    if (push.settle and st.started and not st.restart_at
            and all(c.state == "terminated" for c in st.containers.values())):
        st = replace(st, done=True)
    return st


# ------------------------------------------------------------------ node shutdown
def shutdown_begin(st: PodState) -> tuple[Action, ...]:
    """The node shuts down: every process of a live pod gets SIGTERM (the shell then waits its grace)."""
    return (Signal(signal.SIGTERM, tuple(st.containers)),) if st.live else ()


def shutdown_end(st: PodState, *, now: str) -> tuple[Action, ...]:
    """The shutdown grace is over: what still runs is killed; the pod ends Failed with DisruptionTarget."""
    if not st.live:
        return ()
    alive = st.running
    cond = {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
            "message": SHUTDOWN_MESSAGE, "lastTransitionTime": now}
    return (Signal(signal.SIGKILL, alive), Reap(alive),
            Push(terminal=True, reason="Terminated", message=SHUTDOWN_MESSAGE, extra_conditions=(cond,)))
