"""examples/train_custom.py is runnable documentation: it must train, save and resume."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_custom.py"


def _run(cwd: Path, *argv: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("KUBETRAIN_RESUME_FROM", None)
    env.pop("KUBETRAIN_LOCAL_CHECKPOINT_DIR", None)
    done = subprocess.run([sys.executable, str(EXAMPLE), *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.timeout(300)
def test_example_trains_saves_and_resumes(tmp_path):
    first = _run(tmp_path, "--max_steps", "20")
    assert "trained to step 20" in first
    out = tmp_path / "runs" / "custom"
    assert (out / "final" / "model.safetensors").is_file()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-20"]

    second = _run(tmp_path, "--max_steps", "30")
    assert "trained to step 30" in second
    assert "checkpoint-20" in second  # the log names the checkpoint it resumed from
    # save_total_limit=2 keeps the newest and the best, nothing else
    assert len(list(out.glob("checkpoint-*"))) <= 2
