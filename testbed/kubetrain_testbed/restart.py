"""Stopping one server of a running testbed and starting it again, as a fault.

The chaos benchmark (benchmarks/chaos.py) restarts MinIO and takes it away for
a while (an S3 outage). A component started again gets the same arguments,
ports, data folder and credentials `up` gave it, and the state file records
its new pid, so `down` and `status` keep finding it. Nothing here is used by
`up`/`down` themselves.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from . import procs
from .state import _locked, _read_state, _running, _write_state, load_env
from .components import Component, Ports, build_components
from .config import TestbedConfig
from .pki import Pki
from .procs import Running, TestbedError


def _component(cfg: TestbedConfig, name: str) -> Component:
    state = _read_state(cfg)
    if not state or "ports" not in state:
        raise TestbedError(f"no testbed recorded in {cfg.state_file}; run `scripts/testbed.sh up`")
    env = load_env(cfg)
    components = build_components(cfg=cfg, bin_dir=Path(env.bin_dir), pki=Pki(cfg.pki_dir),
                                  ports=Ports.from_dict(state["ports"]), minio_user=env.access_key,
                                  minio_password=env.secret_key)
    by_name = {c.name: c for c in components}
    if name not in by_name:
        raise TestbedError(f"component {name!r} is not part of the testbed; known: {', '.join(by_name)}")
    return by_name[name]


def stop_component(cfg: TestbedConfig, name: str, *, kill: bool = False, grace: float = 10.0) -> bool:
    """Stop the recorded process group of `name`: SIGTERM, SIGKILL after `grace` (`kill`: SIGKILL at once,
    a crash). False when it was not running."""
    _component(cfg, name)  # an unknown name is refused before anything is signalled
    pids = [r.pid for r in _running(_read_state(cfg)) if r.name == name and r.is_alive()]
    if not pids:
        return False
    if kill:
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        grace = 0.0
    left = procs.stop(pids, grace=grace)
    if left:
        raise TestbedError(f"{name} (pid {left}) survived SIGKILL")
    return True


def start_component(cfg: TestbedConfig, name: str, *, timeout: float = 60.0) -> Running:
    """Start `name` again with the arguments `up` gave it, wait until healthy, record its new pid."""
    component = _component(cfg, name)
    with _locked(cfg):
        state = _read_state(cfg) or {}
        if any(r.name == name and r.is_alive() for r in _running(state)):
            raise TestbedError(f"{name} is already running")
        started = procs.start(component, cfg.log_file(name))
        state["processes"] = [*(p for p in state.get("processes", []) if p.get("name") != name),
                              started.for_storage()]
        _write_state(cfg, state)
    procs.wait_healthy([started], pki=Pki(cfg.pki_dir), timeout=timeout, log_dir=cfg.run_dir)
    return started
