"""Local processes standing in for containers: start, watch, signal, and sweep orphans.

A container is one process group (``start_new_session``): signals go to the
whole group, so a launcher and the workers it forked stop together, as a
container's cgroup would. Every process carries ``KUBETRAIN_AGENT_NODE`` in its
environment; children inherit it, so after a crash of the agent the next
start can find and kill what the previous one left behind (by that marker and
by the process groups recorded on disk), never anything else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .agent_pod import AGENT_MARKER_ENV, ContainerPlan, Materialized
from .agent_status import exit_code_of

LOG_TAIL_BYTES = 2048


@dataclass
class ContainerProcess:
    """One running (or finished) container process."""

    plan: ContainerPlan
    popen: subprocess.Popen
    started: float

    @classmethod
    def start(cls, plan: ContainerPlan) -> "ContainerProcess":
        plan.log_path.parent.mkdir(parents=True, exist_ok=True)
        plan.termination_log.write_text("")
        with open(plan.log_path, "ab") as log:
            popen = subprocess.Popen(
                list(plan.argv),
                env=plan.env,
                cwd=plan.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        (plan.log_path.parent / f"{plan.name}.pgid").write_text(str(popen.pid))
        return cls(plan=plan, popen=popen, started=time.monotonic())

    @property
    def pgid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        """The container's exit code once its main process ended (the rest of its group is then killed)."""
        rc = self.popen.poll()
        if rc is None:
            return None
        self.signal(signal.SIGKILL)  # leftovers of the group, as a runtime tears down the cgroup
        return exit_code_of(rc)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def termination_file_text(self) -> str:
        try:
            return self.plan.termination_log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self) -> str:
        try:
            with open(self.plan.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""


def write_files(files: tuple[Materialized, ...], dirs: tuple[Path, ...]) -> None:
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    for f in files:
        f.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.path.with_name(f".{f.path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if f.secret else 0o644)
        with os.fdopen(fd, "wb") as out:
            out.write(f.content)
        os.replace(tmp, f.path)


def _marked_pids(node_name: str) -> list[int]:
    """Processes of this user whose environment carries this agent's marker."""
    marker = f"{AGENT_MARKER_ENV}={node_name}".encode()
    me = os.getpid()
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def sweep_orphans(node_name: str, state_dir: Path) -> int:
    """SIGKILL every process a previous agent of this node left behind; returns how many were found."""
    pids = set(_marked_pids(node_name))
    groups = set()
    for pgid_file in state_dir.glob("pods/*/*.pgid"):
        try:
            pgid = int(pgid_file.read_text().strip())
        except ValueError:
            continue
        try:
            with open(f"/proc/{pgid}/environ", "rb") as f:
                if f"{AGENT_MARKER_ENV}={node_name}".encode() in f.read().split(b"\0"):
                    groups.add(pgid)
        except OSError:
            pass
        pgid_file.unlink(missing_ok=True)
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return len(pids | groups)


def wait_gone(node_name: str, timeout: float) -> list[int]:
    """Wait until no marked process is left; returns the survivors (empty on success)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in _marked_pids(node_name) if not _is_zombie(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
