"""A tiny kubelet that runs pods' containers as local processes, for the e2e tier.

kwok only fakes pods, and this machine has no container engine, so real
training in the e2e tests needs something that behaves like a kubelet towards
the API server but runs `command`+`args` as plain processes (images ignored).
This agent registers a Node (label ``kubetrain.io/agent=true``, not managed by
kwok), keeps it Ready (node status + a Lease in kube-node-lease), and for every
pod bound to it resolves env, materializes volumes, starts the processes and
reports status as a kubelet does: Pending -> Running -> Succeeded/Failed with
exit codes and termination messages; deletion gets SIGTERM, the grace period,
SIGKILL, then the pod is finalized (deleted with grace 0).

Usage::

    python -m kubetrain_testbed.agent --kubeconfig .testbed/kubeconfig --node-name kubetrain-agent-0

Rules a pod author must know are in docs/e2e.md (paths, env, credentials).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import logging
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .agent_pod import (
    ContainerConfigError,
    projected_token_seconds,
    ContainerPlan,
    CState,
    decode_secret,
    exit_code_of,
    node_object,
    node_status,
    plan_pod,
    pod_status,
    termination_message,
)
from .agent_runtime import ContainerProcess, sweep_orphans, wait_gone, write_files

log = logging.getLogger("kubetrain.agent")

TOKEN_SECONDS = 3600
RESTART_BACKOFF_MAX = 20.0
SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."


def now_str(*, micro: bool = False) -> str:
    """Now in UTC as the API stores it: RFC 3339 seconds (Time), or with microseconds (MicroTime: Leases)."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PodRecord:
    """What the agent knows of one pod bound to its node."""

    pod: dict
    states: dict[str, CState]
    procs: dict[str, ContainerProcess] = field(default_factory=dict)
    plans: dict[str, ContainerPlan] = field(default_factory=dict)
    start_time: str | None = None
    retry_at: float = 0.0
    restart_at: dict[str, float] = field(default_factory=dict)
    kill_at: float | None = None
    """Set once deletion began: SIGKILL after this monotonic time."""
    done: bool = False
    """Terminal status pushed; only the deletion is left to handle."""
    finalized: bool = False
    last_pushed: str | None = None
    token_refresh_at: float = 0.0

    @property
    def uid(self) -> str:
        return self.pod["metadata"]["uid"]

    @property
    def ref(self) -> str:
        return f"{self.pod['metadata']['namespace']}/{self.pod['metadata']['name']}"


class Agent:
    def __init__(self, *, kubeconfig: str, node_name: str, state_dir: Path, capacity: dict[str, str],
                 labels: dict[str, str], taints: list[dict], delete_node_on_exit: bool, shutdown_grace: float,
                 heartbeat_seconds: float = 2.0, lease_seconds: int = 40) -> None:
        from kubernetes import client, config

        self.client = client
        self.api = config.new_client_from_config(config_file=kubeconfig)
        self.hb_api = config.new_client_from_config(config_file=kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.node_name = node_name
        self.state_dir = state_dir
        self.capacity = capacity
        self.labels = labels
        self.taints = taints
        self.delete_node_on_exit = delete_node_on_exit
        self.shutdown_grace = shutdown_grace
        self.heartbeat_seconds = heartbeat_seconds
        self.lease_seconds = lease_seconds
        self.records: dict[str, PodRecord] = {}
        self.events: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.python_bin = Path(sys.executable).parent
        self.started_at = now_str()
        self.version = "v0.0.0"
        self.synced_once = False
        from urllib.parse import urlsplit

        api_url = urlsplit(self.api.configuration.host)
        # What a kubelet injects for the `kubernetes` Service, pointing at the real API server.
        self.pod_env = {"KUBERNETES_SERVICE_HOST": api_url.hostname or "127.0.0.1",
                        "KUBERNETES_SERVICE_PORT": str(api_url.port or 443)}

    # ------------------------------------------------------------------ node
    def register(self) -> None:
        client = self.client
        try:
            self.version = client.VersionApi(self.api).get_code().git_version
        except Exception:  # noqa: BLE001 - cosmetic only
            pass
        body = node_object(name=self.node_name, labels=self.labels, taints=self.taints)
        try:
            self.core.create_node(body)
            log.info("registered node %s", self.node_name)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
            self.core.patch_node(self.node_name, {"metadata": {"labels": body["metadata"]["labels"]}, "spec": body["spec"]})
            log.info("node %s already exists: labels and taints refreshed", self.node_name)
        self._post_node_status(self.core)
        self._renew_lease(client.CoordinationV1Api(self.api))

    def _post_node_status(self, core) -> None:
        status = node_status(capacity=self.capacity, now=now_str(), since=self.started_at, version=self.version)
        core.patch_node_status(self.node_name, {"status": status})

    def _renew_lease(self, coord) -> None:
        client = self.client
        try:
            coord.patch_namespaced_lease(self.node_name, "kube-node-lease", {"spec": {"renewTime": now_str(micro=True), "holderIdentity": self.node_name}})
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            node = self.core.read_node(self.node_name)
            coord.create_namespaced_lease("kube-node-lease", {
                "metadata": {"name": self.node_name, "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": node.metadata.uid}]},
                "spec": {"holderIdentity": self.node_name, "leaseDurationSeconds": self.lease_seconds, "renewTime": now_str(micro=True)},
            })

    def _heartbeat_loop(self) -> None:
        core = self.client.CoreV1Api(self.hb_api)
        coord = self.client.CoordinationV1Api(self.hb_api)
        last_status = 0.0
        while not self.stop.wait(self.heartbeat_seconds):
            try:
                self._renew_lease(coord)
                if time.monotonic() - last_status > 10:
                    self._post_node_status(core)
                    last_status = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - a heartbeat must survive API hiccups
                log.warning("heartbeat failed: %s", exc)

    # ------------------------------------------------------------------ watch
    def _watch_loop(self) -> None:
        from kubernetes import watch

        selector = f"spec.nodeName={self.node_name}"
        while not self.stop.is_set():
            try:
                resp = self.core.list_pod_for_all_namespaces(field_selector=selector, _preload_content=False)
                body = json.loads(resp.data)
                self.events.put(("SYNC", body["items"]))
                w = watch.Watch()
                for ev in w.stream(self.core.list_pod_for_all_namespaces, field_selector=selector,
                                   resource_version=body["metadata"]["resourceVersion"], timeout_seconds=30):
                    if self.stop.is_set():
                        w.stop()
                        break
                    if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self.events.put((ev["type"], ev["raw_object"]))
            except Exception as exc:  # noqa: BLE001 - relist after any watch failure
                if not self.stop.is_set():
                    log.warning("pod watch failed, relisting: %s", exc)
                    self.stop.wait(1.0)

    # ------------------------------------------------------------------ lookups
    def _secret(self, ns: str, name: str) -> dict[str, str] | None:
        try:
            return decode_secret(self.core.read_namespaced_secret(name, ns).data)
        except self.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _configmap(self, ns: str, name: str) -> dict[str, str] | None:
        try:
            return dict(self.core.read_namespaced_config_map(name, ns).data or {})
        except self.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _token(self, pod: dict, audience: str, seconds: int) -> bytes:
        """A token of a projected serviceAccountToken source, bound to the pod, as a kubelet requests it."""
        c = self.client
        meta, sa = pod["metadata"], pod["spec"].get("serviceAccountName") or "default"
        try:
            tr = self.core.create_namespaced_service_account_token(sa, meta["namespace"], c.AuthenticationV1TokenRequest(
                spec=c.V1TokenRequestSpec(audiences=[audience] if audience else [], expiration_seconds=seconds,
                                          bound_object_ref=c.V1BoundObjectReference(
                                              api_version="v1", kind="Pod", name=meta["name"], uid=meta["uid"]))))
        except c.ApiException as exc:
            raise ContainerConfigError(f"TokenRequest for ServiceAccount {meta['namespace']}/{sa} "
                                       f"(audience {audience!r}) failed: {exc.status} {exc.reason}") from None
        return tr.status.token.encode()

    def _credentials(self, pod: dict) -> tuple[bytes | None, dict[str, bytes]]:
        """A kubeconfig and token files for the pod's ServiceAccount (TokenRequest bound to the pod)."""
        spec = pod["spec"]
        sa = spec.get("serviceAccountName") or "default"
        if spec.get("automountServiceAccountToken") is False:
            return None, {"token": b""}
        c = self.client
        meta = pod["metadata"]
        try:
            tr = self.core.create_namespaced_service_account_token(sa, meta["namespace"], c.AuthenticationV1TokenRequest(
                spec=c.V1TokenRequestSpec(audiences=[], expiration_seconds=TOKEN_SECONDS, bound_object_ref=c.V1BoundObjectReference(
                    api_version="v1", kind="Pod", name=meta["name"], uid=meta["uid"]))))
        except c.ApiException as exc:
            raise ContainerConfigError(f"TokenRequest for ServiceAccount {meta['namespace']}/{sa} failed: {exc.status} {exc.reason}") from None
        token = tr.status.token
        cfg = self.api.configuration
        ca = Path(cfg.ssl_ca_cert).read_bytes() if cfg.ssl_ca_cert else b""
        kubeconfig = {
            "apiVersion": "v1", "kind": "Config", "current-context": "in-pod",
            "clusters": [{"name": "testbed", "cluster": {"server": cfg.host, "certificate-authority-data": base64.b64encode(ca).decode()}}],
            "users": [{"name": f"system:serviceaccount:{meta['namespace']}:{sa}", "user": {"token": token}}],
            "contexts": [{"name": "in-pod", "context": {"cluster": "testbed", "user": f"system:serviceaccount:{meta['namespace']}:{sa}", "namespace": meta["namespace"]}}],
        }
        return json.dumps(kubeconfig).encode(), {"token": token.encode()}

    # ------------------------------------------------------------------ pods
    def pod_dir(self, pod: dict) -> Path:
        m = pod["metadata"]
        return self.state_dir / "pods" / f"{m['namespace']}_{m['name']}_{m['uid'][:8]}"

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
        uid = pod["metadata"]["uid"]
        rec = self.records.get(uid)
        deleting = bool(pod["metadata"].get("deletionTimestamp"))
        if rec is not None:
            rec.pod = pod
            if deleting and rec.done and not rec.finalized:
                self.finalize(pod)
                rec.finalized = True
            elif deleting and rec.kill_at is None and not rec.done:
                self.begin_termination(rec)
            return
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            if deleting:
                self.finalize(pod)
            return
        if initial and (pod.get("status") or {}).get("startTime"):
            # Started by an earlier agent whose processes are gone (swept at start).
            log.info("pod %s/%s was started by a previous agent: failing it", pod["metadata"]["namespace"], pod["metadata"]["name"])
            states = [CState(c["name"]).terminated(exit_code=137, reason="ContainerStatusUnknown",
                                                   message="the node agent restarted; the container is gone", now=now_str())
                      for c in pod["spec"]["containers"]]
            self.patch_status(pod, pod_status(pod, states, now=now_str(), start_time=pod["status"]["startTime"], terminal=True))
            if deleting:
                self.finalize(pod)
            return
        rec = PodRecord(pod=pod, states={c["name"]: CState(c["name"]) for c in pod["spec"]["containers"]})
        self.records[uid] = rec
        if deleting:
            self.finalize(pod)
            rec.done = rec.finalized = True
            return
        self.try_start(rec)

    def _materialize(self, rec: PodRecord):
        """Plan the pod's processes with fresh credentials and write its files (volumes, token, kubeconfig)."""
        kubeconfig, sa_files = self._credentials(rec.pod)
        plan = plan_pod(rec.pod, pod_dir=self.pod_dir(rec.pod), node_name=self.node_name, python_bin=self.python_bin,
                        secrets=self._secret, configmaps=self._configmap, kubeconfig=kubeconfig, sa_files=sa_files,
                        extra_env=self.pod_env, token_for=lambda aud, secs: self._token(rec.pod, aud, secs))
        write_files(plan.files, plan.dirs)
        return plan

    def try_start(self, rec: PodRecord) -> None:
        try:
            plan = self._materialize(rec)
        except ContainerConfigError as exc:
            log.info("pod %s cannot start yet: %s", rec.ref, exc)
            rec.states = {n: s.waiting("CreateContainerConfigError", str(exc)) for n, s in rec.states.items()}
            rec.retry_at = time.monotonic() + 2.0
            self.push(rec)
            return
        rec.token_refresh_at = time.monotonic() + min([TOKEN_SECONDS, *projected_token_seconds(rec.pod)]) * 0.8
        rec.start_time = rec.start_time or now_str()
        for cp in plan.containers:
            rec.plans[cp.name] = cp
            self.start_container(rec, cp)
        self.push(rec)

    def start_container(self, rec: PodRecord, cp: ContainerPlan) -> None:
        try:
            rec.procs[cp.name] = ContainerProcess.start(cp)
            rec.states[cp.name] = rec.states[cp.name].running(now_str())
            log.info("pod %s: container %s started (pgid %d)", rec.ref, cp.name, rec.procs[cp.name].pgid)
        except OSError as exc:
            log.info("pod %s: container %s failed to start: %s", rec.ref, cp.name, exc)
            now = now_str()
            st = rec.states[cp.name]
            rec.states[cp.name] = st.running(now).terminated(exit_code=128, reason="StartError", message=str(exc), now=now)
            self.after_exit(rec, cp.name)

    def after_exit(self, rec: PodRecord, name: str) -> None:
        policy = rec.pod["spec"].get("restartPolicy", "Always")
        st = rec.states[name]
        if rec.kill_at is None and (policy == "Always" or (policy == "OnFailure" and st.exit_code != 0)):
            n = st.restart_count
            rec.states[name] = st.restarting()
            rec.restart_at[name] = time.monotonic() + min(RESTART_BACKOFF_MAX, 1.0 * 2**n)

    def begin_termination(self, rec: PodRecord) -> None:
        grace = rec.pod["metadata"].get("deletionGracePeriodSeconds")
        grace = 30 if grace is None else int(grace)
        rec.restart_at.clear()
        running = [p for p in rec.procs.values() if p.popen.poll() is None]
        log.info("pod %s deleted: SIGTERM to %d container(s), grace %ds", rec.ref, len(running), grace)
        for p in running:
            p.signal(signal.SIGTERM)
        rec.kill_at = time.monotonic() + grace

    def tick(self) -> None:
        mono = time.monotonic()
        for rec in list(self.records.values()):
            if rec.done:
                continue
            for name, proc in list(rec.procs.items()):
                if rec.states[name].state != "running":
                    continue
                code = proc.poll()
                if code is None:
                    continue
                msg = termination_message(proc.plan.message_policy, code, proc.termination_file_text(), proc.log_tail())
                reason = "Completed" if code == 0 else "Error"
                rec.states[name] = rec.states[name].terminated(exit_code=code, reason=reason, message=msg, now=now_str())
                log.info("pod %s: container %s exited with %d", rec.ref, name, code)
                self.after_exit(rec, name)
            for name, at in list(rec.restart_at.items()):
                if mono >= at:
                    del rec.restart_at[name]
                    self.start_container(rec, rec.plans[name])
            if not rec.plans and rec.kill_at is None and rec.retry_at and mono >= rec.retry_at:
                rec.retry_at = 0.0
                self.try_start(rec)
                continue
            if rec.kill_at is not None:
                alive = [p for n, p in rec.procs.items() if rec.states[n].state == "running"]
                if alive and mono < rec.kill_at:
                    continue
                for p in alive:
                    p.signal(signal.SIGKILL)
                self._reap(rec, alive)
                if rec.plans:
                    self.push(rec, terminal=True)
                self.finalize(rec.pod)
                rec.done = rec.finalized = True
                continue
            if rec.plans and mono >= rec.token_refresh_at:
                self._refresh_token(rec)
            pushed = self.push(rec)
            if pushed and rec.plans and not rec.restart_at and all(s.state == "terminated" for s in rec.states.values()):
                rec.done = True  # the terminal status is in the API; only a deletion is left to handle

    def _reap(self, rec: PodRecord, procs: list[ContainerProcess]) -> None:
        for p in procs:
            try:
                rc = p.popen.wait(timeout=5)
            except Exception:  # noqa: BLE001
                rc = -9
            code = exit_code_of(rc)
            msg = termination_message(p.plan.message_policy, code, p.termination_file_text(), p.log_tail())
            rec.states[p.plan.name] = rec.states[p.plan.name].terminated(
                exit_code=code, reason="Completed" if code == 0 else "Error", message=msg, now=now_str())
            p.signal(signal.SIGKILL)

    def _refresh_token(self, rec: PodRecord) -> None:
        rec.token_refresh_at = time.monotonic() + min([TOKEN_SECONDS, *projected_token_seconds(rec.pod)]) * 0.8
        try:
            self._materialize(rec)
        except Exception as exc:  # noqa: BLE001 - the old token is still valid for a while
            log.warning("pod %s: token refresh failed: %s", rec.ref, exc)

    def push(self, rec: PodRecord, *, terminal: bool = False, **extra) -> bool:
        """Write the pod's status if it changed; False when the API refused it (retried next tick)."""
        status = pod_status(rec.pod, list(rec.states.values()), now=now_str(), start_time=rec.start_time, terminal=terminal, **extra)
        key = json.dumps(status, sort_keys=True)
        if key == rec.last_pushed:
            return True
        if self.patch_status(rec.pod, status):
            rec.last_pushed = key
            return True
        return False

    def patch_status(self, pod: dict, status: dict) -> bool:
        m = pod["metadata"]
        try:
            self.core.patch_namespaced_pod_status(m["name"], m["namespace"], {"metadata": {"uid": m["uid"]}, "status": status},
                                                  _content_type="application/strategic-merge-patch+json")
            return True
        except self.client.ApiException as exc:
            if exc.status in (404, 409):
                return True  # gone or replaced: nothing left to report on
            log.warning("status of pod %s/%s not written (%s), will retry", m["namespace"], m["name"], exc.status)
            return False

    def finalize(self, pod: dict) -> None:
        c, m = self.client, pod["metadata"]
        try:
            self.core.delete_namespaced_pod(m["name"], m["namespace"], body=c.V1DeleteOptions(
                grace_period_seconds=0, preconditions=c.V1Preconditions(uid=m["uid"])))
            log.info("pod %s/%s finalized", m["namespace"], m["name"])
        except c.ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("finalizing pod %s/%s failed: %s", m["namespace"], m["name"], exc.status)

    def forget(self, uid: str) -> None:
        rec = self.records.pop(uid, None)
        if rec is None:
            return
        for p in rec.procs.values():
            if p.popen.poll() is None:
                log.info("pod %s vanished: killing its processes", rec.ref)
            p.signal(signal.SIGKILL)

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        swept = sweep_orphans(self.node_name, self.state_dir)
        if swept:
            log.warning("killed %d process(es) left behind by a previous agent of %s", swept, self.node_name)
        self.register()
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        threading.Thread(target=self._watch_loop, name="watch", daemon=True).start()
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
        live = [r for r in self.records.values() if r.plans and not r.done]
        for rec in live:
            for p in rec.procs.values():
                p.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_grace
        while time.monotonic() < deadline and any(p.popen.poll() is None for r in live for p in r.procs.values()):
            time.sleep(0.1)
        for rec in live:
            alive = [p for n, p in rec.procs.items() if rec.states[n].state == "running"]
            for p in alive:
                p.signal(signal.SIGKILL)
            self._reap(rec, alive)
            now = now_str()
            cond = {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                    "message": SHUTDOWN_MESSAGE, "lastTransitionTime": now}
            self.push(rec, terminal=True, reason="Terminated", message=SHUTDOWN_MESSAGE, extra_conditions=[cond])
        sweep_orphans(self.node_name, self.state_dir)
        left = wait_gone(self.node_name, 5.0)
        if left:
            log.error("processes still alive after shutdown: %s", left)
        if self.delete_node_on_exit:
            try:
                self.core.delete_node(self.node_name)
                self.client.CoordinationV1Api(self.api).delete_namespaced_lease(self.node_name, "kube-node-lease")
            except Exception as exc:  # noqa: BLE001
                log.warning("deleting node %s: %s", self.node_name, exc)
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
