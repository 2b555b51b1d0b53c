"""Starting, probing and stopping the testbed's server processes.

Each server runs in its own session (process group) so that it outlives the
`up` command that started it and so that `down` can signal the whole group.
Probes are bounded: a component that does not become healthy in time, or that
exits, raises `ComponentFailed` carrying the tail of its log.
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .components import Component, Health
from .pki import Pki


class TestbedError(RuntimeError):
    """The testbed could not be brought to the requested state."""

    __test__ = False


class ComponentFailed(TestbedError):
    """One component did not start or did not become healthy; names it, shows its log."""

    def __init__(self, component: str, reason: str, log_file: Path) -> None:
        self.component = component
        self.log_tail = tail(log_file)
        super().__init__(f"{component} {reason}; last lines of {log_file}:\n{self.log_tail}")


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class Running:
    """A started server: what `down` and `status` need to find it again."""

    name: str
    pid: int
    exe: str
    """argv[0]: a pid is only ours while its command line still starts with it."""
    health: Health

    def for_storage(self) -> dict[str, object]:
        health = {"url": self.health.url, "tls": self.health.tls}
        return {"name": self.name, "pid": self.pid, "exe": self.exe, "health": health}

    @classmethod
    def from_storage(cls, raw: dict) -> "Running":
        return cls(name=raw["name"], pid=int(raw["pid"]), exe=raw["exe"], health=Health(**raw["health"]))

    def is_alive(self) -> bool:
        """Alive and still the process we started (pids get reused)."""
        if not alive(self.pid):
            return False
        try:
            argv = Path(f"/proc/{self.pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            return False
        # Empty while the kernel is still inside execve(): ours, not yet labelled.
        # A script runs as "<interpreter> <script>": its path is argv[1].
        return argv[0] == "" or self.exe in argv[:2]


def start(component: Component, log_file: Path) -> Running:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **component.env}
    with open(log_file, "ab") as log:
        try:
            proc = subprocess.Popen(
                component.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            raise ComponentFailed(component.name, f"could not be executed ({exc})", log_file) from exc
    return Running(name=component.name, pid=proc.pid, exe=component.argv[0], health=component.health)


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def ssl_context(mode: str, pki: Pki | None) -> ssl.SSLContext | None:
    if mode == "none":
        return None
    if mode == "insecure":
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    if pki is None:
        raise ValueError("health mode 'admin' needs the testbed's Pki")
    ctx = ssl.create_default_context(cafile=str(pki.ca_crt))
    ctx.load_cert_chain(str(pki.crt("admin")), str(pki.key("admin")))
    return ctx


def probe(health: Health, pki: Pki | None, timeout: float = 2.0) -> tuple[bool, str]:
    """One health request: (healthy, short detail)."""
    try:
        ctx = ssl_context(health.tls, pki)
        with urllib.request.urlopen(health.url, timeout=timeout, context=ctx) as resp:
            return resp.status == 200, f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except (OSError, ssl.SSLError) as exc:
        return False, type(exc).__name__


def wait_healthy(running: list[Running], *, pki: Pki | None, timeout: float, log_dir: Path) -> None:
    """Wait until every process answers its health probe, or raise for the first that cannot."""
    deadline = time.monotonic() + timeout
    pending = list(running)
    last: dict[str, str] = {}
    while pending:
        for r in list(pending):
            if not r.is_alive():
                raise ComponentFailed(r.name, "exited during start-up", log_dir / f"{r.name}.log")
            ok, detail = probe(r.health, pki)
            last[r.name] = detail
            if ok:
                pending.remove(r)
        if not pending:
            return
        if time.monotonic() > deadline:
            r = pending[0]
            raise ComponentFailed(
                r.name, f"not healthy after {timeout:.0f} s (last probe: {last.get(r.name)})", log_dir / f"{r.name}.log"
            )
        time.sleep(0.25)


def stop(pids: list[int], *, grace: float = 10.0) -> list[int]:
    """SIGTERM each process group, SIGKILL what remains after `grace`; return pids still alive."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            if alive(pid):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass
                except PermissionError:
                    os.kill(pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.1)
        if not any(alive(p) for p in pids):
            return []
    return [p for p in pids if alive(p)]
