"""A shell that swallows its training process's crash (`bash -c "python train.py; echo done"` exits 0): the launcher
weighs the workers' own report on their run (`outcome.py`, `progress.py`) and fails the pod instead of letting the
job succeed without a model. The launcher runs in this process (`launch.main`) with real shells as its workers."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from kubetrain_trainer.contract import EXIT_OK, EXIT_PREEMPTED
from kubetrain_trainer.outcome import EXIT_UNFINISHED, unfinished_run
from kubetrain_trainer.progress import WorkerProgress

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("code, run, signalled, expected, unseen", [
    (EXIT_OK, "training", False, EXIT_UNFINISHED, True),  # crashed, and a shell went on
    (EXIT_OK, "training", True, EXIT_PREEMPTED, True),    # a shell that trapped the SIGTERM and exited 0
    (EXIT_OK, "preempted", False, EXIT_PREEMPTED, False),  # its emergency checkpoint is written
    (EXIT_OK, "finished", False, EXIT_OK, False),
    (EXIT_OK, "finished", True, EXIT_OK, False),
    (EXIT_OK, None, False, EXIT_OK, False),  # a writer that does not report its end: its exit code decides
    (3, "training", False, 3, False),  # the workers' own failure is the message
    (EXIT_PREEMPTED, "training", True, EXIT_PREEMPTED, False),
])
def test_an_unfinished_run_fails_a_pod_whose_command_exited_0(code, run, signalled, expected, unseen):
    verdict = unfinished_run(code, WorkerProgress(time=0.0, step=3, max_steps=10, run=run), signalled=signalled)
    assert (verdict.code, verdict.writers_unseen, verdict.problem is not None) == (expected, unseen, expected != code)
    assert unfinished_run(EXIT_OK, None, signalled=False).code == EXIT_OK  # no report at all


TRAIN = """
import sys
from kubetrain_trainer.progress import ProgressTracker
tracker = ProgressTracker.from_env()
tracker.train_begin(step=0, max_steps=10, reports_end=sys.argv[1] != "custom")
tracker.step_end(step=3, max_steps=10, epoch=None, samples_per_step=1)
tracker.saved(3)  # written at once
if sys.argv[1] == "crash":
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
if sys.argv[1] == "caught":  # the script stops its run on purpose (keeps what it has) and exits 0
    try:
        raise MemoryError("out of memory at step 4")
    except MemoryError:
        sys.exit(0)
if sys.argv[1] != "custom":
    tracker.train_end()
"""


@pytest.fixture
def launch_in_process(tmp_path: Path, monkeypatch):
    from kubetrain_trainer import launch

    (tmp_path / "train.py").write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBETRAIN_", "AWS_"))}
    env.update(PYTHONPATH=str(ROOT / "trainer_image"), KUBETRAIN_METRICS_PORT="0",
               KUBETRAIN_LOCAL_CHECKPOINT_DIR=str(tmp_path / "ckpt"))
    monkeypatch.setattr(launch, "pod_environ", lambda: dict(env))
    monkeypatch.setattr(launch, "become_subreaper", lambda: True)  # not this test run: the shell waits for its child
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield lambda script, shell=True: launch.main(
        ["--", "bash", "-c", script.format(py=sys.executable, train=tmp_path / "train.py")] if shell
        else ["--", sys.executable, str(tmp_path / "train.py"), script])
    for s, h in handlers.items():
        signal.signal(s, h)


def test_a_shell_that_goes_on_after_its_training_process_crashed_fails_the_pod(launch_in_process, caplog):
    with caplog.at_level(logging.ERROR, logger="kubetrain_trainer.launch"):
        assert launch_in_process("{py} {train} crash; echo done") == EXIT_UNFINISHED
    assert "its training run never ended (last report: step 3 of 10)" in caplog.text


@pytest.mark.parametrize("script", [
    "{py} {train} ok; echo done",
    "{py} {train} crash || {py} {train} ok",  # a shell that retries: its last run finished
    "{py} {train} custom; echo done",  # a custom loop that never promised to report its end
])
def test_shells_whose_run_ended_still_succeed(launch_in_process, script):
    assert launch_in_process(script) == EXIT_OK


def test_a_training_process_that_is_the_worker_itself_is_judged_by_its_own_exit(launch_in_process, caplog):
    """No shell between: the launcher sees the training process's own exit. One that stops its run on purpose (an
    exception it catches, then keeps what it has) and exits 0 chose success, as before the run's end was reported.
    Before: exit 1 with "its training process failed and the command went on (a shell without `set -e`)", backoffLimit
    spent on every attempt until the job failed. A shell's child still fails the pod (above)."""
    with caplog.at_level(logging.ERROR, logger="kubetrain_trainer.launch"):
        assert launch_in_process("caught", shell=False) == EXIT_OK
    assert "never ended" not in caplog.text
    assert launch_in_process("{py} {train} caught; echo done") == EXIT_UNFINISHED  # behind a shell: unseen


def test_a_direct_worker_that_exited_0_stands_unless_a_sigterm_came():
    direct = WorkerProgress(time=0.0, step=3, max_steps=10, run="training", pid=42)
    assert unfinished_run(EXIT_OK, direct, signalled=False, exited_ok={42}).code == EXIT_OK
    assert unfinished_run(EXIT_OK, direct, signalled=False, exited_ok={42}).writers_unseen  # its last folder: unsure
    assert unfinished_run(EXIT_OK, direct, signalled=True, exited_ok={42}).code == EXIT_PREEMPTED  # not finished
    assert unfinished_run(EXIT_OK, direct, signalled=False, exited_ok={7}).code == EXIT_UNFINISHED  # a shell's child
