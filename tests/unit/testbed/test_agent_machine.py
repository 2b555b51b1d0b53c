"""Table tests of the node agent's pod state machine (`agent_machine.py`): pod, exits and time in, actions out.

The shell is faked only where the machine hands an action's outcome back
(start, config error, reap, status write); every status the fake writes is
kept, so each case asserts what a user would read with `kubectl get pod`.
The agent itself runs against the real testbed in tests/e2e/test_agent.py.
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass, field

import pytest

from kubetrain_testbed import agent_machine as m
from kubetrain_testbed.agent_machine import (Exit, Finalize, Materialize, PodState, Push, Reap, Signal,
                                             StartContainer, WriteStatus)

NOW = "2026-01-01T00:00:00Z"


def pod(*, policy="Never", containers=("main",), deleting=False, grace=None, status=None, volumes=(),
        message_policy=None) -> dict:
    meta = {"name": "p", "namespace": "ns", "uid": "u1"}
    if deleting:
        meta["deletionTimestamp"] = NOW
        if grace is not None:
            meta["deletionGracePeriodSeconds"] = grace
    cs = [{"name": n, "image": "img", "command": ["true"]} for n in containers]
    if message_policy:
        cs[0]["terminationMessagePolicy"] = message_policy
    return {"metadata": meta, "spec": {"restartPolicy": policy, "containers": cs, "volumes": list(volumes)},
            "status": status or {}}


@dataclass
class Shell:
    """The outcomes a real shell would observe, given by the test; the statuses it wrote, kept."""

    config_error: str | None = None
    start_error: str | None = None
    write_ok: bool = True
    actions: list = field(default_factory=list)
    written: list = field(default_factory=list)

    def run(self, st: PodState, actions, *, mono: float) -> PodState:
        todo = deque(actions)
        while todo:
            a = todo.popleft()
            self.actions.append(a)
            more = ()
            if isinstance(a, Materialize) and a.start:
                if self.config_error:
                    st, more = m.config_error(st, self.config_error, mono=mono)
                else:
                    st, more = m.materialized(st, mono=mono, now=NOW)
            elif isinstance(a, StartContainer):
                st = (m.start_failed(st, a.name, self.start_error, mono=mono, now=NOW) if self.start_error
                      else m.started(st, a.name, now=NOW))
            elif isinstance(a, Reap):
                for n in a.names:
                    st = m.reaped(st, n, Exit(137), now=NOW)
            elif isinstance(a, Push):
                status = m.status_to_write(st, a, now=NOW)
                if status is not None and self.write_ok:
                    self.written.append(status)
                st = m.pushed(st, a, status, ok=status is None or self.write_ok)
            todo.extendleft(reversed(more))
        return st

    def tick(self, st: PodState, *, mono: float, exits=None) -> PodState:
        self.actions.clear()
        st, actions = m.tick(st, exits=exits or {}, mono=mono, now=NOW)
        return self.run(st, actions, mono=mono)

    @property
    def last(self) -> dict:
        return self.written[-1]


def container(status: dict, i: int = 0) -> dict:
    return status["containerStatuses"][i]


def started(p: dict, shell: Shell | None = None, *, mono: float = 0.0) -> tuple[PodState, Shell]:
    shell = shell or Shell()
    st, actions = m.admit(p, initial=False, now=NOW)
    assert actions == (Materialize(start=True),)
    return shell.run(st, actions, mono=mono), shell


# ------------------------------------------------------------------ a pod the agent has no state for
@pytest.mark.parametrize("p, initial, has_state, actions", [
    (pod(), False, True, (Materialize(start=True),)),
    (pod(status={"startTime": NOW}), False, True, (Materialize(start=True),)),
    (pod(status={"phase": "Succeeded"}), True, False, ()),
    (pod(status={"phase": "Failed"}, deleting=True), False, False, (Finalize(),)),
    (pod(deleting=True), False, True, (Finalize(),)),
])
def test_admit(p, initial, has_state, actions):
    st, got = m.admit(p, initial=initial, now=NOW)
    assert (st is not None, got) == (has_state, actions)
    if st is not None and p["metadata"].get("deletionTimestamp"):
        assert st.done and st.finalized  # never started: nothing to stop, only the object to remove


@pytest.mark.parametrize("deleting", [False, True])
def test_a_pod_an_earlier_agent_started_fails_as_container_status_unknown(deleting):
    st, actions = m.admit(pod(deleting=deleting, status={"startTime": "2025-12-31T00:00:00Z"}), initial=True, now=NOW)
    assert st is None and isinstance(actions[0], WriteStatus)
    assert actions[1:] == ((Finalize(),) if deleting else ())
    status = actions[0].status
    term = container(status)["state"]["terminated"]
    assert (status["phase"], status["startTime"]) == ("Failed", "2025-12-31T00:00:00Z")
    assert (term["exitCode"], term["reason"]) == (137, "ContainerStatusUnknown")


# ------------------------------------------------------------------ starting
def test_start_runs_every_container_then_reports_running():
    st, shell = started(pod(containers=("a", "b")))
    assert shell.actions[1:] == [StartContainer("a"), StartContainer("b"), Push()]
    assert st.started and st.running == ("a", "b")
    assert shell.last["phase"] == "Running" and shell.last["startTime"] == NOW
    assert [c["state"] for c in shell.last["containerStatuses"]] == [{"running": {"startedAt": NOW}}] * 2


def test_missing_reference_waits_and_is_retried_every_two_seconds():
    st, shell = started(pod(), Shell(config_error="Secret ns/s3 not found"), mono=10.0)
    waiting = container(shell.last)["state"]["waiting"]
    assert (shell.last["phase"], waiting) == ("Pending", {"reason": "CreateContainerConfigError",
                                                          "message": "Secret ns/s3 not found"})
    st = shell.tick(st, mono=11.9)
    assert Materialize(start=True) not in shell.actions
    shell.config_error = None
    st = shell.tick(st, mono=12.0)
    assert shell.actions[0] == Materialize(start=True)
    assert st.running == ("main",) and shell.last["phase"] == "Running"


def test_a_binary_that_cannot_start_is_start_error_128():
    st, shell = started(pod(), Shell(start_error="No such file or directory: 'nope'"))
    term = container(shell.last)["state"]["terminated"]
    assert (term["exitCode"], term["reason"], term["message"]) == (128, "StartError", "No such file or directory: 'nope'")
    assert shell.last["phase"] == "Failed"


# ------------------------------------------------------------------ exits and restarts
@pytest.mark.parametrize("policy, code, phase, restarts", [
    ("Never", 0, "Succeeded", False),
    ("Never", 83, "Failed", False),
    ("OnFailure", 0, "Succeeded", False),
    ("OnFailure", 1, "Running", True),
    ("Always", 0, "Running", True),
])
def test_exit_under_each_restart_policy(policy, code, phase, restarts):
    st, shell = started(pod(policy=policy))
    st = shell.tick(st, mono=5.0, exits={"main": Exit(code, "bye")})
    c = container(shell.last)
    assert shell.last["phase"] == phase
    if restarts:
        assert c["state"]["waiting"]["reason"] == "CrashLoopBackOff" and c["restartCount"] == 1
        assert (c["lastState"]["terminated"]["exitCode"], c["lastState"]["terminated"]["message"]) == (code, "bye")
        assert st.restart_at == {"main": 6.0} and not st.done
    else:
        assert c["state"]["terminated"]["exitCode"] == code and c["state"]["terminated"]["message"] == "bye"
        assert st.done  # written for good: later ticks do nothing
        assert m.tick(st, exits={}, mono=100.0, now=NOW) == (st, ())


def test_restart_backoff_doubles_up_to_twenty_seconds():
    st, shell = started(pod(policy="Always"))
    mono, delays = 0.0, []
    for _ in range(7):
        st = shell.tick(st, mono=mono, exits={"main": Exit(1)})
        delays.append(st.restart_at["main"] - mono)
        mono = st.restart_at["main"]
        assert shell.tick(st, mono=mono - 0.1).running == ()  # not before the back-off is over
        st = shell.tick(st, mono=mono)
        assert StartContainer("main") in shell.actions and st.running == ("main",)
    assert delays == [1, 2, 4, 8, 16, 20, 20]
    assert container(shell.last)["restartCount"] == 7


def test_termination_message_falls_back_to_the_log_tail_on_error():
    st, shell = started(pod(message_policy="FallbackToLogsOnError"))
    shell.tick(st, mono=1.0, exits={"main": Exit(2, "", "Traceback ... boom")})
    assert container(shell.last)["state"]["terminated"]["message"] == "Traceback ... boom"


def test_a_refused_status_write_is_retried_and_only_then_done():
    st, shell = started(pod())
    shell.write_ok = False
    st = shell.tick(st, mono=1.0, exits={"main": Exit(0)})
    assert not st.done
    shell.write_ok = True
    st = shell.tick(st, mono=1.2)
    assert st.done and shell.last["phase"] == "Succeeded"


def test_an_unchanged_status_is_not_written_again():
    st, shell = started(pod())
    n = len(shell.written)
    shell.tick(shell.tick(st, mono=1.0), mono=2.0)
    assert len(shell.written) == n


# ------------------------------------------------------------------ deletion
def test_deletion_sigterm_then_sigkill_after_the_grace_then_terminal_status_and_finalize():
    st, shell = started(pod(containers=("a", "b")))
    st, actions = m.updated(st, pod(containers=("a", "b"), deleting=True, grace=10), mono=100.0)
    assert actions == (Signal(signal.SIGTERM, ("a", "b"), only_alive=True),) and st.kill_at == 110.0
    st = shell.tick(st, mono=105.0, exits={"a": Exit(143)})
    assert shell.actions == []  # b still runs within the grace: wait, report nothing yet
    st = shell.tick(st, mono=110.0)
    assert shell.actions == [Signal(signal.SIGKILL, ("b",)), Reap(("b",)), Push(terminal=True), Finalize()]
    assert st.done and st.finalized
    assert shell.last["phase"] == "Failed"
    assert [c["state"]["terminated"]["exitCode"] for c in shell.last["containerStatuses"]] == [143, 137]


def test_deletion_default_grace_is_thirty_seconds_and_a_second_update_changes_nothing():
    st, _ = started(pod())
    st, _ = m.updated(st, pod(deleting=True), mono=0.0)
    assert st.kill_at == 30.0
    assert m.updated(st, pod(deleting=True), mono=5.0) == (st, ())


def test_all_exited_within_the_grace_ends_at_once_and_restarts_are_off():
    st, shell = started(pod(policy="Always"))
    st, _ = m.updated(st, pod(policy="Always", deleting=True, grace=30), mono=0.0)
    st = shell.tick(st, mono=1.0, exits={"main": Exit(0)})
    assert shell.actions == [Signal(signal.SIGKILL, ()), Reap(()), Push(terminal=True), Finalize()]
    assert shell.last["phase"] == "Succeeded" and not st.restart_at


def test_deletion_cancels_a_pending_restart():
    st, shell = started(pod(policy="Always"))
    st = shell.tick(st, mono=0.0, exits={"main": Exit(1)})
    assert st.restart_at
    st, _ = m.updated(st, pod(policy="Always", deleting=True, grace=5), mono=0.5)
    st = shell.tick(st, mono=6.0)
    assert StartContainer("main") not in shell.actions and st.finalized


def test_deleting_a_pod_that_never_started_finalizes_without_a_status():
    st, shell = started(pod(), Shell(config_error="ConfigMap ns/cfg not found"))
    st, _ = m.updated(st, pod(deleting=True, grace=0), mono=1.0)
    st = shell.tick(st, mono=1.0)
    assert shell.actions == [Signal(signal.SIGKILL, ()), Reap(()), Finalize()]


def test_deleting_a_pod_that_ended_finalizes_it_once():
    st, shell = started(pod())
    st = shell.tick(st, mono=1.0, exits={"main": Exit(0)})
    st, actions = m.updated(st, pod(deleting=True), mono=2.0)
    assert actions == (Finalize(),) and st.finalized
    assert m.updated(st, pod(deleting=True), mono=3.0)[1] == ()


def test_a_vanished_pod_has_every_process_killed():
    st, _ = started(pod(containers=("a", "b")))
    assert m.vanished(st) == (Signal(signal.SIGKILL, ("a", "b")),)


# ------------------------------------------------------------------ tokens and node shutdown
@pytest.mark.parametrize("volumes, renew_after", [
    ((), 3600 * 0.8),
    (({"name": "t", "projected": {"sources": [{"serviceAccountToken": {"audience": "sts", "expirationSeconds": 600}}]}},),
     600 * 0.8),
])
def test_tokens_are_renewed_at_eighty_percent_of_the_shortest_lifetime(volumes, renew_after):
    st, shell = started(pod(volumes=volumes), mono=0.0)
    shell.tick(st, mono=renew_after - 1)
    assert Materialize(start=False) not in shell.actions
    st = shell.tick(st, mono=renew_after)
    assert shell.actions[0] == Materialize(start=False) and st.token_refresh_at == 2 * renew_after


def test_node_shutdown_kills_what_runs_and_fails_the_pod_as_a_disruption():
    st, shell = started(pod(containers=("a", "b")))
    assert m.shutdown_begin(st) == (Signal(signal.SIGTERM, ("a", "b")),)
    st = shell.tick(st, mono=1.0, exits={"a": Exit(143)})
    st = shell.run(st, m.shutdown_end(st, now=NOW), mono=2.0)
    assert shell.actions[-3:] == [Signal(signal.SIGKILL, ("b",)), Reap(("b",)), shell.actions[-1]]
    s = shell.last
    assert (s["phase"], s["reason"]) == ("Failed", "Terminated")
    assert {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}.items() <= \
        next(c for c in s["conditions"] if c["type"] == "DisruptionTarget").items()


def test_node_shutdown_leaves_ended_pods_alone():
    st, shell = started(pod())
    st = shell.tick(st, mono=1.0, exits={"main": Exit(0)})
    assert st.done and m.shutdown_begin(st) == () and m.shutdown_end(st, now=NOW) == ()
