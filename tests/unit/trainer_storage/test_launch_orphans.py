"""The processes a worker leaves behind (`kubetrain_trainer/orphans.py`): a shell's training process
gets the SIGTERM the shell swallowed, and the launcher, as PID 1, reaps what it adopts.

The fast tests run the module in a child interpreter that makes itself a subreaper (as the launcher
does), so that the orphans come to it and not to this test run. The process tests through the
launcher are marked `slow`, as in test_ckpt_launch.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kubetrain_trainer.contract import EXIT_PREEMPTED
from kubetrain_trainer.orphans import Orphans, Proc, parse_stat

ROOT = Path(__file__).resolve().parents[3]


def test_stat_lines_parse_with_spaces_and_parentheses_in_the_name():
    assert parse_stat("42 (python) S 1 40 40 0 -1") == Proc(pid=42, ppid=1, pgrp=40, state="S")
    assert parse_stat("7 (a b) (c)) Z 3 7 7 0") == Proc(pid=7, ppid=3, pgrp=7, state="Z")
    assert parse_stat("garbage") is None


def test_only_the_exited_leaders_children_get_the_signal(monkeypatch):
    group = [Proc(10, 1, 10, "Z"), Proc(11, 1, 10, "S"), Proc(12, 11, 10, "S"), Proc(13, 1, 99, "S")]
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    orphans = Orphans([10], list_processes=lambda: group)
    assert orphans.hand_over(10) == (11,)  # not its DataLoader worker 12, not another group's 13
    assert sent == [(11, signal.SIGTERM)]
    assert [p.pid for p in orphans.live(10)] == [11, 12]  # the zombie leader no longer runs


REAPER = r"""
import os, subprocess, sys, time
from kubetrain_trainer.orphans import Orphans, become_subreaper, processes
assert become_subreaper()
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=subprocess.DEVNULL)
own = subprocess.Popen(["sh", "-c", "exit 3"])  # a library's subprocess, in the launcher's group
time.sleep(0.5)
Orphans([worker.pid]).reap()
assert own.wait() == 3  # left to its Popen
# A shell that leaves a short-lived background child: it is orphaned, then adopted by this process.
subprocess.run(["sh", "-c", "sleep 0.2 & exit 0"], check=True, process_group=0)  # as a worker is
zombies = lambda: [p.pid for p in processes() if p.ppid == os.getpid() and p.state == "Z"]
deadline = time.monotonic() + 30  # a safety net: the orphan exits after 0.2 s, later on a loaded machine
while not zombies() and time.monotonic() < deadline:
    time.sleep(0.05)
assert len(zombies()) == 1, zombies()
orphans = Orphans([worker.pid])
orphans.reap()
assert zombies() == [] and list(orphans.codes.values()) == [0], (zombies(), orphans.codes)
worker.kill()
assert worker.wait() == -9  # the worker's own exit status stays with its Popen
print("ok")
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")
def test_adopted_orphans_are_reaped_and_workers_left_to_their_popen():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "trainer_image"))
    out = subprocess.run([sys.executable, "-c", REAPER], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


WORKER = r"""
import os, pathlib, signal, sys, time
out = pathlib.Path(os.environ["TEST_OUT"])
def on_term(*_):
    time.sleep(1)  # the emergency checkpoint
    (out / "saved").write_text("x")
    sys.exit(83)
if os.environ["TEST_MODE"] == "trap":
    signal.signal(signal.SIGTERM, on_term)
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
(out / "pid").write_text(str(os.getpid()))
time.sleep(60)
"""


def _launch_in_shell(tmp_path: Path, mode: str, grace: int = 30) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBETRAIN_", "AWS_"))}
    env.update(NNODES="1", NODE_RANK="0", NPROC_PER_NODE="1", KUBETRAIN_METRICS_PORT="0",
               KUBETRAIN_LOCAL_CHECKPOINT_DIR=str(tmp_path / "ckpt"), TEST_OUT=str(tmp_path), TEST_MODE=mode,
               KUBETRAIN_TERMINATION_LOG=str(tmp_path / "termination-log"),
               KUBETRAIN_TERMINATION_GRACE_SECONDS=str(grace))
    (tmp_path / "worker.py").write_text(WORKER)
    # The usual wrapper: the shell forks the training process (it has more to run after it).
    script = f'{sys.executable} {tmp_path / "worker.py"}; echo "training ended"'
    p = subprocess.Popen([sys.executable, "-m", "kubetrain_trainer.launch", "--", "sh", "-c", script],
                         env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "pid").exists():
        assert time.monotonic() < deadline and p.poll() is None, "the worker did not start"
        time.sleep(0.05)
    time.sleep(0.2)
    return p


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")
def test_a_shell_commands_training_process_gets_the_sigterm_and_is_waited_for(tmp_path: Path):
    p = _launch_in_shell(tmp_path, "trap")
    trainer = int((tmp_path / "pid").read_text())
    p.send_signal(signal.SIGTERM)
    try:
        assert p.wait(timeout=60) == EXIT_PREEMPTED, p.stderr.read()
        assert (tmp_path / "saved").exists(), "the training process never got the SIGTERM"
        assert not _running(trainer), "the launcher exited while the training process still ran"
    finally:
        if _running(trainer):
            os.kill(trainer, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")
def test_a_shell_commands_training_process_that_ignores_sigterm_is_killed_in_the_grace_period(tmp_path: Path):
    p = _launch_in_shell(tmp_path, "ignore", grace=15)
    trainer = int((tmp_path / "pid").read_text())
    start = time.monotonic()
    p.send_signal(signal.SIGTERM)
    try:
        assert p.wait(timeout=60) == EXIT_PREEMPTED, p.stderr.read()
        assert time.monotonic() - start < 15
        assert not _running(trainer)
    finally:
        if _running(trainer):
            os.kill(trainer, signal.SIGKILL)


class _Leader:
    def __init__(self, pid: int, returncode: int) -> None:
        self.pid, self.returncode = pid, returncode

    def poll(self) -> int:
        return self.returncode


@pytest.mark.parametrize("trainer_code, clean", [(EXIT_PREEMPTED, True), (0, True), (1, False), (-9, False)])
def test_a_shell_ended_by_the_sigterm_is_as_clean_as_the_training_process_it_left(monkeypatch, trainer_code, clean):
    from kubetrain_trainer.launch import Workers

    monkeypatch.setattr(os, "kill", lambda pid, sig: None)
    workers = Workers([_Leader(10, -signal.SIGTERM)])
    running = [Proc(11, 1, 10, "S")]
    workers.orphans = Orphans([10], list_processes=lambda: running)
    monkeypatch.setattr(workers.orphans, "reap", lambda: None)
    workers.terminate()
    assert not workers.poll()  # the training process the shell left still saves
    running.clear()
    workers.orphans.codes[11] = trainer_code
    assert workers.poll()
    assert workers.exited_cleanly is clean


@pytest.mark.parametrize("trainer_code, clean", [(EXIT_PREEMPTED, True), (1, False)])
def test_a_shell_a_shell_ran_passes_the_sigterm_on_too(monkeypatch, trainer_code, clean):
    """`sh -c "./train.sh; ..."`: the SIGTERM ends the outer shell, the one it hands over ends train.sh's shell.
    Before, the SIGTERM was handed over once, when the worker's leader exited: the training process train.sh
    had started never got one, trained on until the SIGKILL and never saved its emergency checkpoint."""
    from kubetrain_trainer.launch import Workers

    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(pid))
    workers = Workers([_Leader(10, -signal.SIGTERM)])
    # train.sh's shell 11, its training process 12, that one's DataLoader worker 13
    running = [Proc(11, 1, 10, "S"), Proc(12, 11, 10, "S"), Proc(13, 12, 10, "S")]
    workers.orphans = Orphans([10], list_processes=lambda: running)
    monkeypatch.setattr(workers.orphans, "reap", lambda: None)
    workers.terminate()
    assert not workers.poll() and sent == [11]
    running[:] = [Proc(12, 1, 10, "S"), Proc(13, 12, 10, "S")]  # the SIGTERM ended train.sh's shell
    workers.orphans.codes[11] = -signal.SIGTERM
    assert not workers.poll() and sent == [11, 12]
    assert not workers.poll() and sent == [11, 12]  # once each, never the DataLoader worker
    running.clear()
    workers.orphans.codes[12] = trainer_code
    assert workers.poll()
    assert workers.exited_cleanly is clean


def test_a_pipe_reader_gets_the_sigterm_only_once_nothing_writes_to_it(monkeypatch):
    """`sh -c "python train.py 2>&1 | tee train.log"`: before, the SIGTERM went to tee as to the training process;
    tee died at once, and the training process's next line of output (its emergency save's) raised
    BrokenPipeError: no emergency checkpoint. tee ends by itself at the end of its input."""
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(pid))
    pipes = {(11, 1): "pipe:[5]", (11, 2): "pipe:[5]", (12, 0): "pipe:[5]", (13, 1): "pipe:[5]"}
    running = [Proc(11, 1, 10, "S"), Proc(12, 1, 10, "S"), Proc(13, 11, 10, "S")]  # 13: 11's DataLoader worker
    orphans = Orphans([10], list_processes=lambda: running, pipe=lambda pid, fd: pipes.get((pid, fd)))
    assert orphans.hand_over(10) == (11,) and sent == [11]
    running[:] = [Proc(12, 1, 10, "S"), Proc(13, 1, 10, "S")]  # the training process saved and exited
    assert orphans.hand_over(10) == (13,)  # its DataLoader worker, which still holds the pipe
    running[:] = [Proc(12, 1, 10, "S")]
    assert orphans.hand_over(10) == (12,) and sent == [11, 13, 12]  # tee, had it not ended by itself


@pytest.mark.skipif(not Path("/proc/self/fd/0").exists(), reason="Linux /proc")
def test_pipes_are_read_from_proc():
    from kubetrain_trainer.orphans import pipe_of

    read, write = os.pipe()
    try:
        p = subprocess.Popen(["sleep", "5"], stdin=read, stdout=subprocess.DEVNULL)
        try:
            time.sleep(0.1)
            assert pipe_of(p.pid, 0) == os.readlink(f"/proc/self/fd/{read}") and pipe_of(p.pid, 1) is None
        finally:
            p.kill()
            p.wait()
    finally:
        os.close(read)
        os.close(write)
    assert pipe_of(p.pid, 0) is None  # gone


@pytest.mark.parametrize("helper_code, trainer_code, clean", [
    (-signal.SIGTERM, EXIT_PREEMPTED, True),   # `tensorboard & python train.py`: the helper dies of the SIGTERM
    (-signal.SIGTERM, -signal.SIGTERM, False),  # the training process died of it too: no emergency save
    (-signal.SIGTERM, 1, False),
    (-signal.SIGTERM, 0, False),  # which of the two wrote the checkpoints is unknown: only 83 says "I saved"
    (-signal.SIGKILL, EXIT_PREEMPTED, False),  # a helper killed at the end of the workers' time: not in time
    (0, EXIT_PREEMPTED, True),
])
def test_a_background_helper_the_sigterm_ended_leaves_a_preempted_shell_clean(monkeypatch, helper_code, trainer_code,
                                                                              clean):
    """`bash -c "tensorboard --logdir runs & python train.py"`: the forwarded SIGTERM ends the shell, its two
    processes get it in its place; the helper dies of it (-15), the training process saves and exits 83. Before,
    the helper's -15 made the worker's exit unclean: the launcher took the emergency checkpoint for one its writer
    may have died in the middle of and never committed it unless it had been quiet for the settle period."""
    from kubetrain_trainer.launch import Workers

    monkeypatch.setattr(os, "kill", lambda pid, sig: None)
    workers = Workers([_Leader(10, -signal.SIGTERM)])
    running = [Proc(11, 1, 10, "S"), Proc(12, 1, 10, "S")]  # the helper 11, the training process 12
    workers.orphans = Orphans([10], list_processes=lambda: running)
    monkeypatch.setattr(workers.orphans, "reap", lambda: None)
    workers.terminate()
    assert not workers.poll()
    running.clear()
    workers.orphans.codes.update({11: helper_code, 12: trainer_code})
    assert workers.poll()
    assert workers.exited_cleanly is clean


HELPER = r"""
import os, pathlib, subprocess, sys, time
from kubetrain_trainer.launch import Workers
from kubetrain_trainer.orphans import become_subreaper
assert become_subreaper()
out = pathlib.Path(sys.argv[1])
(out / "train.py").write_text(
    "import pathlib, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(83))  # the emergency save, then 'preempted'\n"
    "pathlib.Path(sys.argv[1]).write_text('x')\n"
    "time.sleep(30)\n")
shell = f"sleep 30 & {sys.executable} {out / 'train.py'} {out / 'ready'}; echo training ended"
worker = subprocess.Popen(["bash", "-c", shell], process_group=0)
deadline = time.monotonic() + 30
while not (out / "ready").exists() and time.monotonic() < deadline:
    time.sleep(0.02)
workers = Workers([worker])
workers.terminate()
while not workers.poll() and time.monotonic() < deadline:
    time.sleep(0.02)
print(worker.returncode, sorted(workers.orphans.codes.values()), workers.exited_cleanly)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")
def test_a_real_shell_with_a_background_helper_stops_cleanly(tmp_path: Path):
    """The same through real processes: bash, a `sleep` in the background, a training process that exits 83."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "trainer_image"))
    out = subprocess.run([sys.executable, "-c", HELPER, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "-15 [-15, 83] True", out.stdout + out.stderr
