"""Resume cost: process start to first trained step, resuming at step 10 vs step 100,000 of one epoch.

A checkpoint at step 10 is made by training; the one at step 100,000 is the
same checkpoint with its progress (global step, data position, scheduler
step) moved to step 100,000 of the same epoch — the state a long run would
have written. Each resume runs in a fresh process (import and setup included)
and stops after its first step. The HF Trainer would iterate 100,000 x
batch samples to get there; kubetrain's sampler starts at the offset.
Goal (issue 4): ratio under 1.1. Prints the ratio; not a test.

    python benchmarks/resume_cost.py [--repeats 3] [--far 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCH = 8
MODEL = dict(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4)


def _trainer(out: str, max_steps: int, callbacks=()):
    import torch

    torch.set_num_threads(1)
    from kubetrain_trainer import Trainer, TrainingArguments
    from kubetrain_trainer.models import SyntheticTokens, TinyGPT, TinyGPTConfig

    # One epoch long enough to hold step 100,000 and more.
    data = SyntheticTokens(BATCH * (max_steps + 10), MODEL["seq_len"], MODEL["vocab_size"])
    args = TrainingArguments(output_dir=out, max_steps=max_steps, per_device_train_batch_size=BATCH,
                             save_steps=10, logging_steps=10, report_to=["none"], disable_tqdm=True,
                             log_level="warning")
    return Trainer(model=TinyGPT(TinyGPTConfig(**MODEL)), args=args, train_dataset=data, callbacks=list(callbacks))


def make_checkpoints(root: Path, max_steps: int, far: int) -> tuple[Path, Path]:
    import torch

    from kubetrain_trainer import TrainerCallback

    class StopAt10(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 10

    _trainer(str(root / "near"), max_steps, [StopAt10()]).train()
    near = root / "near" / "checkpoint-10"
    far_dir = root / "far" / f"checkpoint-{far}"
    shutil.copytree(near, far_dir)
    state = json.loads((far_dir / "trainer_state.json").read_text())
    state.update(global_step=far, epoch=far / (max_steps + 10))
    (far_dir / "trainer_state.json").write_text(json.dumps(state))
    extra = json.loads((far_dir / "kubetrain_state.json").read_text())
    extra.update(data_position={"epoch": 0, "samples": far * BATCH})
    (far_dir / "kubetrain_state.json").write_text(json.dumps(extra))
    sched = torch.load(far_dir / "scheduler.pt", weights_only=False)
    sched["last_epoch"], sched["_step_count"] = far, far + 1
    torch.save(sched, far_dir / "scheduler.pt")
    return near, far_dir


def child(checkpoint: str, max_steps: int, t0: float) -> None:
    from kubetrain_trainer import TrainerCallback

    class FirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            now = time.time()
            usage = resource.getrusage(resource.RUSAGE_SELF)
            print(json.dumps({"seconds": now - t0, "in_train": now - t_train, "step": state.global_step,
                              "cpu_seconds": usage.ru_utime + usage.ru_stime}), flush=True)
            control.should_training_stop = True

    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(out, max_steps, [FirstStep()])
        t_train = time.time()
        trainer.train(resume_from_checkpoint=checkpoint)


def measure(checkpoint: Path, max_steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.time()  # "process start" = just before the interpreter is launched
    out = subprocess.run([sys.executable, __file__, "--child", str(checkpoint), "--max-steps", str(max_steps),
                          "--t0", repr(t0)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--far", type=int, default=100_000)
    p.add_argument("--child")
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--t0", type=float, default=0.0)
    a = p.parse_args()
    max_steps = a.max_steps or 2 * a.far
    if a.child:
        return child(a.child, max_steps, a.t0)
    with tempfile.TemporaryDirectory() as tmp:
        near, far = make_checkpoints(Path(tmp), max_steps, a.far)
        runs: dict[str, list[dict]] = {"near": [], "far": []}
        for _ in range(a.repeats):  # interleaved against drift in machine load
            for name, ck in (("near", near), ("far", far)):
                r = measure(ck, max_steps)
                assert r["step"] == (11 if name == "near" else a.far + 1), r
                runs[name].append(r)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {a.repeats} runs each, interleaved")
    for key, label in (("seconds", "process start -> first step, wall"), ("in_train", "train() call -> first step, wall"),
                       ("cpu_seconds", "process start -> first step, CPU time")):
        near_v = [r[key] for r in runs["near"]]
        far_v = [r[key] for r in runs["far"]]
        print(f"{label:40s} step 10: min {min(near_v):7.3f} s median {statistics.median(near_v):7.3f} s | "
              f"step {a.far:,}: min {min(far_v):7.3f} s median {statistics.median(far_v):7.3f} s | "
              f"ratio min {min(far_v) / min(near_v):.3f}x median {statistics.median(far_v) / statistics.median(near_v):.3f}x")
    print("goal: ratio < 1.1 (the minimum is the least disturbed by other processes on a shared machine)")

if __name__ == "__main__":
    main()
