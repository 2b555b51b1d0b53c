"""Fixtures of the e2e tier: the test node agent on top of the shared testbed.

The agent (`python -m kubetrain_testbed.agent`) is a real subprocess that
registers a Node and runs pods' commands as local processes. Its node is
tainted ``kubetrain.io/agent=true:NoSchedule`` so that pods of other tiers,
which expect kwok to fake them, never land on it by accident; e2e pods carry
the matching toleration and nodeSelector (`AGENT_PLACEMENT`).

Fixtures:
  agent_factory  start(node_name=...) -> AgentProc; every started agent is stopped afterwards
  agent          one session-wide agent node, "kubetrain-e2e-agent"
  core           kubernetes.client.CoreV1Api as the testbed admin
"""

from __future__ import annotations

import os
import dataclasses
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from .helpers import AGENT_LABEL, AGENT_TAINT, marked_pids, wait_for

_REPO = Path(__file__).resolve().parents[2]


@dataclass
class AgentProc:
    node_name: str
    state_dir: Path
    log_path: Path
    popen: subprocess.Popen

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no agent log)"

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (graceful node shutdown) and wait for the agent to exit."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
                raise AssertionError(f"agent {self.node_name} ignored SIGTERM for {timeout}s:\n{self.log_tail()}")
        return self.popen.returncode

    def crash(self) -> None:
        """SIGKILL: the agent gets no chance to clean up (its children survive it)."""
        self.popen.kill()
        self.popen.wait()


@pytest.fixture(scope="session")
def core(kube_api):
    from kubernetes import client

    return client.CoreV1Api(kube_api)


@pytest.fixture(scope="session")
def agent_factory(testbed, testbed_env, core, tmp_path_factory):
    started: list[AgentProc] = []

    def start(node_name: str, *, state_dir: Path | None = None, extra: tuple[str, ...] = ()) -> AgentProc:
        state_dir = state_dir or tmp_path_factory.mktemp(node_name)
        log_path = state_dir / "agent.log"
        log_file = open(log_path, "ab")
        cmd = [
            sys.executable, "-m", "kubetrain_testbed.agent",
            "--kubeconfig", str(testbed.kubeconfig),
            "--node-name", node_name,
            "--state-dir", str(state_dir),
            "--taint", f"{AGENT_TAINT}:NoSchedule",
            "--delete-node-on-exit",
            "--shutdown-grace", "10",
            *extra,
        ]
        env = dict(testbed_env)
        env["PYTHONPATH"] = os.pathsep.join([str(_REPO / "testbed"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        popen = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=_REPO)
        proc = AgentProc(node_name=node_name, state_dir=state_dir, log_path=log_path, popen=popen)
        started.append(proc)

        def ready():
            if popen.poll() is not None:
                raise AssertionError(f"agent exited with {popen.returncode}:\n{proc.log_tail()}")
            node = core.read_node(node_name)
            conds = {c.type: c.status for c in node.status.conditions or []}
            return conds.get("Ready") == "True" and node.metadata.labels.get(AGENT_LABEL) == "true"

        wait_for(ready, timeout=120, what=f"node {node_name} Ready", ignore=(Exception,), on_timeout=proc.log_tail)
        return proc

    yield start
    problems = []
    for proc in started:
        proc.stop() if proc.popen.poll() is None else None
        left = marked_pids(proc.node_name)
        if left:
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            problems.append(f"agent {proc.node_name} left processes behind: {left}")
    assert not problems, problems


@pytest.fixture(scope="session")
def agent(agent_factory) -> AgentProc:
    proc = agent_factory("kubetrain-e2e-agent")
    yield proc
    # Graceful exit must leave nothing behind (checked by agent_factory too).
    assert proc.stop() == 0, proc.log_tail()
    deadline = time.monotonic() + 30
    while marked_pids(proc.node_name) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not marked_pids(proc.node_name), f"orphans after agent exit:\n{proc.log_tail()}"


# The real node and the images pushed to its registry: defined here, once, so every module shares one
# instance per session (a session fixture imported into two test modules is two fixtures: the node was
# started by one, removed by the other's teardown, and the first then found nothing to remove).
@pytest.fixture(scope="session")
def real_node(testbed, testbed_config):
    """The shared testbed with the real node added (kept until the testbed goes down)."""
    from kubetrain_testbed import TestbedError, load_env, up
    from kubetrain_testbed.realnode import missing_prerequisites

    missing = missing_prerequisites()
    if missing:
        pytest.skip(f"the real node needs {', '.join(missing)} (scripts/test.sh installs them)")
    from kubetrain_testbed.cluster import remove_real_node
    from kubetrain_testbed.realnode import HOST_SETTINGS, leftovers

    settings = {k: Path("/proc/sys", k).read_text() for k in HOST_SETTINGS}
    try:
        up(dataclasses.replace(testbed_config, real_node=True))
    except TestbedError as exc:
        pytest.fail(f"the real node could not start: {exc}", pytrace=False)
    env = load_env(testbed_config)
    assert env.registry and env.pod_s3_endpoint, env
    yield env
    # Removing the node (the code `scripts/testbed.sh down` runs) leaves no container, network
    # namespace, mount, cgroup, rule or bridge behind, and the host's settings as they were.
    layout = remove_real_node(testbed_config)
    assert layout is not None
    assert leftovers(layout) == []
    assert {k: Path("/proc/sys", k).read_text() for k in HOST_SETTINGS} == settings
    assert not list(layout.state.glob("containerd/**/rootfs/*")), "a container's root file system is still there"


@pytest.fixture(scope="session")
def images(real_node):
    """Both images, built from the Dockerfiles (cached layers) and pushed to the registry: name -> ref."""
    from kubetrain_testbed.cluster import _real_node_layout
    from kubetrain_testbed.images import IMAGES, build_all
    from kubetrain_testbed.realnode import real_node_bin_dir

    from kubetrain_testbed import TestbedConfig

    cfg = TestbedConfig.from_environ()
    layout = _real_node_layout(cfg, real_node_bin_dir(cfg.build_script))
    rows = build_all(layout, log_path=cfg.run_dir / "images.log")
    assert {r["image"] for r in rows} == {i.name for i in IMAGES}
    return {r["image"]: r["ref"] for r in rows}
