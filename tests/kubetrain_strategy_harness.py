"""Test harness for the sharded strategies: real process groups, real training, no mocks.

It lives under tests/ (never in the trainer image) and at its top level:
tests/conftest.py puts tests/ on sys.path, and `spawn`ed children inherit
the parent's sys.path, so they import the function they run by this module's
name. It holds a launcher (`run_distributed`: N processes, gloo, a fresh port
from the testbed's `free_port`, every child's traceback surfaced), a tiny
transformer-shaped model, deterministic batches, and a worker that drives any
`Strategy` through the same calls as the Trainer (no_sync on all but the last
micro-batch, clip, step, scheduler).
"""

from __future__ import annotations

import faulthandler
import math
import os
import pickle
import queue as queue_module
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kubetrain_testbed import free_port

VOCAB, DIM, LAYERS, SEQ, BATCH = 37, 24, 2, 8, 4


# --- processes -------------------------------------------------------------------------
def _entry(fn: Callable, rank: int, world_size: int, port: int, args: tuple, results: Any) -> None:
    # The torchrun contract, so DeepSpeed and the Trainer see what they see in a pod.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints where a hung rank is
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle bytes: torch's queue pickler would pass tensors as file descriptors,
        # which die with this process.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - every failure, SystemExit too, goes to the parent as a traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, *args: Any, world_size: int = 2, timeout: float = 420.0) -> list[Any]:
    """Run `fn(*args)` in `world_size` fresh processes joined by gloo; return each rank's result.

    Raises with every failing rank's traceback, or when a child dies or the run exceeds `timeout`.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    problem = None
    try:
        while len(done) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
                done[rank] = (ok, payload)
                if not ok:
                    deadline = min(deadline, time.monotonic() + 20)  # peers may hang in a collective
                continue
            except queue_module.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in done]
            if dead:
                time.sleep(1.0)  # a result may still be in the pipe
                while True:
                    try:
                        rank, ok, payload = results.get_nowait()
                        done[rank] = (ok, payload)
                    except queue_module.Empty:
                        break
                dead = [r for r in dead if r not in done]
                if dead:
                    problem = f"rank(s) {dead} died with exit code(s) {[procs[r].exitcode for r in dead]}"
                    break
            if time.monotonic() > deadline:
                problem = f"timed out after {timeout:.0f}s; finished ranks: {sorted(done)}"
                break
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    failures = [f"--- rank {r} ---\n{payload}" for r, (ok, payload) in sorted(done.items()) if not ok]
    if problem or failures:
        raise RuntimeError("distributed run failed: " + (problem or "") + "\n" + "\n".join(failures))
    return [pickle.loads(done[r][1]) for r in range(world_size)]


# --- model and data --------------------------------------------------------------------
class TinyBlock(nn.Module):
    """Pre-norm MLP block with a residual: a transformer block without attention."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, a ModuleList of blocks, a head; odd sizes so shards are uneven; one buffer."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TinyBlock(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("logit_scale", torch.tensor([0.5]))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        h = self.embed(input_ids)
        for block in self.layers:
            h = block(h)
        logits = self.head(self.norm(h)) * (2 * self.logit_scale)
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic micro-batch: the same for a given (step, rank, micro) in every run."""
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * rank + micro)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, (3 * x + 1) % VOCAB  # a token-wise map: learnable in a few steps


def probe_input() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


# --- the worker ------------------------------------------------------------------------
@dataclass
class RunSpec:
    """One training run of the worker (picklable: it crosses into the children)."""

    strategy: str
    """`fsdp` or `zero3` (or `ddp`)."""
    out: str
    """A folder for checkpoints and exported files."""
    options: dict = field(default_factory=dict)
    """Keyword options of the strategy."""
    total_steps: int = 6
    """Steps the schedule is planned for."""
    start: int = 0
    stop: int | None = None
    """Train steps [start, stop) (stop None: total_steps)."""
    gas: int = 1
    """Micro-batches per step."""
    skip_at: int | None = None
    """At this step call `skip_step` instead of clip + `optimizer_step` (the NaN-loss path)."""
    learning_rate: float = 1e-2
    max_grad_norm: float = 1.0
    seed: int = 0
    """Initial weights (a resumed run uses another seed: its weights must come from the checkpoint)."""
    load_from: str | None = None
    save_to: str | None = None
    export: bool = False
    """Return the full state dict, the parameters gathered another way and probe outputs (rank 0)."""
    bf16: bool = False
    """`TrainingArguments.bf16` (what a DeepSpeed config's `bf16.enabled: auto` follows)."""
    then_load_full: str | None = None
    """After exporting: `load_full_state_dict` this safetensors file and export again (`reloaded`)."""


def training_args(spec: RunSpec, **overrides: Any) -> Any:
    from kubetrain_trainer.args import TrainingArguments

    values = dict(output_dir=spec.out, per_device_train_batch_size=BATCH, gradient_accumulation_steps=spec.gas,
                  learning_rate=spec.learning_rate, max_steps=spec.total_steps, max_grad_norm=spec.max_grad_norm,
                  warmup_steps=1, use_cpu=True, report_to=["none"], save_strategy="no", strategy=spec.strategy,
                  bf16=spec.bf16)
    if spec.strategy == "zero3":
        values["deepspeed"] = spec.options["config"]
    elif spec.strategy == "fsdp" and spec.options:
        values["fsdp_config"] = dict(spec.options)
    values.update(overrides)
    return TrainingArguments(**values)


def gathered_otherwise(strategy: Any) -> dict[str, torch.Tensor] | None:
    """*Collective.* Every parameter and buffer, gathered without `full_state_dict` (rank 0)."""
    module = strategy.unwrap()
    out: dict[str, torch.Tensor] = {}
    if strategy.name == "zero3":
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        for name, tensor in module.state_dict(keep_vars=True).items():
            if hasattr(tensor, "ds_id"):
                with GatheredParameters([tensor]):
                    out[name] = tensor.data.detach().clone()
            else:
                out[name] = tensor.detach().clone()
    else:
        from torch.distributed.tensor import DTensor

        for name, tensor in module.state_dict().items():
            out[name] = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()
    return out if dist.get_rank() == 0 else None


def train_worker(spec: RunSpec) -> dict[str, Any]:
    """Build, prepare, maybe load, train [start, stop), maybe save and export; report losses."""
    from kubetrain_trainer import optim
    from kubetrain_trainer.strategies import get_strategy

    rank, world = dist.get_rank(), dist.get_world_size()
    args = training_args(spec)
    torch.manual_seed(spec.seed)
    model = TinyLM()
    strategy = get_strategy(spec.strategy, **spec.options)
    prepared = strategy.prepare(
        model, args=args, num_training_steps=spec.total_steps,
        create_optimizer=lambda m: optim.create_optimizer(m, args),
        create_scheduler=lambda o: optim.create_scheduler(o, args, spec.total_steps))
    wrapped, scheduler = prepared.model, prepared.lr_scheduler
    if spec.load_from:  # "{rank}" in it: each rank its own folder, as each node restores its own
        load_from = Path(spec.load_from.format(rank=rank))
        strategy.load_checkpoint(load_from)
        scheduler.load_state_dict(torch.load(load_from / f"scheduler_rank{rank}.pt", weights_only=False))
    losses, norms, lrs = [], [], []
    wrapped.train()
    for step in range(spec.start, spec.total_steps if spec.stop is None else spec.stop):
        step_loss = torch.zeros(())
        for micro in range(spec.gas):
            x, y = batch(step, rank, micro)
            with strategy.no_sync(micro < spec.gas - 1):
                loss = wrapped(x, y) / spec.gas
                strategy.backward(loss)
            step_loss += loss.detach().float()
        if step == spec.skip_at:
            strategy.skip_step()
            norm = torch.tensor(float("nan"))
        else:
            norm = strategy.clip_grad_norm(spec.max_grad_norm)
            strategy.optimizer_step()
        lrs.append(scheduler.get_last_lr()[0])
        scheduler.step()
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
        norms.append(float(norm))
    result: dict[str, Any] = {"losses": losses, "grad_norms": norms, "lrs": lrs}
    if spec.save_to:
        directory = Path(spec.save_to)
        directory.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        strategy.save_checkpoint(directory)
        torch.save(scheduler.state_dict(), directory / f"scheduler_rank{rank}.pt")
    if spec.export:
        full = strategy.full_state_dict()
        other = gathered_otherwise(strategy)
        wrapped.eval()
        with torch.no_grad():
            probe = wrapped(probe_input()).detach().clone()
        result.update(full=full, other=other, probe=probe if rank == 0 else None, full_is_none=full is None)
    if spec.then_load_full:
        from safetensors.torch import load_file

        strategy.load_full_state_dict(load_file(spec.then_load_full))
        result["reloaded"] = strategy.full_state_dict()
    dist.barrier()
    return result


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((x.float() - b[k].float()).abs().max().item() for k, x in a.items()) if a else math.nan


def reference_run(spec: RunSpec, world_size: int = 2) -> dict[str, Any]:
    """The same training in this one process, unsharded: the ranks' micro-batches averaged by hand."""
    from kubetrain_trainer import optim

    args = training_args(spec)
    torch.manual_seed(spec.seed)
    model = TinyLM()
    optimizer = optim.create_optimizer(model, args)
    scheduler = optim.create_scheduler(optimizer, args, spec.total_steps)
    losses, norms = [], []
    for step in range(spec.start, spec.total_steps if spec.stop is None else spec.stop):
        step_loss = 0.0
        for rank in range(world_size):
            for micro in range(spec.gas):
                x, y = batch(step, rank, micro)
                loss = model(x, y) / (spec.gas * world_size)
                loss.backward()
                step_loss += loss.item()
        if step == spec.skip_at:
            norms.append(float("nan"))
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)))
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(step_loss)
    with torch.no_grad():
        probe = model.eval()(probe_input())
    return {"losses": losses, "grad_norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "probe": probe}


# --- the Trainer, end to end -----------------------------------------------------------
@dataclass
class TrainerSpec:
    """One `Trainer.train()` of the built-in tiny GPT (picklable)."""

    strategy: str
    out: str
    options: dict = field(default_factory=dict)
    """`fsdp_config`, or {"config": <DeepSpeed config>}."""
    max_steps: int = 6
    stop_at: int | None = None
    """Stop cleanly after this step (its checkpoint written), as an interrupted run would have."""
    resume: bool | str | None = None
    init_seed: int = 0
    async_save: bool = False
    hold_writes: bool = False
    """With async_save: each checkpoint's background write waits until the loop waits for it (training moves on first)."""
    bf16: bool = False
    gpt2: bool = False
    """A tiny transformers GPT-2 (saved by its own save_pretrained) instead of the built-in tiny GPT."""


def hold_background_writes(trainer) -> None:
    """Hold each staged checkpoint's writer until the loop next waits for the save in flight."""
    import threading

    gates: list = []
    stage, wait = trainer.strategy.stage_checkpoint, trainer._saves.wait

    def held_stage(directory):
        write, gate = stage(directory), threading.Event()
        gates.append(gate)
        return lambda: (gate.wait(), write())

    def releasing_wait():
        for gate in gates:
            gate.set()
        return wait()
    trainer.strategy.stage_checkpoint = held_stage
    trainer._saves.wait = releasing_wait


def trainer_worker(spec: TrainerSpec) -> dict[str, Any]:
    """Train with the real `Trainer` and save the final model to `<out>/final`; report the history."""
    from kubetrain_trainer import Trainer, TrainerCallback, TrainingArguments
    from kubetrain_trainer.models import SyntheticTokens, TinyGPT, TinyGPTConfig
    from kubetrain_trainer.rng import set_seed

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if spec.stop_at == state.global_step:
                control.should_training_stop = True

    set_seed(spec.init_seed)
    if spec.gpt2:
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2))
    else:
        model = TinyGPT(TinyGPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2, dropout=0.1))
    extra = {"deepspeed": spec.options["config"]} if spec.strategy == "zero3" else {"fsdp_config": spec.options or None}
    args = TrainingArguments(output_dir=spec.out, max_steps=spec.max_steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=1e-2, weight_decay=0.1, warmup_steps=2,
                             lr_scheduler_type="cosine", logging_steps=1, save_steps=3, disable_tqdm=True,
                             report_to=["none"], use_cpu=True, strategy=spec.strategy, async_save=spec.async_save,
                             bf16=spec.bf16, **extra)
    trainer = Trainer(model=model, args=args, train_dataset=SyntheticTokens(40, 8, 32), callbacks=[StopAt()])
    if spec.hold_writes:
        hold_background_writes(trainer)
    output = trainer.train(resume_from_checkpoint=spec.resume)
    trainer.save_model(str(Path(spec.out) / "final"))
    return {"history": trainer.state.log_history, "global_step": output.global_step}
