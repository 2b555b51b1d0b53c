"""How the launcher splits the termination grace period after a SIGTERM (grace.py, docs/contract.md).

The table is the documentation: the workers get what their save needs (measured
in this pod), the upload the rest; before this rule a fixed third (at most 30 s)
went to the upload whatever the grace, so 120 s left the workers 90 s.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from kubetrain_trainer.grace import GraceSplit, split_grace
from kubetrain_trainer.launch import Workers, supervise
from kubetrain_trainer.launch_config import LaunchConfig
from kubetrain_trainer.metrics import Telemetry
from kubetrain_trainer.progress import ProgressTracker


@pytest.mark.parametrize("grace, step_s, save_s, stop, upload, margin", [
    # nothing measured yet: half of the usable time each
    (30, None, None, 14.0, 14.0, 2.0),
    (120, None, None, 59.0, 59.0, 2.0),
    # measured: the workers get 2 x (step + slowest save) + 5 s, the upload the rest
    (120, 1.0, 5.0, 17.0, 101.0, 2.0),
    (600, 2.0, 60.0, 129.0, 469.0, 2.0),
    # ... never under 10 s (a small model saves fast, but not that fast on a loaded node)
    (120, 0.01, 0.2, 10.0, 108.0, 2.0),
    (30, 0.1, 1.0, 10.0, 18.0, 2.0),
    # ... never over two thirds of the usable time: the upload keeps a third
    (120, 2.0, 80.0, 118 * 2 / 3, 118 / 3, 2.0),
    (30, 1.0, 20.0, 28 * 2 / 3, 28 / 3, 2.0),
    # very short graces: a tenth as the exit margin, the two-thirds cap wins over the 10 s floor
    (3, None, None, 1.8, 0.9, 0.3),
    (5, 0.1, 0.1, 3.0, 1.5, 0.5),
])
def test_split_table(grace, step_s, save_s, stop, upload, margin):
    split = split_grace(grace, step_s=step_s, save_s=save_s)
    assert split == GraceSplit(stop_s=pytest.approx(stop), upload_s=pytest.approx(upload), margin_s=pytest.approx(margin))
    assert split.stop_s + split.upload_s + split.margin_s == pytest.approx(grace)


def test_a_larger_grace_goes_to_the_upload_not_the_workers():
    """The issue's case: 120 s with a small save gives the upload most of the time."""
    split = split_grace(120, step_s=0.5, save_s=3.0)
    assert split.upload_s > 100 and split.stop_s < 20


def test_the_launcher_splits_with_the_steps_and_saves_its_workers_reported(tmp_path: Path):
    path = tmp_path / "progress.json"
    telemetry = Telemetry(progress_file=path, attempt=1, incarnation=0)
    assert telemetry.grace_split(120) == split_grace(120)  # no report yet
    now = [0.0]
    tracker = ProgressTracker(path, clock=lambda: now[0])
    tracker.train_begin(step=0, max_steps=100)
    for step in (1, 2, 3):
        tracker.step_begin()
        now[0] += 1.0
        tracker.step_end(step=step, max_steps=100, epoch=None, samples_per_step=8)
    now[0] += 1.0
    tracker.saved(3)
    assert telemetry.grace_split(120) == split_grace(120, step_s=1.0, save_s=1.0)
    assert telemetry.grace_split(120).stop_s == 10.0  # 2 x (1 + 1) + 5 = 9, the floor is 10


def test_supervise_kills_workers_at_the_split_not_at_two_thirds(tmp_path: Path):
    """Workers that ignore SIGTERM are killed when the split says, with 30 s grace well before 20 s."""
    ready = tmp_path / "ready"
    script = tmp_path / "stubborn.py"
    script.write_text("import pathlib, signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "pathlib.Path(sys.argv[1]).write_text('x')\ntime.sleep(120)\n")
    cfg = LaunchConfig.from_env({"KUBETRAIN_TERMINATION_GRACE_SECONDS": "30"}, ["--", sys.executable, str(script), str(ready)])
    workers = Workers.spawn(cfg, {"PATH": "/usr/bin:/bin"}, None)
    deadline = time.monotonic() + 60  # a safety net: the worker only starts python
    while not ready.exists():
        assert time.monotonic() < deadline and workers.procs[0].poll() is None, "the worker did not start"
        time.sleep(0.02)
    stop = threading.Event()
    stop.set()
    asked: list[float] = []

    def split(grace_s: float) -> GraceSplit:
        asked.append(grace_s)
        return GraceSplit(stop_s=0.5, upload_s=27.5, margin_s=2.0)

    assert supervise(workers, stop, cfg, split) is not None
    assert asked == [30.0]
    assert all(p.returncode == -9 for p in workers.procs)  # SIGKILLed at the split's deadline
