"""Bringing the whole testbed up, down, and reporting on it.

`up` is idempotent: a healthy testbed recorded in the state file is reused as
it is (the warm path), a half-dead one is stopped and started afresh. Every
wait is bounded; on any failure everything started so far is stopped and the
error names the component and shows its log tail. A file lock serialises
concurrent `up`/`down` calls from several shells or pytest sessions.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from . import kueue, procs, realnode, sts
from .components import Ports, build_components, component_kubeconfig, write_kubeconfig
from .config import KueueSettings, TestbedConfig
from .nodes import pool_nodes
from .pki import Pki, ensure_pki
from .procs import Running, TestbedError
from .realnode_config import MINIO_POD_PORT, RealNodeLayout
from .stages import STAGES_YAML


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


def down(cfg: TestbedConfig) -> list[str]:
    """Stop every recorded process; return the names of any that survived (normally none)."""
    with _locked(cfg):
        return _down_unlocked(cfg)


def _down_unlocked(cfg: TestbedConfig) -> list[str]:
    state = _read_state(cfg)
    running = [r for r in _running(state) if r.is_alive()]
    node = (state or {}).get("real_node")
    if node:
        # The kubelet goes first (it would restart containers), then the containers, while containerd runs.
        layout = _real_node_layout(cfg, Path(node["bin_dir"]))
        procs.stop([r.pid for r in running if r.name == "kubelet"])
        realnode.remove_containers(layout)
    # Reverse start order: clients before the API server, the API server before etcd.
    survivors = procs.stop([r.pid for r in reversed(running)])
    if node:
        realnode.teardown(layout)
    for stale in (cfg.state_file, cfg.env_file):
        stale.unlink(missing_ok=True)
    return [r.name for r in running if r.pid in survivors]


def _real_node_layout(cfg: TestbedConfig, bin_dir: Path) -> RealNodeLayout:
    return RealNodeLayout(state=cfg.state_dir / "realnode", bin_dir=bin_dir)


def _start_real_node(cfg: TestbedConfig, env: TestbedEnv, say) -> None:
    """Add the real node to the running control plane recorded in the state file."""
    state = _read_state(cfg) or {}
    bin_dir = realnode.ensure_binaries(cfg.build_script)
    layout = _real_node_layout(cfg, bin_dir)
    node_names = {c.name for c in realnode.components(layout, admin_kubeconfig=Path(env.kubeconfig))}
    leftover = [r for r in _running(state) if r.name in node_names]  # of a half-started node
    procs.stop([r.pid for r in leftover if r.is_alive()])
    base = [r for r in _running(state) if r.name not in node_names]

    def record(started: list[Running]) -> None:
        state["processes"] = [r.for_storage() for r in [*base, *started]]
        state["real_node"] = {"bin_dir": str(bin_dir), "complete": False}
        _write_state(cfg, state)

    try:
        realnode.start(layout, admin_kubeconfig=Path(env.kubeconfig),
                       kubectl=[str(Path(env.bin_dir) / "kubectl"), f"--kubeconfig={env.kubeconfig}"],
                       api_port=int(state["ports"]["apiserver"]), minio_port=int(state["ports"]["minio"]),
                       run_dir=cfg.run_dir, record=record, say=say)
    except BaseException:
        _undo_real_node(cfg, state, layout, node_names)  # the control plane (and whoever uses it) stays
        raise
    env = TestbedEnv(**{**asdict(env), "registry": layout.registry,
                        "pod_s3_endpoint": f"http://{layout.gateway}:{MINIO_POD_PORT}"})
    state["env"] = asdict(env)
    state["real_node"]["complete"] = True
    _write_state(cfg, state)
    _write_env_file(cfg, env)


def _undo_real_node(cfg: TestbedConfig, state: dict, layout: RealNodeLayout, node_names: set[str]) -> None:
    """Stop and remove the real node alone, the way `down` would; the state keeps the control plane."""
    started = [r for r in _running(state) if r.name in node_names and r.is_alive()]
    procs.stop([r.pid for r in started if r.name == "kubelet"])
    realnode.remove_containers(layout)
    procs.stop([r.pid for r in reversed(started)])
    realnode.teardown(layout)
    state["processes"] = [r.for_storage() for r in _running(state) if r.name not in node_names]
    state.pop("real_node", None)
    if "env" in state:
        state["env"] = {**state["env"], "registry": "", "pod_s3_endpoint": ""}
    _write_state(cfg, state)


def remove_real_node(cfg: TestbedConfig) -> RealNodeLayout | None:
    """Remove the real node from the running testbed (the control plane stays); its layout, or None."""
    with _locked(cfg):
        state = _read_state(cfg) or {}
        node = state.get("real_node")
        if not node:
            return None
        layout = _real_node_layout(cfg, Path(node["bin_dir"]))
        node_names = {c.name for c in realnode.components(layout, admin_kubeconfig=cfg.kubeconfig)}
        _undo_real_node(cfg, state, layout, node_names)
        if "env" in state:
            _write_env_file(cfg, TestbedEnv(**state["env"]))
        return layout


def ensure_binaries(cfg: TestbedConfig) -> Path:
    """Run build.sh (builds only what is missing; its progress goes to stderr).

    Kueue is built only when this testbed runs it (`up --kueue`): a plain `up` never compiles it.
    """
    env = {**os.environ, "TESTBED_WARM_KUEUE": "0"}
    proc = subprocess.run(["bash", str(cfg.build_script)], stdout=subprocess.PIPE, text=True, env=env)
    if proc.returncode != 0:
        raise TestbedError(f"{cfg.build_script} failed (exit {proc.returncode}); its output is above")
    return Path(proc.stdout.strip().splitlines()[-1])


def up(cfg: TestbedConfig, *, log=None) -> TestbedEnv:
    """Start the testbed, or reuse the healthy one already running; return how to reach it."""
    say = log or (lambda msg: print(f"[testbed] {msg}", file=sys.stderr))
    with _locked(cfg):
        if is_healthy(cfg):
            if not cfg.real_node or ((_read_state(cfg) or {}).get("real_node") or {}).get("complete"):
                say("reusing the running testbed")
            else:
                # Add the real node to the running control plane (a failure undoes the node alone).
                _start_real_node(cfg, load_env(cfg), say)
            if cfg.kueue:
                _ensure_kueue(cfg, load_env(cfg), cfg.kueue_settings, say)
            return load_env(cfg)
        if _read_state(cfg):
            say("a previous testbed is not healthy; stopping it")
            _down_unlocked(cfg)
        bin_dir = ensure_binaries(cfg)
        t0 = time.monotonic()
        try:
            env = _start(cfg, bin_dir, say)
            if cfg.real_node:
                _start_real_node(cfg, env, say)
                env = load_env(cfg)
            if cfg.kueue:
                _ensure_kueue(cfg, env, cfg.kueue_settings, say)
        except BaseException:
            _down_unlocked(cfg)
            raise
        say(f"all healthy in {time.monotonic() - t0:.1f} s; `source {cfg.env_file}`")
        return env


def _start(cfg: TestbedConfig, bin_dir: Path, say) -> TestbedEnv:
    if cfg.run_dir.exists():
        shutil.rmtree(cfg.run_dir)
    cfg.run_dir.mkdir(parents=True)
    pki = ensure_pki(cfg.pki_dir)
    names = [f.name for f in Ports.__dataclass_fields__.values()]
    ports = Ports(**dict(zip(names, _free_ports(len(names)))))
    api = f"https://127.0.0.1:{ports.apiserver}"
    write_kubeconfig(cfg.kubeconfig, server=api, pki=pki, identity="admin")
    for ident in ("kube-controller-manager", "kube-scheduler"):
        write_kubeconfig(component_kubeconfig(cfg, ident), server=api, pki=pki, identity=ident)
    (cfg.run_dir / "kwok-stages.yaml").write_text(STAGES_YAML)
    user, password = "testbed-" + secrets.token_hex(4), secrets.token_urlsafe(24)
    components = build_components(
        cfg=cfg, bin_dir=bin_dir, pki=pki, ports=ports, minio_user=user, minio_password=password
    )
    env = TestbedEnv(
        kubeconfig=str(cfg.kubeconfig), api_server=api, s3_endpoint=f"http://127.0.0.1:{ports.minio}",
        access_key=user, secret_key=password, bucket=cfg.bucket, bin_dir=str(bin_dir), ca_file=str(pki.ca_crt),
    )  # fmt: skip
    state: dict = {"ports": asdict(ports), "processes": [], "env": asdict(env), "complete": False,
                   "format": STATE_FORMAT}
    _write_state(cfg, state)
    t = cfg.timeouts
    started: dict[str, Running] = {}

    def launch(wave: int) -> list[Running]:
        new = [procs.start(c, cfg.log_file(c.name)) for c in components if c.wave == wave]
        started.update({r.name: r for r in new})
        state["processes"] = [r.for_storage() for r in started.values()]
        _write_state(cfg, state)
        return new

    t0 = time.monotonic()
    launch(0)
    procs.wait_healthy([started["etcd"]], pki=pki, timeout=t.etcd, log_dir=cfg.run_dir)
    launch(1)
    procs.wait_healthy([started["kube-apiserver"]], pki=pki, timeout=t.apiserver, log_dir=cfg.run_dir)
    say(f"kube-apiserver ready after {time.monotonic() - t0:.1f} s")
    # MinIO's STS reads the issuer discovery document anonymously when it starts (sts.py).
    _allow_anonymous_discovery(env)
    sts.minio_certs_dir(cfg.run_dir, pki.ca_crt)
    wave2 = launch(2)
    # While the controllers start: register the fake nodes, make the bucket and the STS roles' policies.
    nodes = _apply_nodes(cfg, env)
    procs.wait_healthy([started["minio"]], pki=pki, timeout=t.minio, log_dir=cfg.run_dir)
    _create_bucket(env)
    sts.create_policies(endpoint=env.s3_endpoint, access_key=env.access_key, secret_key=env.secret_key,
                        region=env.region, bucket=env.bucket)
    procs.wait_healthy([r for r in wave2 if r.name != "minio"], pki=pki, timeout=t.controllers, log_dir=cfg.run_dir)
    say(f"controllers healthy after {time.monotonic() - t0:.1f} s")
    _wait_nodes_ready(cfg, env, nodes)
    _wait_default_service_account(env, timeout=t.controllers, log_dir=cfg.run_dir)
    _write_env_file(cfg, env)
    state["complete"] = True
    _write_state(cfg, state)
    return env


def ensure_kueue(cfg: TestbedConfig, settings: KueueSettings | None = None, *, log=None) -> bool:
    """Run Kueue on the running testbed with these settings (kept when it already does, restarted with
    other settings); builds it first if needed (`build.sh --kueue`). True when this call (re)started it."""
    say = log or (lambda msg: print(f"[testbed] {msg}", file=sys.stderr))
    with _locked(cfg):
        if not is_healthy(cfg):
            raise TestbedError("no healthy testbed is running: start it first (`scripts/testbed.sh up`)")
        return _ensure_kueue(cfg, load_env(cfg), settings or cfg.kueue_settings, say)


def remove_kueue(cfg: TestbedConfig) -> bool:
    """Stop Kueue on the running testbed (its CRDs and objects stay in the API server); False if none ran."""
    with _locked(cfg):
        state = _read_state(cfg) or {}
        ours = [r for r in _running(state) if r.name == kueue.NAME]
        if not ours and not state.get("kueue"):
            return False
        procs.stop([r.pid for r in ours if r.is_alive()])
        state["processes"] = [r.for_storage() for r in _running(state) if r.name != kueue.NAME]
        state.pop("kueue", None)
        _write_state(cfg, state)
        return True


def _ensure_kueue(cfg: TestbedConfig, env: TestbedEnv, settings: KueueSettings, say) -> bool:
    state = _read_state(cfg) or {}
    wanted = asdict(settings)
    running = [r for r in _running(state) if r.name == kueue.NAME]
    recorded = state.get("kueue") or {}
    if running and recorded.get("complete") and recorded.get("settings") == wanted and all(
            procs.probe(r.health, None)[0] for r in running):
        return False
    bin_dir = kueue.ensure_binaries(cfg.build_script)
    procs.stop([r.pid for r in running if r.is_alive()])
    base = [r for r in _running(state) if r.name != kueue.NAME]
    t0 = time.monotonic()
    pki = Pki(cfg.pki_dir)
    health_port, webhook_port = _free_ports(2)
    kubeconfig, config_file = kueue.prepare_files(pki=pki, run_dir=cfg.run_dir, api_server=env.api_server,
                                                  settings=settings, health_port=health_port,
                                                  webhook_port=webhook_port)
    _install_kueue_api(env, bin_dir)
    started = procs.start(kueue.component(bin_dir=bin_dir, kubeconfig=kubeconfig, config_file=config_file,
                                          health_port=health_port), cfg.log_file(kueue.NAME))
    state["processes"] = [r.for_storage() for r in [*base, started]]
    state["kueue"] = {"bin_dir": str(bin_dir), "settings": wanted, "complete": False}
    _write_state(cfg, state)
    try:
        procs.wait_healthy([started], pki=pki, timeout=cfg.timeouts.kueue, log_dir=cfg.run_dir)
    except BaseException:
        procs.stop([started.pid])
        state["processes"] = [r.for_storage() for r in base]
        state.pop("kueue", None)
        _write_state(cfg, state)
        raise
    state["kueue"]["complete"] = True
    _write_state(cfg, state)
    say(f"kueue ready after {time.monotonic() - t0:.1f} s (pods-ready timeout {settings.pods_ready_timeout})")
    return True


def _install_kueue_api(env: TestbedEnv, bin_dir: Path) -> None:
    """Kueue's CRDs (server-side: the Workload CRD is too large for a client-side apply's annotation),
    its namespace, and its RBAC."""
    crds = kueue.crd_dir(bin_dir)
    if not crds.is_dir():
        raise TestbedError(f"{crds} is missing: run `testbed/build.sh --kueue`")
    kubectl(env, "apply", "--server-side", "--force-conflicts", "--field-manager=kubetrain-testbed", "-f", str(crds),
            timeout=180)
    kubectl(env, "wait", "--for=condition=Established", "--timeout=120s", "-f", str(crds), timeout=180)
    code, body = _api(env, "POST", "/api/v1/namespaces", {"metadata": {"name": kueue.NAMESPACE}})
    if code not in (201, 409):
        raise TestbedError(f"creating namespace {kueue.NAMESPACE} failed: HTTP {code} {body.get('message')}")
    objects = {"apiVersion": "v1", "kind": "List", "items": kueue.rbac_objects(*kueue.manager_roles(bin_dir))}
    kubectl(env, "apply", "--server-side", "--force-conflicts", "--field-manager=kubetrain-testbed", "-f", "-",
            input=json.dumps(objects))


def _create_bucket(env: TestbedEnv) -> None:
    import boto3  # the S3 client is only needed here; keep `down`/`status` import-light

    s3 = boto3.client(
        "s3", endpoint_url=env.s3_endpoint, aws_access_key_id=env.access_key,
        aws_secret_access_key=env.secret_key, region_name=env.region,
    )  # fmt: skip
    s3.create_bucket(Bucket=env.bucket)


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


def _allow_anonymous_discovery(env: TestbedEnv) -> None:
    code, body = _api(env, "POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", sts.discovery_binding())
    if code not in (201, 409):
        raise TestbedError(f"allowing anonymous OIDC discovery failed: HTTP {code} {body.get('message')}")


def _apply_nodes(cfg: TestbedConfig, env: TestbedEnv) -> list[str]:
    names = []
    for node in (n for pool in cfg.node_pools for n in pool_nodes(pool)):
        code, body = _api(env, "POST", "/api/v1/nodes", node)
        if code not in (201, 409):
            raise TestbedError(f"creating node {node['metadata']['name']} failed: HTTP {code} {body.get('message')}")
        names.append(node["metadata"]["name"])
    return names


def _node_ready(node: dict) -> bool:
    conds = node.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def _wait_nodes_ready(cfg: TestbedConfig, env: TestbedEnv, nodes: list[str]) -> None:
    deadline = time.monotonic() + cfg.timeouts.nodes_ready
    pending = set(nodes)
    while pending:
        _, body = _api(env, "GET", "/api/v1/nodes?labelSelector=type%3Dkwok")
        pending -= {n["metadata"]["name"] for n in body.get("items", []) if _node_ready(n)}
        if not pending:
            return
        if time.monotonic() > deadline:
            raise procs.ComponentFailed(
                "kwok", f"did not make nodes Ready: {', '.join(sorted(pending))}", cfg.log_file("kwok")
            )
        time.sleep(0.25)


def _wait_default_service_account(env: TestbedEnv, *, timeout: float, log_dir: Path) -> None:
    """The serviceaccount controller works once `default` exists in namespace default."""
    deadline = time.monotonic() + timeout
    while _api(env, "GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] != 200:
        if time.monotonic() > deadline:
            raise procs.ComponentFailed(
                "kube-controller-manager", "created no default ServiceAccount", log_dir / "kube-controller-manager.log"
            )
        time.sleep(0.25)


def _write_env_file(cfg: TestbedConfig, env: TestbedEnv) -> None:
    lines = ["# Written by `scripts/testbed.sh up`; holds credentials: keep it out of logs."]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.as_environ().items()]
    lines.append('export PATH="$KUBETRAIN_TESTBED_BIN:$PATH"')
    cfg.env_file.write_text("\n".join(lines) + "\n")
    cfg.env_file.chmod(0o600)
