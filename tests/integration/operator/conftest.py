"""Fixtures for the operator's integration tests against the real testbed.

`operator` runs `python -m kubetrain operator run` as a subprocess with the
testbed's admin kubeconfig, watching only the test's namespace (so parallel
tests and other operators do not interfere); it can be SIGKILLed and started
again. `pod_timeline` records the namespace's pod watch stream in order, which
is how tests prove that attempts never overlap.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

import pytest

from kubetrain_optest import Jobs, PodTimeline

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def trainingjob_crd(kubectl) -> None:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "trainingjob.yaml"))
    kubectl("wait", "--for=condition=Established", "crd/trainingjobs.kubetrain.io", "--timeout=120s", timeout=180)


class OperatorProcess:
    """The operator as a child process; its log goes to a file shown when a test fails."""

    def __init__(self, env: dict[str, str], namespace: str, log_path: Path, args: Sequence[str] = ()) -> None:
        self.env = {**env, "KUBETRAIN_NAMESPACES": namespace, "KUBETRAIN_LOG_LEVEL": "INFO",
                    "PYTHONPATH": str(ROOT / "operator") + os.pathsep + env.get("PYTHONPATH", "")}
        self.log_path = log_path
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "kubetrain", "operator", "run", *self.args],
                                     env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        log.close()

    def kill(self) -> None:
        """SIGKILL: no clean-up handlers run, exactly like an OOM kill or node loss."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(60)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@pytest.fixture
def operator(trainingjob_crd, testbed_env, namespace, tmp_path, request):
    proc = OperatorProcess(testbed_env, namespace, tmp_path / "operator.log")
    proc.start()
    yield proc
    proc.stop()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(f"\n--- operator log tail ---\n{proc.log_tail()}")


@pytest.fixture
def make_operator(trainingjob_crd, testbed_env, namespace, tmp_path):
    """More operators for the test's namespace: make(name, env, args), not started; stopped afterwards."""
    made: list[OperatorProcess] = []

    def make(name: str, env: dict[str, str] | None = None, args: Sequence[str] = ()) -> OperatorProcess:
        proc = OperatorProcess({**testbed_env, **(env or {})}, namespace, tmp_path / f"operator-{name}.log", args)
        made.append(proc)
        return proc

    yield make
    for proc in made:
        proc.stop()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture
def jobs(kube_api, namespace) -> Jobs:
    return Jobs(kube_api, namespace)


@pytest.fixture
def pod_timeline(kube_api, namespace):
    from kubernetes import client, watch

    timeline = PodTimeline()
    stop = threading.Event()
    core = client.CoreV1Api(kube_api)
    ready = threading.Event()

    def run() -> None:
        rv = core.list_namespaced_pod(namespace).metadata.resource_version
        ready.set()
        while not stop.is_set():
            w = watch.Watch()
            try:
                for ev in w.stream(core.list_namespaced_pod, namespace, resource_version=rv, timeout_seconds=2):
                    pod = ev["object"]
                    rv = pod.metadata.resource_version
                    attempt = int((pod.metadata.labels or {}).get("kubetrain.io/attempt", 0))
                    if ev["type"] in ("ADDED", "DELETED") and attempt > 0:
                        timeline.entries.append((ev["type"], pod.metadata.name, attempt))
                    if stop.is_set():
                        break
            except Exception:  # noqa: BLE001  (a broken watch is resumed from the last resourceVersion)
                time.sleep(0.2)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    # The test must not act before the watch's starting point is fixed, or it could miss the first pods.
    assert ready.wait(120), "the pod watch of the namespace did not start"
    yield timeline
    stop.set()
    thread.join(5)
