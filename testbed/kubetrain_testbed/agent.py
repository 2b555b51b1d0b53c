"""A tiny kubelet for the e2e tier: runs the pods bound to its node as local processes (the I/O shell).

kwok only fakes pods, and this machine has no container engine, so real
training in the e2e tests needs something that behaves like a kubelet towards
the API server but runs `command`+`args` as plain processes (images ignored).
This agent registers a Node (label ``kubetrain.io/agent=true``, not managed by
kwok), keeps it Ready (node status + a Lease in kube-node-lease), and for every
pod bound to it resolves env, materializes volumes, starts the processes and
reports status as a kubelet does: Pending -> Running -> Succeeded/Failed with
exit codes and termination messages; deletion gets SIGTERM, the grace period,
SIGKILL, then the pod is finalized (deleted with grace 0).

This module is the shell: threads, the event loop, and running actions. What
to do with a pod is decided by the pure state machine in `agent_machine.py`;
how a pod becomes processes and files by `agent_pod.py`; how its status reads
by `agent_status.py`; every API call is in `agent_api.py`; processes are
started, signalled and swept by `agent_runtime.py`.

Usage::

    python -m kubetrain_testbed.agent --kubeconfig .testbed/kubeconfig --node-name kubetrain-agent-0

Rules a pod author must know are in docs/e2e.md (paths, env, credentials).
"""

from __future__ import annotations

import argparse
import logging
import queue
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from . import agent_machine as machine
from .agent_api import NodeApi, now_str
from .agent_machine import (TOKEN_SECONDS, Action, Exit, Finalize, Materialize, PodState, Push, Reap, Signal,
                            StartContainer, WriteStatus)
from .agent_pod import ContainerConfigError, ContainerPlan, PodPlan, plan_pod
from .agent_runtime import ContainerProcess, sweep_orphans, wait_gone, write_files
from .agent_status import exit_code_of

CHECKOUT = Path(__file__).resolve().parents[2]
"""The checkout this agent runs from (the parent of testbed/)."""


def checkout_python_path() -> str:
    """The pods' PYTHONPATH: the operator and trainer packages of this agent's own checkout, as an image
    built from it would hold them. Without it the pods run whatever the shared virtual environment's
    editable install points at, which is the last checkout that ran scripts/setup.sh (a fresh clone of a
    CI run, since deleted) rather than this one."""
    return f"{CHECKOUT / 'operator'}:{CHECKOUT / 'trainer_image'}"


log = logging.getLogger("kubetrain.agent")


@dataclass
class PodRecord:
    """One pod: the state machine's value, and the processes and plans that only the shell holds."""

    state: PodState
    procs: dict[str, ContainerProcess] = field(default_factory=dict)
    plans: dict[str, ContainerPlan] = field(default_factory=dict)


class Agent:
    """One node: registers it, keeps it Ready, and runs the machine's actions for every pod bound to it.

    One thread handles watch events and ticks (every 0.2 s at most); the heartbeat and the watch run
    on their own threads and only hand events over through a queue."""

    def __init__(self, *, kubeconfig: str, node_name: str, state_dir: Path, capacity: dict[str, str],
                 labels: dict[str, str], taints: list[dict], delete_node_on_exit: bool, shutdown_grace: float,
                 heartbeat_seconds: float = 2.0, lease_seconds: int = 40) -> None:
        self.node = NodeApi(kubeconfig=kubeconfig, node_name=node_name, lease_seconds=lease_seconds)
        self.node_name = node_name
        self.state_dir = state_dir
        self.capacity = capacity
        self.labels = labels
        self.taints = taints
        self.delete_node_on_exit = delete_node_on_exit
        self.shutdown_grace = shutdown_grace
        self.heartbeat_seconds = heartbeat_seconds
        self.records: dict[str, PodRecord] = {}
        self.events: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.python_bin = Path(sys.executable).parent
        self.synced_once = False
        self.pod_env = {**self.node.pod_env(), "PYTHONPATH": checkout_python_path()}

    # ------------------------------------------------------------------ events
    def handle(self, kind: str, obj) -> None:
        if kind == "SYNC":
            seen = set()
            for pod in obj:
                seen.add(pod["metadata"]["uid"])
                self.observe(pod, initial=not self.synced_once)
            for uid in [u for u in self.records if u not in seen]:
                self.forget(uid)
            self.synced_once = True
        elif kind == "DELETED":
            self.forget(obj["metadata"]["uid"])
        else:
            self.observe(obj, initial=False)

    def observe(self, pod: dict, *, initial: bool) -> None:
        rec = self.records.get(pod["metadata"]["uid"])
        if rec is not None:
            terminating, mono = rec.state.kill_at is not None, time.monotonic()
            rec.state, actions = machine.updated(rec.state, pod, mono=mono)
            if not terminating and rec.state.kill_at is not None:
                log.info("pod %s deleted: SIGTERM to its containers, grace %.0fs", rec.state.ref, rec.state.kill_at - mono)
            self._run(rec, actions)
            return
        state, actions = machine.admit(pod, initial=initial, now=now_str())
        if state is None:
            for action in actions:
                if isinstance(action, WriteStatus):
                    log.info("pod %s/%s was started by a previous agent: failing it",
                             pod["metadata"]["namespace"], pod["metadata"]["name"])
                    self.node.patch_status(pod, action.status)
                elif isinstance(action, Finalize):
                    self.node.finalize(pod)
            return
        rec = self.records[state.uid] = PodRecord(state)
        self._run(rec, actions)

    def forget(self, uid: str) -> None:
        rec = self.records.pop(uid, None)
        if rec is None:
            return
        if any(p.popen.poll() is None for p in rec.procs.values()):
            log.info("pod %s vanished: killing its processes", rec.state.ref)
        self._run(rec, machine.vanished(rec.state))

    def tick(self) -> None:
        for rec in list(self.records.values()):
            if rec.state.done:
                continue
            exits = {}
            for name in rec.state.running:
                proc = rec.procs[name]
                code = proc.poll()
                if code is not None:
                    exits[name] = Exit(code, proc.termination_file_text(), proc.log_tail())
                    log.info("pod %s: container %s exited with %d", rec.state.ref, name, code)
            rec.state, actions = machine.tick(rec.state, exits=exits, mono=time.monotonic(), now=now_str())
            self._run(rec, actions)

    # ------------------------------------------------------------------ actions
    def _run(self, rec: PodRecord, actions: tuple[Action, ...]) -> None:
        """Run ``actions`` in order; the actions an outcome leads to run before the rest."""
        todo = deque(actions)
        while todo:
            todo.extendleft(reversed(self._do(rec, todo.popleft())))

    def _do(self, rec: PodRecord, action: Action) -> tuple[Action, ...]:
        st = rec.state
        if isinstance(action, Materialize) and action.start:
            try:
                plan = self._materialize(st.pod)
            except ContainerConfigError as exc:
                log.info("pod %s cannot start yet: %s", st.ref, exc)
                rec.state, more = machine.config_error(st, str(exc), mono=time.monotonic())
                return more
            rec.plans = {cp.name: cp for cp in plan.containers}
            rec.state, more = machine.materialized(st, mono=time.monotonic(), now=now_str())
            return more
        if isinstance(action, Materialize):
            try:
                self._materialize(st.pod)
            except Exception as exc:  # noqa: BLE001 - the old token is still valid for a while
                log.warning("pod %s: token refresh failed: %s", st.ref, exc)
        elif isinstance(action, StartContainer):
            self._start(rec, action.name)
        elif isinstance(action, Signal):
            for name in action.names:
                proc = rec.procs.get(name)
                if proc is not None and not (action.only_alive and proc.popen.poll() is not None):
                    proc.signal(action.sig)
        elif isinstance(action, Reap):
            for name in action.names:
                rec.state = machine.reaped(rec.state, name, self._reap(rec.procs[name]), now=now_str())
        elif isinstance(action, Push):
            status = machine.status_to_write(st, action, now=now_str())
            ok = status is None or self.node.patch_status(st.pod, status)
            rec.state = machine.pushed(st, action, status, ok=ok)
        elif isinstance(action, WriteStatus):
            self.node.patch_status(st.pod, action.status)
        elif isinstance(action, Finalize):
            self.node.finalize(st.pod)
        return ()

    def pod_dir(self, pod: dict) -> Path:
        m = pod["metadata"]
        return self.state_dir / "pods" / f"{m['namespace']}_{m['name']}_{m['uid'][:8]}"

    def _materialize(self, pod: dict) -> PodPlan:
        """Plan the pod's processes with fresh credentials and write its files (volumes, token, kubeconfig)."""
        kubeconfig, sa_files = self.node.credentials(pod, seconds=TOKEN_SECONDS)
        plan = plan_pod(pod, pod_dir=self.pod_dir(pod), node_name=self.node_name, python_bin=self.python_bin,
                        secrets=self.node.secret, configmaps=self.node.configmap, kubeconfig=kubeconfig,
                        sa_files=sa_files, extra_env=self.pod_env,
                        token_for=lambda aud, secs: self.node.token(pod, aud, secs))
        write_files(plan.files, plan.dirs)
        return plan

    def _start(self, rec: PodRecord, name: str) -> None:
        try:
            rec.procs[name] = ContainerProcess.start(rec.plans[name])
        except OSError as exc:
            log.info("pod %s: container %s failed to start: %s", rec.state.ref, name, exc)
            rec.state = machine.start_failed(rec.state, name, str(exc), mono=time.monotonic(), now=now_str())
            return
        rec.state = machine.started(rec.state, name, now=now_str())
        log.info("pod %s: container %s started (pgid %d)", rec.state.ref, name, rec.procs[name].pgid)

    @staticmethod
    def _reap(proc: ContainerProcess) -> Exit:
        """Wait (at most 5 s) for a killed container's process; its exit as the runtime reports it."""
        try:
            rc = proc.popen.wait(timeout=5)
        except Exception:  # noqa: BLE001
            rc = -9
        ex = Exit(exit_code_of(rc), proc.termination_file_text(), proc.log_tail())
        proc.signal(signal.SIGKILL)
        return ex

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        swept = sweep_orphans(self.node_name, self.state_dir)
        if swept:
            log.warning("killed %d process(es) left behind by a previous agent of %s", swept, self.node_name)
        self.node.register(labels=self.labels, taints=self.taints, capacity=self.capacity)
        threading.Thread(target=self.node.heartbeat_loop, args=(self.stop,), name="heartbeat", daemon=True,
                         kwargs={"every": self.heartbeat_seconds, "capacity": self.capacity}).start()
        threading.Thread(target=self.node.watch_loop, args=(self.stop, self.events.put), name="watch",
                         daemon=True).start()
        log.info("agent for node %s running (state in %s)", self.node_name, self.state_dir)
        try:
            while not self.stop.is_set():
                try:
                    self.handle(*self.events.get(timeout=0.2))
                    while True:
                        self.handle(*self.events.get_nowait())
                except queue.Empty:
                    pass
                try:
                    self.tick()
                except Exception:  # one bad pod must not stop the node
                    log.exception("tick failed")
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Graceful node shutdown: SIGTERM, grace, SIGKILL, pods Failed with DisruptionTarget; no orphans."""
        self.stop.set()
        live = [r for r in self.records.values() if r.state.live]
        for rec in live:
            self._run(rec, machine.shutdown_begin(rec.state))
        deadline = time.monotonic() + self.shutdown_grace
        while time.monotonic() < deadline and any(p.popen.poll() is None for r in live for p in r.procs.values()):
            time.sleep(0.1)
        for rec in live:
            self._run(rec, machine.shutdown_end(rec.state, now=now_str()))
        sweep_orphans(self.node_name, self.state_dir)
        left = wait_gone(self.node_name, 5.0)
        if left:
            log.error("processes still alive after shutdown: %s", left)
        if self.delete_node_on_exit:
            self.node.delete_node()
        log.info("agent for node %s stopped", self.node_name)


def _kv(text: str) -> tuple[str, str]:
    k, sep, v = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return k, v


def _taint(text: str) -> dict:
    kv, sep, effect = text.rpartition(":")
    if not sep or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE:EFFECT, got {text!r}")
    k, _, v = kv.partition("=")
    return {"key": k, "value": v, "effect": effect}


def main(argv: list[str] | None = None) -> int:
    from .config import REPO_ROOT

    p = argparse.ArgumentParser(prog="python -m kubetrain_testbed.agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--kubeconfig", required=True, help="admin kubeconfig of the testbed")
    p.add_argument("--node-name", default="kubetrain-agent-0")
    p.add_argument("--state-dir", type=Path, help="pod folders and logs (default .testbed/agent/<node>)")
    p.add_argument("--cpu", default="16")
    p.add_argument("--memory", default="64Gi")
    p.add_argument("--pods", default="110")
    p.add_argument("--label", type=_kv, action="append", default=[], help="extra node label KEY=VALUE")
    p.add_argument("--taint", type=_taint, action="append", default=[], help="node taint KEY=VALUE:EFFECT")
    p.add_argument("--delete-node-on-exit", action="store_true")
    p.add_argument("--shutdown-grace", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL on exit")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state_dir = (a.state_dir or REPO_ROOT / ".testbed" / "agent" / a.node_name).resolve()
    agent = Agent(kubeconfig=a.kubeconfig, node_name=a.node_name, state_dir=state_dir,
                  capacity={"cpu": a.cpu, "memory": a.memory, "pods": a.pods, "ephemeral-storage": "100Gi"},
                  labels=dict(a.label), taints=a.taint, delete_node_on_exit=a.delete_node_on_exit,
                  shutdown_grace=a.shutdown_grace)

    def on_signal(signum, frame):
        log.info("signal %d: shutting down", signum)
        agent.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
