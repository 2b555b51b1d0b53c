"""The running testbed's record: its state file, how clients reach it, and its health.

The state file (0600: it holds the S3 credentials) lists every process the
testbed started, its ports and, once complete, the `TestbedEnv` that
`.testbed/env` exports. Starting and stopping (cluster.py, kueue_run.py,
restart.py) hold the file lock (`_locked`) while they change it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import socket
import subprocess
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from . import procs
from .config import TestbedConfig
from .pki import Pki
from .procs import Running, TestbedError


@dataclass(frozen=True)
class TestbedEnv:
    """How clients reach a running testbed; `as_environ()` is what `.testbed/env` exports."""

    __test__ = False

    kubeconfig: str
    api_server: str
    s3_endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    bin_dir: str
    ca_file: str
    """The cluster CA (PEM), for clients that authenticate with a ServiceAccount token."""
    region: str = "us-east-1"
    registry: str = ""
    """The real node's image registry (host:port, plain HTTP); empty without the real node."""
    pod_s3_endpoint: str = ""
    """MinIO as pods on the real node reach it; empty without the real node."""

    def as_environ(self) -> dict[str, str]:
        return {
            "KUBECONFIG": self.kubeconfig,
            "AWS_ENDPOINT_URL": self.s3_endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "KUBETRAIN_TEST_BUCKET": self.bucket,
            "KUBETRAIN_TESTBED_BIN": self.bin_dir,
            "KUBETRAIN_TESTBED_API_SERVER": self.api_server,
            "KUBETRAIN_TESTBED_CA_FILE": self.ca_file,
            **({"KUBETRAIN_TESTBED_REGISTRY": self.registry,
                "KUBETRAIN_TESTBED_POD_S3_ENDPOINT": self.pod_s3_endpoint} if self.registry else {}),
        }

    def subprocess_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default: os.environ) plus the testbed's variables and its bin folder first on PATH."""
        env = dict(os.environ if base is None else base)
        env.update(self.as_environ())
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    pid: int
    alive: bool
    healthy: bool
    detail: str


@contextmanager
def _locked(cfg: TestbedConfig) -> Iterator[None]:
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    with open(cfg.lock_file, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return _free_ports(1)[0]


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _read_state(cfg: TestbedConfig) -> dict | None:
    try:
        return json.loads(cfg.state_file.read_text())
    except (OSError, ValueError):
        return None


def _write_state(cfg: TestbedConfig, state: dict) -> None:
    tmp = cfg.state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.chmod(0o600)  # it records the S3 credentials
    tmp.replace(cfg.state_file)


def _running(state: dict | None) -> list[Running]:
    return [Running.from_storage(r) for r in (state or {}).get("processes", [])]


def load_env(cfg: TestbedConfig) -> TestbedEnv:
    state = _read_state(cfg)
    if not state or "env" not in state:
        raise TestbedError(f"no testbed recorded in {cfg.state_file}; run `scripts/testbed.sh up`")
    return TestbedEnv(**state["env"])


def kubectl(env: TestbedEnv, *args: str, input: str | None = None, timeout: float = 60.0) -> str:
    """Run the testbed's kubectl as admin; raise TestbedError with its stderr on failure."""
    argv = [str(Path(env.bin_dir) / "kubectl"), f"--kubeconfig={env.kubeconfig}", *args]
    proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise TestbedError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def status(cfg: TestbedConfig) -> list[ComponentStatus]:
    pki = Pki(cfg.pki_dir) if cfg.pki_dir.exists() else None
    out = []
    for r in _running(_read_state(cfg)):
        is_alive = r.is_alive()
        healthy, detail = procs.probe(r.health, pki) if is_alive else (False, "not running")
        out.append(ComponentStatus(name=r.name, pid=r.pid, alive=is_alive, healthy=healthy, detail=detail))
    return out


STATE_FORMAT = 2
"""Bumped when a running testbed of an older checkout lacks something tests need (2: MinIO's STS)."""


def is_healthy(cfg: TestbedConfig) -> bool:
    """A completely started testbed of this format whose every process answers its health probe."""
    state = _read_state(cfg)
    if not state or not state.get("complete") or state.get("format") != STATE_FORMAT:
        return False
    st = status(cfg)
    return bool(st) and all(s.healthy for s in st)


def _api(env: TestbedEnv, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """One request to the API server as admin, without kubectl's discovery round-trips."""
    pki = Pki(Path(env.ca_file).parent)
    req = urllib.request.Request(
        env.api_server + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10, context=procs.ssl_context("admin", pki)) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _write_env_file(cfg: TestbedConfig, env: TestbedEnv) -> None:
    lines = ["# Written by `scripts/testbed.sh up`; holds credentials: keep it out of logs."]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.as_environ().items()]
    lines.append('export PATH="$KUBETRAIN_TESTBED_BIN:$PATH"')
    cfg.env_file.write_text("\n".join(lines) + "\n")
    cfg.env_file.chmod(0o600)
