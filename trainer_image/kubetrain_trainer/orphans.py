"""The processes a worker leaves behind: the launcher's PID 1 duties beyond its own workers.

Each worker runs in its own process group (`launch.Workers.spawn`). A user's command is often a
shell (`sh train.sh`, `bash -c "pip install x && python train.py; echo done"`): the SIGTERM the
launcher forwards ends the shell, and the training process it ran never sees one. It is orphaned
in the worker's group, trains on, and dies with the pod, without its emergency checkpoint, while
the launcher had already reported the worker gone. So once a stopping worker's leader has exited,
the members of its group whose parent is gone (the shell's children, not their DataLoader workers)
get the SIGTERM in its place, and so do, in turn, those of a shell that shell ran (`sh -c "./train.sh;
..."`); the worker counts as stopped only when its group is empty, and a shell the SIGTERM ended as
clean as the processes it left (`Orphans.clean`), where a background helper (`tensorboard & python
train.py`) that the SIGTERM ended does not count against it once the training process exited 83.

As PID 1 (or, anywhere else, as the child subreaper it makes itself) the launcher also adopts
every orphan of the pod and must reap them, or each one stays a zombie holding a PID until the pod
ends. `Orphans.reap` never touches a worker itself, nor a process in the launcher's own group (a
library's subprocess): their `subprocess.Popen` reaps them, and a stolen exit status would read as 0.
"""

from __future__ import annotations

import ctypes
import os
import signal
from dataclasses import dataclass
from typing import Collection

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Adopt the orphans of this process's descendants (as PID 1 does anyway); False where Linux refuses."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgrp: int
    state: str


def parse_stat(text: str) -> Proc | None:
    """`/proc/<pid>/stat` parsed (its command name may hold spaces and parentheses); None when unreadable."""
    head, sep, tail = text.rpartition(")")
    fields = tail.split()
    if not sep or len(fields) < 3:
        return None
    try:
        return Proc(pid=int(head.split("(", 1)[0]), state=fields[0], ppid=int(fields[1]), pgrp=int(fields[2]))
    except ValueError:
        return None


def processes(proc: str = "/proc") -> list[Proc]:
    """Every process this one can see (none where there is no /proc)."""
    found = []
    try:
        names = os.listdir(proc)
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat") as f:
                parsed = parse_stat(f.read())
        except OSError:  # it exited meanwhile
            continue
        if parsed is not None:
            found.append(parsed)
    return found


def _group(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            parsed = parse_stat(f.read())
    except OSError:
        return None
    return parsed.pgrp if parsed is not None else None


def pipe_of(pid: int, fd: int) -> str | None:
    """The pipe file descriptor `fd` of process `pid` is ("pipe:[inode]"), or None (not a pipe, gone)."""
    try:
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    return link if link.startswith("pipe:") else None


class Orphans:
    """The adopted processes of the launcher whose workers are `workers` (their pids)."""

    def __init__(self, workers: Collection[int], *, list_processes=processes, pipe=pipe_of) -> None:
        self.workers = frozenset(workers)
        self.codes: dict[int, int] = {}
        """Exit codes of the adopted processes reaped so far (`Popen.returncode`'s convention)."""
        self.left: dict[int, list[int]] = {}
        """pid -> the processes it left running when it exited, which got the signal in its place."""
        self._parents: dict[int, int] = {}
        """pid -> its parent in its group when last seen (whom it was left by, once that one exited)."""
        self._list = list_processes
        self._pipe = pipe

    def reap(self) -> None:
        """Collect every adopted process that has exited, never a worker."""
        while True:
            try:
                found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if found is None or found.si_pid in self.workers:
                return  # the worker's Popen collects it (then the next call sees past it)
            if _group(found.si_pid) == os.getpgrp():
                return  # the launcher's own (a library's subprocess, in its group): its owner collects it
            try:
                pid, status = os.waitpid(found.si_pid, os.WNOHANG)
            except ChildProcessError:
                continue
            if not pid:  # not collectable after all (waitid said it was): try again at the next poll, never spin
                return
            self.codes[found.si_pid] = os.waitstatus_to_exitcode(status)

    def groups(self) -> dict[int, list[Proc]]:
        """Process group -> its processes that still run (a zombie no longer does): one look at /proc."""
        found: dict[int, list[Proc]] = {}
        for p in self._list():
            if p.state != "Z":
                found.setdefault(p.pgrp, []).append(p)
        return found

    def live(self, group: int) -> list[Proc]:
        """The processes of process group `group` that still run."""
        return self.groups().get(group, [])

    def hand_over(self, group: int, live: list[Proc] | None = None, sig: int = signal.SIGTERM) -> tuple[int, ...]:
        """Send `sig` to the members of `group` (its leader exited) whose parent is not in it and that did not
        get it yet: its leader's children, then those of one of them that exits in turn (a shell's shell),
        never their own children (DataLoader workers); their pids. `live`: the group's processes (`groups`).
        One reading a pipe that another of them writes (`train.py | tee log`) gets it once nothing does: it
        ends at the end of its input, and ended first it breaks the writer's output (its emergency save's)."""
        live = self.live(group) if live is None else live
        inside = {p.pid for p in live}
        handed = {pid for pids in self.left.values() for pid in pids}
        tops = tuple(p.pid for p in live if p.ppid not in inside and p.pid not in handed)
        if tops:
            reads = {pid: self._pipe(pid, 0) for pid in tops}
            written = {self._pipe(p.pid, fd) for p in live for fd in (1, 2)} if any(reads.values()) else set()
            tops = tuple(pid for pid in tops if reads[pid] is None or reads[pid] not in written)
        for pid in tops:
            # Its parent when last seen; none seen (the leader's own children): the leader's.
            self.left.setdefault(self._parents.pop(pid, group), []).append(pid)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        self._parents.update((p.pid, p.ppid) for p in live if p.ppid in inside)
        return tops

    def clean(self, pid: int, code: int | None, ok: Collection[int], *, saved: int | None = None) -> bool:
        """Whether process `pid`, which exited with `code`, stopped on its own terms: `code` in `ok`, or the
        SIGTERM ended it (a shell) and every process it left stopped so. With `saved` (the code that says "my
        emergency checkpoint is written": 83), a process it left that the handed-over SIGTERM ended and that left
        nothing itself (a background helper: `tensorboard & python train.py`) is no writer cut short, once
        another process it left exited with `saved`; without one, it may have been the writer."""
        if code in ok:
            return True
        left = self.left.get(pid)
        if code != -signal.SIGTERM or not left:
            return False
        own = [c for c in left if self.clean(c, self.codes.get(c), ok, saved=saved)]
        helpers = [c for c in left if c not in own and self.codes.get(c) == -signal.SIGTERM and not self.left.get(c)]
        if len(own) + len(helpers) < len(left):
            return False
        return not helpers or (saved is not None and any(self._saved(c, saved) for c in own))

    def _saved(self, pid: int, saved: int) -> bool:
        """Process `pid` exited with `saved`, or is a shell the SIGTERM ended that left one that did."""
        code = self.codes.get(pid)
        return code == saved or (code == -signal.SIGTERM and any(self._saved(c, saved) for c in self.left.get(pid, ())))
