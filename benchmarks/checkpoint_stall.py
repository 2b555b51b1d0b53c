"""How long a checkpoint stalls training: per strategy (DDP, FSDP, ZeRO-3), 2 gloo processes, CPU.

Issue 12, item 2. A TinyGPT (6 layers, d 512, 19 M parameters) whose checkpoint (weights + AdamW state)
is about 230 MB trains with kubetrain's real `Trainer`; the run is cut into segments of `--interval`
steps, each opened by one save of a given mode, in rounds that rotate the order:

- `none`: no save (the baseline: what the segment's steps cost alone);
- `sync`: today's save (`async_save: false`): every byte written, fsynced and renamed in the loop;
- `async`: `async_save: true` (when the Trainer has it): the state copied to CPU memory in the loop, the
  files written, agreed and renamed by a background thread.

Per save it reports the time the loop spent inside the save call (blocked), and the training time the
save cost in all (its segment minus the median `none` segment: blocked + the slowdown of the steps
that ran while a background write competed for the two cores). From those and the median step time it
gives the share of training time at one save per 50 steps. Ratios async / sync are taken within each
round: median and range. A last line times a local copy of the same bytes (a stand-in for an upload at
disk speed, a lower bound): what a save that also uploaded in the loop would have blocked on top.

Not a test. Prints figures; `--quick` (2 rounds of 10 steps) takes about 3 minutes on 2 loaded cores.

    python benchmarks/checkpoint_stall.py [--rounds 3] [--interval 20] [--strategies ddp,fsdp,zero3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accelerate_overhead import run2  # the house 2-process gloo runner

MODEL = dict(vocab_size=256, seq_len=64, d_model=512, n_layers=6, n_heads=8, dropout=0.0)
BATCH = 2
ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 10**9}


def schedule(rounds: int, modes: list[str]) -> list[str]:
    """Segment modes after one warm-up segment: each round has every mode once, order reversed every other round."""
    out = []
    for r in range(rounds):
        out.extend(modes if r % 2 == 0 else list(reversed(modes)))
    return out


def worker(strategy: str, out: str, rounds: int, interval: int, modes: list[str]) -> dict:
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)  # DeepSpeed's deprecated collectives, every step

    from kubetrain_trainer import Trainer, TrainerCallback, TrainingArguments
    from kubetrain_trainer.models import SyntheticTokens, TinyGPT, TinyGPTConfig

    torch.manual_seed(0)
    plan = schedule(rounds, modes)
    segments = len(plan) + 1  # segment 0 warms up, with no save
    max_steps = segments * interval
    extra = {"deepspeed": ZERO3} if strategy == "zero3" else {}
    has_async = "async_save" in TrainingArguments.__dataclass_fields__
    args = TrainingArguments(output_dir=out, max_steps=max_steps, per_device_train_batch_size=BATCH,
                             learning_rate=1e-4, save_steps=interval, save_total_limit=2, logging_steps=10**6,
                             disable_tqdm=True, report_to=["none"], use_cpu=True, strategy=strategy, **extra)
    marks: dict[int, float] = {}
    blocked: dict[int, float] = {}

    class Segments(TrainerCallback):
        def on_step_end(self, a, state, control, **kwargs):
            step = state.global_step
            marks[step] = time.perf_counter()
            if step % interval == 0:
                seg = step // interval
                mode = plan[seg - 1] if 1 <= seg <= len(plan) else "none"
                control.should_save = mode != "none"
                if has_async:
                    a.async_save = mode == "async"

    model = TinyGPT(TinyGPTConfig(**MODEL))
    params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
    trainer = Trainer(model=model, args=args, train_dataset=SyntheticTokens(max_steps * BATCH * 2 + 8, 64, 256),
                      callbacks=[Segments()])
    inner = trainer._save_checkpoint

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            blocked[trainer.state.global_step] = time.perf_counter() - t0
    trainer._save_checkpoint = timed
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    rows = []
    for seg, mode in enumerate(plan, start=1):
        begin, end = seg * interval, (seg + 1) * interval
        rows.append({"mode": mode, "round": (seg - 1) // len(modes), "segment_s": marks[end] - marks[begin],
                     "blocked_s": blocked.get(begin, 0.0)})
    import torch.distributed as dist

    newest = sorted(Path(out).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
    copy_s = None
    dist.barrier()
    if dist.get_rank() == 0:  # the same bytes copied and fsynced: what an upload in the loop would add, at best
        target = Path(out).parent / f"copy-{strategy}"
        c0 = time.perf_counter()
        shutil.copytree(newest, target)
        for p in target.rglob("*"):
            if p.is_file():
                with open(p, "rb") as fh:
                    os.fsync(fh.fileno())
        copy_s = time.perf_counter() - c0
        shutil.rmtree(target, ignore_errors=True)
    dist.barrier()
    return {"rows": rows, "total_s": total, "checkpoint_bytes": size, "copy_s": copy_s,
            "params": params}


def _spread(values: list[float], fmt: str = "%.3f") -> str:
    if not values:
        return "n/a"
    return f"{fmt % statistics.median(values)} ({fmt % min(values)}–{fmt % max(values)})"


def report(strategy: str, res: dict, interval: int, modes: list[str]) -> None:
    rows = res["rows"]
    by = {m: [r for r in rows if r["mode"] == m] for m in modes}
    base = statistics.median(r["segment_s"] for r in by["none"])
    step = base / interval
    print(f"\n== {strategy}: {res['params'] / 1e6:.1f} M parameters, checkpoint {res['checkpoint_bytes'] / 1e6:.0f} MB "
          f"(all ranks), median step {step * 1000:.0f} ms, run {res['total_s']:.0f} s")
    nones = [r["segment_s"] for r in by["none"]]
    print(f"  no-save segments of {interval} steps: {_spread(nones)} s (the noise floor of 'training time lost')")
    lost: dict[str, list[float]] = {}
    for m in modes:
        if m == "none":
            continue
        blocked = [r["blocked_s"] for r in by[m]]
        lost[m] = [r["segment_s"] - base for r in by[m]]
        share = [x / (50 * step + x) * 100 for x in lost[m]]
        bshare = [x / (50 * step + x) * 100 for x in blocked]
        print(f"  {m:5s} blocked per save {_spread(blocked)} s = {_spread(bshare, '%.2f')} % at one save per 50 steps; "
              f"training time lost per save {_spread(lost[m])} s = {_spread(share, '%.2f')} %")
    if "sync" in modes and "async" in modes:
        rounds = sorted({r["round"] for r in rows})
        get = {(r["round"], r["mode"]): r for r in rows}
        rb = [get[(i, "async")]["blocked_s"] / get[(i, "sync")]["blocked_s"] for i in rounds]
        print(f"  async / sync, same round: blocked {_spread(rb)}x")
    if res["copy_s"] is not None:
        sync_blocked = statistics.median(r["blocked_s"] for r in by["sync"])
        print(f"  a copy of rank 0's newest folder (stand-in for an upload in the loop): {res['copy_s']:.2f} s; "
              f"sync save + that copy: {sync_blocked + res['copy_s']:.2f} s blocked")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--interval", type=int, default=20, help="steps per segment (one save opens each)")
    p.add_argument("--strategies", default="ddp,fsdp,zero3")
    p.add_argument("--quick", action="store_true", help="2 rounds of 10-step segments")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.interval = 2, 10
    from kubetrain_trainer import TrainingArguments

    modes = ["none", "sync"] + (["async"] if "async_save" in TrainingArguments.__dataclass_fields__ else [])
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; rounds {a.rounds}, "
          f"segments of {a.interval} steps; modes {', '.join(modes)}")
    for strategy in a.strategies.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            res = run2(worker, strategy, str(Path(tmp) / "out"), a.rounds, a.interval, modes, timeout=3600)[0]
        report(strategy, res, a.interval, modes)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
