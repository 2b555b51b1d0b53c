"""examples/hf_trainer_script.py, the "bring your HF script" example, with the real transformers Trainer.

- every checkpoint folder it writes carries the callback's ready marker, after trainer_state.json;
- stopped after a save and started again, it resumes from the newest checkpoint and ends with the
  same weights as a run straight through (the property the launcher's restore relies on).
The same script as a command job under the launcher, preempted on the real node: tests/e2e/test_real_node.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kubetrain_trainer.readiness import markers_complete

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "hf_trainer_script.py"
COMMON = ["--per_device_train_batch_size", "8", "--save_steps", "10", "--logging_steps", "10", "--use_cpu",
          "--report_to", "none", "--disable_tqdm", "true", "--seed", "7",
          "--lr_scheduler_type", "constant"]  # a schedule over max_steps would differ between 20 and 30


def _run(out: Path, max_steps: int) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(EXAMPLE), "--output_dir", str(out), "--max_steps", str(max_steps),
                           *COMMON], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.timeout(1200)
def test_hf_script_marks_each_checkpoint_and_resumes_to_the_same_weights(tmp_path: Path):
    straight = tmp_path / "straight"
    assert "trained to step 30, resumed from None" in _run(straight, 30)
    for step in (10, 20, 30):
        folder = straight / f"checkpoint-{step}"
        names = set(os.listdir(folder))
        assert markers_complete(names) and "trainer_state.json" in names, names
        marker = next(folder.glob(".kubetrain-ready*"))
        assert marker.stat().st_mtime_ns >= (folder / "trainer_state.json").stat().st_mtime_ns

    interrupted = tmp_path / "interrupted"
    _run(interrupted, 20)
    second = _run(interrupted, 30)
    assert f"trained to step 30, resumed from {interrupted / 'checkpoint-20'}" in second
    a = load_file(str(straight / "model.safetensors"))
    b = load_file(str(interrupted / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
