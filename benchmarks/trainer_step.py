"""Step time of the kubetrain Trainer vs a raw PyTorch loop and the HF transformers Trainer.

Same tiny GPT, same synthetic tokens, same batch, AdamW, linear schedule and
gradient clipping in all three; each is measured in its own subprocess (so
peak RSS is its own) and the median step time after a warm-up is compared.
Goals (issue 4): kubetrain <= 1.03x the raw loop, faster than HF, peak RSS
not above HF's. Prints ratios; not a test.

    python benchmarks/trainer_step.py [--steps 60] [--repeats 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

MODEL = dict(vocab_size=256, seq_len=64, d_model=128, n_layers=2, n_heads=4, dropout=0.0)
BATCH, LR, WARMUP = 16, 1e-3, 5


def _setup(threads: int):
    import torch

    torch.set_num_threads(threads)
    from kubetrain_trainer.models import SyntheticTokens, TinyGPT, TinyGPTConfig

    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(**MODEL))
    data = SyntheticTokens(100_000, MODEL["seq_len"], MODEL["vocab_size"])
    return model, data


def run_raw(steps: int, threads: int) -> list[tuple[float, float]]:
    import torch
    from torch.utils.data import DataLoader

    model, data = _setup(threads)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (steps - s) / steps))
    model.train()
    marks = []
    for step, batch in enumerate(loader):
        if step == steps:
            break
        loss = model(**batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        marks.append((time.perf_counter(), time.process_time()))
    return marks


def run_kubetrain(steps: int, threads: int) -> list[tuple[float, float]]:
    from kubetrain_trainer import Trainer, TrainerCallback, TrainingArguments

    model, data = _setup(threads)
    marks: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append((time.perf_counter(), time.process_time()))

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH,
                                 learning_rate=LR, weight_decay=0.0, max_grad_norm=1.0, save_strategy="no",
                                 logging_steps=10_000, report_to=["none"], disable_tqdm=True, use_cpu=True)
        Trainer(model=model, args=args, train_dataset=data, callbacks=[Clock()]).train()
    return marks


def run_hf(steps: int, threads: int) -> list[tuple[float, float]]:
    import transformers

    model, data = _setup(threads)
    marks: list[tuple[float, float]] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append((time.perf_counter(), time.process_time()))

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=LR,
            weight_decay=0.0, max_grad_norm=1.0, save_strategy="no", logging_steps=10_000, report_to="none",
            disable_tqdm=True, use_cpu=True, optim="adamw_torch", lr_scheduler_type="linear",
            dataloader_num_workers=0, remove_unused_columns=False)
        transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[Clock()]).train()
    return marks


RUNNERS = {"raw": run_raw, "kubetrain": run_kubetrain, "hf": run_hf}


def child(mode: str, steps: int, threads: int) -> None:
    marks = RUNNERS[mode](steps, threads)
    wall = [b[0] - a[0] for a, b in zip(marks[WARMUP:], marks[WARMUP + 1:])]
    # CPU time of the process per step: what the step costs, even when other processes steal the cores.
    cpu = [b[1] - a[1] for a, b in zip(marks[WARMUP:], marks[WARMUP + 1:])]
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    print(json.dumps({"mode": mode, "median_s": statistics.median(wall), "cpu_median_s": statistics.median(cpu),
                      "steps": len(marks), "peak_rss_mib": peak_kib / 1024}))


def measure(mode: str, steps: int, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(steps), "--threads", str(threads)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child")
    a = p.parse_args()
    if a.child:
        return child(a.child, a.steps, a.threads)
    results: dict[str, list[dict]] = {m: [] for m in RUNNERS}
    for _ in range(a.repeats):  # interleaved, so a noisy neighbour hits every mode alike
        for mode in RUNNERS:
            results[mode].append(measure(mode, a.steps, a.threads))
    best = {m: min(r["median_s"] for r in rs) for m, rs in results.items()}
    cpu = {m: min(r["cpu_median_s"] for r in rs) for m, rs in results.items()}
    rss = {m: max(r["peak_rss_mib"] for r in rs) for m, rs in results.items()}
    print(f"tiny GPT {MODEL}, batch {BATCH}, {a.steps} steps, {a.threads} thread(s), best of {a.repeats} runs, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for m in RUNNERS:
        medians = ", ".join("%.2f" % (r["median_s"] * 1000) for r in results[m])
        print(f"  {m:10s} median step wall {best[m] * 1000:8.2f} ms  CPU {cpu[m] * 1000:8.2f} ms  "
              f"peak RSS {rss[m]:8.1f} MiB   (wall medians: {medians})")
    for label, t in (("wall", best), ("CPU time", cpu)):
        print(f"{label:8s} kubetrain / raw loop : {t['kubetrain'] / t['raw']:.3f}x (goal <= 1.03)   "
              f"kubetrain / HF : {t['kubetrain'] / t['hf']:.3f}x (goal < 1)")
    print(f"peak RSS kubetrain / HF : {rss['kubetrain'] / rss['hf']:.3f}x   (goal <= 1)")

if __name__ == "__main__":
    main()
