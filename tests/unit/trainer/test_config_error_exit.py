"""A user's own script whose TrainingArguments can never work: under the launcher the pod exits 82 (invalid
configuration: the job fails at once), not 1 (an application failure, retried until backoffLimit)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = "from kubetrain_trainer import TrainingArguments\nTrainingArguments(output_dir='out', save_steps=0)\n"


def test_a_users_script_with_invalid_arguments_makes_the_pod_exit_82(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "KUBETRAIN_METRICS_PORT": "0", "KUBETRAIN_LOCAL_CHECKPOINT_DIR": str(tmp_path / "ck"),
           "KUBETRAIN_TERMINATION_LOG": str(tmp_path / "termination")}
    env.pop("KUBETRAIN_CHECKPOINT_URI", None)
    launched = subprocess.run([sys.executable, "-m", "kubetrain_trainer.launch", "--", sys.executable, str(script)],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert launched.returncode == 82, launched.stderr
    assert "kubetrain: invalid configuration: invalid training arguments" in launched.stderr
    assert "save_steps > 0" in launched.stderr and "Traceback" in launched.stderr, "the usual traceback too"


def test_outside_the_launcher_python_exits_as_usual(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KUBETRAIN_SYNC_BY_LAUNCHER"}
    plain = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
    assert plain.returncode == 1 and "ConfigError" in plain.stderr
