"""Bringing the whole testbed up, down, and reporting on it.

`up` is idempotent: a healthy testbed recorded in the state file is reused as
it is (the warm path), a half-dead one is stopped and started afresh. Every
wait is bounded; on any failure everything started so far is stopped and the
error names the component and shows its log tail. A file lock serialises
concurrent `up`/`down` calls from several shells or pytest sessions.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from . import procs, realnode, sts
from .components import Ports, build_components, component_kubeconfig, write_kubeconfig
from .config import TestbedConfig
from .kueue_run import _ensure_kueue
from .nodes import pool_nodes
from .pki import ensure_pki
from .procs import Running, TestbedError
from .realnode_config import MINIO_POD_PORT, RealNodeLayout
from .stages import STAGES_YAML
from .state import (
    STATE_FORMAT, TestbedEnv, _api, _free_ports, _locked, _read_state, _running, _write_env_file, _write_state,
    is_healthy, load_env,
)


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


def _create_bucket(env: TestbedEnv) -> None:
    import boto3  # the S3 client is only needed here; keep `down`/`status` import-light

    s3 = boto3.client(
        "s3", endpoint_url=env.s3_endpoint, aws_access_key_id=env.access_key,
        aws_secret_access_key=env.secret_key, region_name=env.region,
    )  # fmt: skip
    s3.create_bucket(Bucket=env.bucket)


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


