"""Real processes: SIGTERM from outside exits 83 after an emergency checkpoint; SIGKILL mid-save leaves no
checkpoint that resume would pick."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kubetrain_trainer.checkpoint import list_checkpoints, newest_checkpoint

pytestmark = pytest.mark.slow


def _builtin(out: Path, **args) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KUBETRAIN_BUILTIN_TASK": "causal-lm",
           "KUBETRAIN_TRAINER_ARGS": json.dumps({"output_dir": str(out), "report_to": ["jsonl"], "logging_steps": 1,
                                                 "disable_tqdm": True, "save_steps": 1000, "d_model": 32,
                                                 "n_layers": 1, "seq_len": 16, **args})}
    return subprocess.Popen([sys.executable, "-m", "kubetrain_trainer.builtin"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_to_the_builtin_entrypoint_exits_83_and_resumes(tmp_path):
    out = tmp_path / "out"
    proc = _builtin(out, max_steps=100_000)
    log = out / "runs" / "log.jsonl"
    deadline = time.time() + 240
    while not (log.is_file() and len(log.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 83, err
    assert "preempted at step" in err
    (step, folder), = list_checkpoints(out)
    assert step >= 3 and json.loads((folder / "trainer_state.json").read_text())["global_step"] == step
    again = _builtin(out, max_steps=step + 2)
    stdout, err = again.communicate(timeout=240)
    assert again.returncode == 0, err
    assert json.loads(stdout.strip().splitlines()[-1])["global_step"] == step + 2
    assert (out / "model.safetensors").is_file()


KILL_MID_SAVE = textwrap.dedent("""
    import os, signal, sys
    import kubetrain_trainer.checkpoint as ck
    from kubetrain_trainer.builtin import main
    real = ck._fsync_tree
    def killer(directory):
        # every file of step 6 is written under its tmp name; die before the commit rename
        if directory.name == "tmp-checkpoint-6":
            os.kill(os.getpid(), signal.SIGKILL)
        real(directory)
    ck._fsync_tree = killer
    sys.exit(main())
""")


def test_sigkill_mid_save_is_never_resumed_from(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KUBETRAIN_BUILTIN_TASK": "regression",
           "KUBETRAIN_TRAINER_ARGS": json.dumps({"output_dir": str(out), "max_steps": 9, "save_steps": 3,
                                                 "report_to": ["none"], "disable_tqdm": True})}
    proc = subprocess.run([sys.executable, "-c", KILL_MID_SAVE], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (out / "tmp-checkpoint-6" / "model.safetensors").is_file()  # torn save left behind
    assert newest_checkpoint(out) == out / "checkpoint-3"
    resumed = subprocess.run([sys.executable, "-m", "kubetrain_trainer.builtin"], env=env, capture_output=True,
                             text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr and "checkpoint-3" in resumed.stderr
    assert [s for s, _ in list_checkpoints(out)] == [3, 6, 9]
    assert not (out / "tmp-checkpoint-6").exists()
