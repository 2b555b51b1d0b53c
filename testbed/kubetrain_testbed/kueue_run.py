"""Starting and stopping Kueue on a running testbed (`up --kueue`, the `kueue` fixture).

What Kueue runs with is kueue.py; this module records it in the testbed's
state file next to the other processes, so `down` stops it with them and a
warm `up --kueue` keeps it when its settings are unchanged.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from . import kueue, procs
from .config import KueueSettings, TestbedConfig
from .pki import Pki
from .procs import TestbedError
from .state import (
    TestbedEnv, _api, _free_ports, _locked, _read_state, _running, _write_state, is_healthy, kubectl, load_env,
)


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
