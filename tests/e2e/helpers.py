"""Small helpers shared by the e2e tests: waiting, pod manifests, process inspection.

Kept free of pytest fixtures so that a test reads as: build a manifest, apply
it, wait for an observable outcome, assert on the API's answer.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

AGENT_LABEL = "kubetrain.io/agent"
AGENT_TAINT = "kubetrain.io/agent=true"
AGENT_MARKER_ENV = "KUBETRAIN_AGENT_NODE"

#: Pod spec fields that put a pod on (only) the agent's node.
AGENT_PLACEMENT = {
    "nodeSelector": {AGENT_LABEL: "true"},
    "tolerations": [{"key": AGENT_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"}],
}


def wait_for(predicate: Callable[[], object], *, timeout: float, what: str, interval: float = 0.25,
             ignore: tuple[type[BaseException], ...] = (), on_timeout: Callable[[], str] | None = None):
    """Poll until ``predicate()`` is truthy and return it; AssertionErrors always propagate."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except AssertionError:
            raise
        except ignore as exc:
            last_exc = exc
        if time.monotonic() > deadline:
            extra = f"\nlast error: {last_exc!r}" if last_exc else ""
            if on_timeout:
                extra += "\n" + on_timeout()
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{extra}")
        time.sleep(interval)


def wait_events(core, namespace: str, name: str, predicate: Callable[[list], object], *, what: str,
                timeout: float = 60) -> list:
    """The Events about object ``name`` once ``predicate(events)`` holds.

    The operator posts a job's Events after it writes the status they describe (in the
    background, best effort), so a test that has just seen a phase must wait for its Event
    rather than list once."""
    def events():
        items = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
        return items if predicate(items) else None

    return wait_for(events, timeout=timeout, interval=0.5, what=what,
                    on_timeout=lambda: "events: " + repr([(e.type, e.reason, e.message) for e in
                                                          core.list_namespaced_event(
                                                              namespace, field_selector=f"involvedObject.name={name}").items]))


def pids_with_env(entry: str) -> list[int]:
    """Live (non-zombie) processes of this user whose environment contains ``entry`` ("NAME=value")."""
    needle = entry.encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        out.append(int(d))
    return out


def signal_ready(entry: str, sig: int, *, ignored: bool = False) -> bool:
    """True when a live process whose environment contains ``entry`` has a handler installed for ``sig``
    (``ignored``: ignores it), as /proc/<pid>/status shows (SigCgt / SigIgn). A pod's program is ready
    for its SIGTERM only from then on: waiting for this replaces sleeping "to let the handler install"."""
    field = "SigIgn:" if ignored else "SigCgt:"
    bit = 1 << (sig - 1)
    for pid in pids_with_env(entry):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith(field):
                        if int(line.split()[1], 16) & bit:
                            return True
                        break
        except (OSError, ValueError, IndexError):
            continue
    return False


def marked_pids(node_name: str) -> list[int]:
    return pids_with_env(f"{AGENT_MARKER_ENV}={node_name}")


def pod_manifest(name: str, command: list[str], *, env: list[dict] | None = None, restart_policy: str = "Never",
                 grace: int = 30, **spec) -> dict:
    """A one-container pod for the agent's node; the image is required by the API but ignored by the agent."""
    container = {"name": "main", "image": "kubetrain.invalid/ignored:0", "command": command, "env": env or []}
    for key in ("volumeMounts", "terminationMessagePolicy", "envFrom", "workingDir"):
        if key in spec:
            container[key] = spec.pop(key)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            **AGENT_PLACEMENT,
            "restartPolicy": restart_policy,
            "terminationGracePeriodSeconds": grace,
            "containers": [container],
            **spec,
        },
    }


def pod_phase(core, ns: str, name: str) -> str | None:
    return core.read_namespaced_pod(name, ns).status.phase


def wait_phase(core, ns: str, name: str, phases: tuple[str, ...], timeout: float = 120.0, on_timeout=None):
    def done():
        pod = core.read_namespaced_pod(name, ns)
        return pod if pod.status.phase in phases else None

    return wait_for(done, timeout=timeout, what=f"pod {ns}/{name} in {phases}", on_timeout=on_timeout)


class PodRecorder:
    """Records every state of one pod (as raw dicts) from a watch, until it is deleted."""

    def __init__(self, api_client, ns: str, name: str) -> None:
        from kubernetes import client, watch

        self.states: list[dict] = []
        self.deleted = threading.Event()
        self._watch = watch.Watch()
        core = client.CoreV1Api(api_client)
        selector = f"metadata.name={name}"
        # Watch from a resourceVersion read now: nothing that happens after this line can be missed,
        # however late the watch connection is made.
        listed = core.list_namespaced_pod(ns, field_selector=selector)
        self.states.extend(client.ApiClient().sanitize_for_serialization(p) for p in listed.items)
        rv = listed.metadata.resource_version

        def run() -> None:
            stream = self._watch.stream(core.list_namespaced_pod, ns, field_selector=selector,
                                        resource_version=rv, timeout_seconds=300)
            try:
                for ev in stream:
                    self.states.append(ev["raw_object"])
                    if ev["type"] == "DELETED":
                        self.deleted.set()
                        break
            except Exception:  # noqa: BLE001 - stop() closes the connection under the reader
                pass

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def wait_deleted(self, timeout: float) -> float:
        t0 = time.monotonic()
        if not self.deleted.wait(timeout):
            self._watch.stop()
            raise AssertionError(f"pod not deleted within {timeout}s; last status: {self.last_status()}")
        return time.monotonic() - t0

    def phases(self) -> list[str]:
        out: list[str] = []
        for s in self.states:
            p = (s.get("status") or {}).get("phase")
            if p and (not out or out[-1] != p):
                out.append(p)
        return out

    def last_status(self) -> dict:
        return (self.states[-1].get("status") or {}) if self.states else {}

    def stop(self) -> None:
        self._watch.stop()


def terminated(status: dict, container: str = "main") -> dict:
    for cs in status.get("containerStatuses") or []:
        if cs["name"] == container:
            return (cs.get("state") or {}).get("terminated") or {}
    return {}
