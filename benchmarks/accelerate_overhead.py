"""accelerate vs kubetrain's own DDP strategy: step time (2 regimes) and bitwise resume, CPU, gloo, 2 processes.

Issue 13 item 10: should `Accelerator` be the engine behind the strategies?

* **Step time.** One 2-process gloo group runs both loops alternately (A B, then B A, per round), so a
  noisy neighbour hits both alike: kubetrain's `DDPStrategy` driven as the Trainer drives it (no_sync on
  all but the last micro-batch, backward, clip, step, scheduler) over kubetrain's resumable sampler, and
  the loop accelerate's docs give (`Accelerator().prepare(model, optimizer, dataloader, scheduler)`,
  `accumulate`, `backward`, `clip_grad_norm_`). Gradient accumulation 2, same model, data, AdamW. Two
  regimes: an overhead-bound tiny GPT (1 layer, d 16, 8 tokens, batch 2) and the compute-bound one of
  `trainer_step.py` (TinyGPT, 2 layers, d 128, 64 tokens; batch 8). Prints accelerate / kubetrain per
  round: median and range.
* **Resume.** Train 10 steps straight; train 6, checkpoint, new processes (different init seed), resume,
  train to 10; compare every parameter of every rank with `torch.equal`. kubetrain: its Trainer
  (strategy ddp). accelerate: `save_state` / `load_state` + `skip_first_batches`, once with its defaults
  and once with `use_seedable_sampler=True` and `set_epoch` (the setting its docs give for reproducible
  resumes). Dropout 0.1, shuffled data: the RNG and the data position both matter.

Not a test. About 2 minutes of CPU (6 rounds: 6 min wall with the 2 cores shared at load 12).

    python benchmarks/accelerate_overhead.py [--rounds 4] [--steps 20] [--part all|steps|resume]
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

GA = 2  # gradient accumulation in every loop here
WARMUP = 3
REGIMES = {
    # name: (TinyGPT config, per-device batch, steps multiplier)
    "overhead-bound": (dict(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2, dropout=0.0), 2, 4),
    "compute-bound": (dict(vocab_size=256, seq_len=64, d_model=128, n_layers=2, n_heads=4, dropout=0.0), 8, 1),
}
RESUME_MODEL = dict(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2, dropout=0.1)
RESUME_STEPS, RESUME_AT, RESUME_SAMPLES, RESUME_BATCH, LR = 10, 6, 30, 2, 1e-2


# --- processes -------------------------------------------------------------------------------------
def _entry(fn: Callable, rank: int, world: int, port: int, args: tuple, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - any failure goes to the parent as a traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run2(fn: Callable, *args: Any, timeout: float = 300.0) -> list[Any]:
    """fn(*args) in 2 fresh processes joined by gloo; each rank's return value, rank order."""
    import multiprocessing as mp

    from kubetrain_testbed import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, 2, port, args, results)) for r in range(2)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, ok, payload = results.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            out[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in sorted(out)]


# --- step time -------------------------------------------------------------------------------------
def _model(config: dict, seed: int):
    import torch

    from kubetrain_trainer.models import TinyGPT, TinyGPTConfig

    torch.manual_seed(seed)
    return TinyGPT(TinyGPTConfig(**config))


def _kubetrain_steps(config: dict, batch: int, steps: int, out: str) -> list[tuple[float, float]]:
    import torch.distributed as dist
    from torch.optim import AdamW
    from torch.optim.lr_scheduler import LambdaLR

    from kubetrain_trainer import TrainingArguments
    from kubetrain_trainer.data import ResumableDistributedSampler, make_loader
    from kubetrain_trainer.models import SyntheticTokens
    from kubetrain_trainer.strategies import get_strategy

    data = SyntheticTokens(batch * GA * 2 * (steps + 1), config["seq_len"], config["vocab_size"])
    sampler = ResumableDistributedSampler(len(data), num_replicas=2, rank=dist.get_rank(), seed=0)
    loader = make_loader(data, batch_size=batch, sampler=sampler, collate_fn=None, num_workers=0, pin_memory=False,
                         drop_last=False, generator_seed=0)
    args = TrainingArguments(output_dir=out, use_cpu=True, report_to=["none"], disable_tqdm=True)
    strategy = get_strategy("ddp")
    prepared = strategy.prepare(_model(config, 0), args=args, create_optimizer=lambda m: AdamW(m.parameters(), lr=LR),
                                create_scheduler=lambda o: LambdaLR(o, lambda s: 1.0))
    model, sched = prepared.model, prepared.lr_scheduler
    model.train()
    it = iter(loader)
    marks = []
    for _ in range(steps):
        for micro in range(GA):
            b = next(it)
            with strategy.no_sync(micro < GA - 1):
                strategy.backward(model(**b)["loss"] / GA)
        strategy.clip_grad_norm(1.0)
        strategy.optimizer_step()
        sched.step()
        marks.append((time.perf_counter(), time.process_time()))
    return marks


def _accelerate_step(acc, model, opt, sched, batch) -> None:
    """One micro-batch through accelerate's own loop: accumulate, backward, clip on the sync step, step."""
    with acc.accumulate(model):
        acc.backward(model(**batch)["loss"])
        if acc.sync_gradients:
            acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()


def _accelerate_steps(config: dict, batch: int, steps: int, out: str) -> list[tuple[float, float]]:
    from accelerate import Accelerator
    from torch.optim import AdamW
    from torch.optim.lr_scheduler import LambdaLR
    from torch.utils.data import DataLoader

    from kubetrain_trainer.models import SyntheticTokens

    acc = Accelerator(gradient_accumulation_steps=GA, cpu=True)
    data = SyntheticTokens(batch * GA * 2 * (steps + 1), config["seq_len"], config["vocab_size"])
    model = _model(config, 0)
    opt = AdamW(model.parameters(), lr=LR)
    model, opt, loader, sched = acc.prepare(model, opt, DataLoader(data, batch_size=batch, shuffle=True),
                                            LambdaLR(opt, lambda s: 1.0))
    model.train()
    marks = []
    for b in loader:
        _accelerate_step(acc, model, opt, sched, b)
        if acc.sync_gradients:
            marks.append((time.perf_counter(), time.process_time()))
            if len(marks) == steps:
                break
    return marks


LOOPS = {"kubetrain": _kubetrain_steps, "accelerate": _accelerate_steps}


def step_times(rounds: int, steps: int) -> dict:
    """*Per rank.* {regime: {loop: [(median step wall s, median step CPU s) per round]}}, alternated A B / B A."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {r: {m: [] for m in LOOPS} for r in REGIMES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            order = list(LOOPS) if i % 2 == 0 else list(reversed(LOOPS))
            for regime, (config, batch, mult) in REGIMES.items():
                for name in order:
                    marks = LOOPS[name](config, batch, steps * mult + WARMUP + 1, tmp)
                    pairs = list(zip(marks[WARMUP:], marks[WARMUP + 1:]))
                    # CPU time of the process per step: what the step costs, even when neighbours steal the cores.
                    out[regime][name].append((statistics.median(b[0] - a[0] for a, b in pairs),
                                              statistics.median(b[1] - a[1] for a, b in pairs)))
    return out


# --- resume ----------------------------------------------------------------------------------------
def _cosine(step: int) -> float:
    warmup = 2
    if step < warmup:
        return step / warmup
    return 0.5 * (1.0 + math.cos(math.pi * min((step - warmup) / (RESUME_STEPS - warmup), 1.0)))


def _kubetrain_run(out: str, *, stop_at: int | None, resume: bool, seed: int) -> dict:
    from kubetrain_trainer import Trainer, TrainerCallback, TrainingArguments
    from kubetrain_trainer.models import SyntheticTokens, TinyGPT, TinyGPTConfig
    from kubetrain_trainer.rng import set_seed

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_training_stop = True

    set_seed(seed)
    model = TinyGPT(TinyGPTConfig(**RESUME_MODEL))
    args = TrainingArguments(output_dir=out, max_steps=RESUME_STEPS, per_device_train_batch_size=RESUME_BATCH,
                             gradient_accumulation_steps=GA, learning_rate=LR, weight_decay=0.0, warmup_steps=2,
                             lr_scheduler_type="cosine", logging_steps=1, save_steps=RESUME_AT, disable_tqdm=True,
                             report_to=["none"], use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=SyntheticTokens(RESUME_SAMPLES, 8, 32),
                      callbacks=[Stop()])
    trainer.train(resume_from_checkpoint=True if resume else None)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _accelerate_run(ckpt: str, *, stop_at: int | None, resume: bool, seed: int, seedable: bool,
                    private_generator: bool) -> dict:
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed
    from torch import Generator
    from torch.optim import AdamW
    from torch.optim.lr_scheduler import LambdaLR
    from torch.utils.data import DataLoader

    from kubetrain_trainer.models import SyntheticTokens, TinyGPT, TinyGPTConfig

    acc = Accelerator(gradient_accumulation_steps=GA, cpu=True,
                      dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable))
    set_seed(seed)
    model = TinyGPT(TinyGPTConfig(**RESUME_MODEL))
    opt = AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    # A private generator keeps the loader's per-epoch base-seed draw off the global RNG (dropout's).
    loader = DataLoader(SyntheticTokens(RESUME_SAMPLES, 8, 32), batch_size=RESUME_BATCH, shuffle=True,
                        generator=Generator().manual_seed(seed) if private_generator else None)
    # step_scheduler_with_optimizer steps the scheduler once per process per update: give it per-process steps.
    sched = LambdaLR(opt, lambda s: _cosine(s // acc.num_processes))
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    steps_per_epoch = len(loader) // GA
    step = 0
    if resume:
        acc.load_state(ckpt)
        step = RESUME_AT
    epoch = step // steps_per_epoch
    model.train()
    while step < RESUME_STEPS:
        if seedable:
            loader.set_epoch(epoch)
        skip = (step % steps_per_epoch) * GA if resume and epoch == RESUME_AT // steps_per_epoch else 0
        batches = acc.skip_first_batches(loader, skip) if skip else loader
        for b in batches:
            _accelerate_step(acc, model, opt, sched, b)
            if acc.sync_gradients:
                step += 1
                if step == stop_at:
                    acc.save_state(ckpt)
                    return {}
                if step == RESUME_STEPS:
                    break
        epoch += 1
    return {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}


VARIANTS = {  # name: None for kubetrain, else (use_seedable_sampler, private DataLoader generator)
    "kubetrain Trainer (ddp)": None,
    "accelerate, defaults": (False, False),
    "accelerate, seedable sampler": (True, False),
    "accelerate, seedable + private generator": (True, True),
}


def _run(variant: str, folder: str, **kw) -> dict:
    if VARIANTS[variant] is None:
        return _kubetrain_run(folder, **kw)
    seedable, private_generator = VARIANTS[variant]
    return _accelerate_run(folder, seedable=seedable, private_generator=private_generator, **kw)


def resume_first(root: str) -> dict:
    """*Per rank.* Straight runs (returned) and the runs that stop at RESUME_AT with a checkpoint."""
    straight = {}
    for i, v in enumerate(VARIANTS):
        straight[v] = _run(v, f"{root}/straight-{i}", stop_at=None, resume=False, seed=0)
        _run(v, f"{root}/{i}", stop_at=RESUME_AT, resume=False, seed=0)
    return straight


def resume_second(root: str) -> dict:
    """*Per rank.* The resumed runs' final parameters (new processes, another init seed)."""
    return {v: _run(v, f"{root}/{i}", stop_at=None, resume=True, seed=0) for i, v in enumerate(VARIANTS)}


def compare(a: dict, b: dict) -> tuple[bool, float]:
    import torch

    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    diff = max((a[k] - b[k]).abs().max().item() for k in a) if a.keys() == b.keys() else math.inf
    return same, diff


# --- main ------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="A/B rounds of the step-time part (order alternates)")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per loop (x4 when overhead-bound)")
    p.add_argument("--part", choices=("all", "steps", "resume"), default="all")
    a = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    if a.part in ("all", "steps"):
        step_part(a)
    if a.part in ("all", "resume"):
        resume_part()


def step_part(a: argparse.Namespace) -> None:
    import accelerate
    import torch

    t0 = time.monotonic()
    times = run2(step_times, a.rounds, a.steps)[0]  # rank 0; the ranks meet in every all-reduce
    print(f"accelerate {accelerate.__version__}, torch {torch.__version__}; CPU, gloo, 2 processes, 1 thread each, "
          f"gradient accumulation {GA}; {a.rounds} alternated rounds; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    for regime, by in times.items():
        for i, label in enumerate(("wall", "CPU")):
            k, x = [t[i] for t in by["kubetrain"]], [t[i] for t in by["accelerate"]]
            ratios = [b / a for a, b in zip(k, x)]
            print(f"  {regime:15s} {label:4s} step ms  kubetrain [{', '.join(f'{t * 1000:.2f}' for t in k)}]  "
                  f"accelerate [{', '.join(f'{t * 1000:.2f}' for t in x)}]")
            print(f"  {'':20s} accelerate / kubetrain: median {statistics.median(ratios):.3f}x  "
                  f"range {min(ratios):.3f}-{max(ratios):.3f}x")
    print(f"  (step-time part: {time.monotonic() - t0:.0f} s)")


def resume_part() -> None:
    t1 = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        straight = run2(resume_first, root)
        resumed = run2(resume_second, root)
    print(f"resume: {RESUME_STEPS} steps straight vs {RESUME_AT} + checkpoint + new processes + resume to "
          f"{RESUME_STEPS} (dropout 0.1, shuffled, {RESUME_SAMPLES} samples: the resume is mid-epoch)")
    for v in VARIANTS:
        rows = [compare(straight[r][v], resumed[r][v]) for r in (0, 1)]
        verdict = "bitwise equal" if all(s for s, _ in rows) else "NOT bitwise equal"
        print(f"  {v:42s} {verdict:18s} max |diff| rank 0 {rows[0][1]:.3g}, rank 1 {rows[1][1]:.3g}")
    print(f"  (resume part: {time.monotonic() - t1:.0f} s)")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "testbed"))
    main()
