"""DeepSpeed ZeRO-3 behind the `Strategy` seam.

Why a module of its own: with ZeRO-3 the DeepSpeed engine owns the
parameters (partitioned), the fp32 master weights, the gradient partitions
and the optimizer step. The loop must drive it only through the engine, and
the user's DeepSpeed config is passed through with its "auto" values filled
from `TrainingArguments` (the HF convention), so the two can never disagree.

How the loop and the engine share the work (decided here, nowhere else):

- Gradient accumulation belongs to the loop. The config gets
  `managed_gradient_accumulation: false`: `backward` only accumulates
  partitioned gradients (the loop has already divided the loss by the number
  of micro-batches, so the engine must not divide again: `scale_wrt_gas=False`),
  and `optimizer_step` (`engine.step()`) is the accumulation boundary. The
  config's `gradient_accumulation_steps` still equals the loop's, so the
  engine's batch-size bookkeeping matches. `no_sync` does nothing: ZeRO-3
  reduce-scatters every micro-batch's gradients into their partitions anyway.
- The LR scheduler belongs to the loop. It is built by the engine (from the
  config's "scheduler" section, else the Trainer's `create_scheduler` on the
  engine's optimizer), then taken back from the engine so it is stepped once
  per step, by the loop, like every other strategy's; the loop saves it too.
- Clipping belongs to the engine (`gradient_clipping`, filled from
  `max_grad_norm`): `clip_grad_norm` returns a 0-dim tensor that holds NaN
  until `optimizer_step`, which fills in the norm the engine measured.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from kubetrain_trainer.args import ConfigError
from kubetrain_trainer.strategies.base import CpuStager, OptimizerFactory, Prepared, SchedulerFactory, Strategy
from kubetrain_trainer.strategies.fsdp import ensure_process_group, check_complete
from kubetrain_trainer.strategies.zero3_files import Staging as _Staging
from kubetrain_trainer.strategies.zero3_files import write_rank_files

AUTO = "auto"


# --- the config ----------------------------------------------------------------------
def load_config(source: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """The DeepSpeed config from a dict or a JSON file, checked to be ZeRO stage 3."""
    if isinstance(source, Mapping):
        config = copy.deepcopy(dict(source))
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"deepspeed: config file {str(path)!r} does not exist")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"deepspeed: {str(path)!r} is not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"deepspeed: {str(path)!r} must hold a JSON object")
    check_stage3(config)
    return config


def check_stage3(config: Mapping[str, Any]) -> None:
    """Raise unless `zero_optimization.stage` is 3."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, Mapping) or "stage" not in zero:
        raise ConfigError('deepspeed: zero_optimization.stage is missing: strategy zero3 needs '
                          '"zero_optimization": {"stage": 3}')
    if zero["stage"] != 3:
        raise ConfigError(f"deepspeed: zero_optimization.stage is {zero['stage']!r}; strategy zero3 needs 3 "
                          "(use strategy ddp for ZeRO stages 0-2)")


@dataclass(frozen=True)
class AutoValues:
    """What the "auto" entries of a DeepSpeed config resolve to (from `TrainingArguments`)."""

    micro_batch_size: int
    """`train_micro_batch_size_per_gpu` <- `per_device_train_batch_size`."""
    gradient_accumulation_steps: int
    """`gradient_accumulation_steps` <- the same argument."""
    world_size: int
    """Data-parallel processes: `train_batch_size` = micro batch x accumulation x world size."""
    max_grad_norm: float
    """`gradient_clipping` (0 disables clipping)."""
    learning_rate: float
    """`optimizer.params.lr` and `scheduler.params.warmup_max_lr`."""
    betas: tuple[float, float]
    """`optimizer.params.betas` <- (`adam_beta1`, `adam_beta2`)."""
    eps: float
    """`optimizer.params.eps` <- `adam_epsilon`."""
    weight_decay: float
    """`optimizer.params.weight_decay`."""
    fp16: bool
    """`fp16.enabled`."""
    bf16: bool
    """`bf16.enabled`."""
    num_training_steps: int | None = None
    """`scheduler.params.total_num_steps`; None when not known before training."""
    warmup_steps: int | None = None
    """`scheduler.params.warmup_num_steps`; None when it depends on an unknown total."""
    hidden_size: int | None = None
    """The model's hidden size, for the size-dependent ZeRO buckets (as the HF Trainer does)."""

    @classmethod
    def from_args(cls, args: Any, *, world_size: int, num_training_steps: int | None = None,
                  hidden_size: int | None = None) -> "AutoValues":
        total = num_training_steps if num_training_steps else (args.max_steps if args.max_steps > 0 else None)
        if total is not None:
            warmup: int | None = args.warmup_for(total)
        elif args.warmup_steps >= 1 or (args.warmup_steps == 0 and args.warmup_ratio == 0):
            warmup = int(args.warmup_steps)  # an absolute count needs no total
        else:
            warmup = None
        return cls(
            micro_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            world_size=world_size,
            max_grad_norm=args.max_grad_norm,
            learning_rate=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
            fp16=args.fp16,
            bf16=args.bf16,
            num_training_steps=total,
            warmup_steps=warmup,
            hidden_size=hidden_size,
        )


class _Filler:
    """Fills or checks one config tree, collecting every disagreement before raising."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.errors: list[str] = []

    def _parent(self, path: str, create: bool) -> tuple[dict | None, str]:
        *parents, leaf = path.split(".")
        node: Any = self.config
        for key in parents:
            if not isinstance(node, dict):
                return None, leaf
            if key not in node:
                if not create:
                    return None, leaf
                node[key] = {}
            node = node[key]
        return (node if isinstance(node, dict) else None), leaf

    def match(self, path: str, value: Any, source: str, *, set_if_missing: bool = False) -> None:
        """`path` "auto" (or absent with `set_if_missing`) becomes `value`; another value must agree."""
        parent, leaf = self._parent(path, create=set_if_missing)
        if parent is None:
            return
        if leaf not in parent:
            if set_if_missing:
                parent[leaf] = value
            return
        current = parent[leaf]
        if current == AUTO:
            if value is None:
                self.errors.append(f"{path} is 'auto' but {source} is not known before training: set a number")
            else:
                parent[leaf] = value
        elif value is not None and not _same(current, value):
            self.errors.append(f"{path}={current!r} but {source}={value!r}: make them agree or set {path}: auto")

    def fill_or_drop(self, path: str, value: Any) -> None:
        """An "auto" that only tunes performance: filled when known, else left to DeepSpeed's default."""
        parent, leaf = self._parent(path, create=False)
        if parent is not None and parent.get(leaf) == AUTO:
            if value is None:
                del parent[leaf]
            else:
                parent[leaf] = value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _remaining_autos(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _remaining_autos(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if node == AUTO else []


def fill_auto(config: Mapping[str, Any], values: AutoValues) -> dict[str, Any]:
    """A copy of `config` with its "auto" values filled; pure.

    Raises `ConfigError` naming every field that is not stage 3, disagrees
    with `TrainingArguments`, or stays "auto" without a value to fill.
    """
    check_stage3(config)
    f = _Filler(copy.deepcopy(dict(config)))
    v = values
    f.match("train_micro_batch_size_per_gpu", v.micro_batch_size, "per_device_train_batch_size", set_if_missing=True)
    f.match("gradient_accumulation_steps", v.gradient_accumulation_steps, "gradient_accumulation_steps",
            set_if_missing=True)
    f.match("train_batch_size", v.micro_batch_size * v.gradient_accumulation_steps * v.world_size,
            "per_device_train_batch_size x gradient_accumulation_steps x world size", set_if_missing=True)
    f.match("gradient_clipping", v.max_grad_norm, "max_grad_norm", set_if_missing=True)
    if f.config.get("managed_gradient_accumulation", False) not in (False, AUTO):
        f.errors.append("managed_gradient_accumulation must be false (or absent): the training loop owns "
                        "gradient accumulation")
    f.config["managed_gradient_accumulation"] = False

    f.match("optimizer.params.lr", v.learning_rate, "learning_rate")
    f.match("optimizer.params.betas", list(v.betas), "adam_beta1/adam_beta2")
    f.match("optimizer.params.eps", v.eps, "adam_epsilon")
    f.match("optimizer.params.weight_decay", v.weight_decay, "weight_decay")

    f.match("scheduler.params.warmup_min_lr", 0, "the warmup start (0)")
    f.match("scheduler.params.warmup_max_lr", v.learning_rate, "learning_rate")
    f.match("scheduler.params.warmup_num_steps", v.warmup_steps, "warmup_steps/warmup_ratio (x total steps)")
    f.match("scheduler.params.total_num_steps", v.num_training_steps, "the number of training steps (max_steps)")
    scheduler = f.config.get("scheduler")
    params = scheduler.get("params") if isinstance(scheduler, dict) else None
    warmup = params.get("warmup_num_steps") if isinstance(params, dict) else None
    if isinstance(warmup, int) and warmup <= 0 and str(scheduler.get("type", "")).startswith("Warmup"):
        # DeepSpeed's warmup schedulers refuse it when the engine is built, after the model is partitioned.
        f.errors.append(f"scheduler.params.warmup_num_steps is {warmup} (with 'auto': warmup_steps/warmup_ratio "
                        f"give none): {scheduler['type']} needs at least 1 warmup step; set warmup_steps >= 1")

    f.match("fp16.enabled", v.fp16, "fp16")
    f.match("bf16.enabled", v.bf16, "bf16")
    f.match("bfloat16.enabled", v.bf16, "bf16")  # DeepSpeed's older spelling of the same section

    h = v.hidden_size
    f.fill_or_drop("zero_optimization.reduce_bucket_size", h * h if h else None)
    f.fill_or_drop("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * h * h) if h else None)
    f.fill_or_drop("zero_optimization.stage3_param_persistence_threshold", 10 * h if h else None)

    left = [p for p in _remaining_autos(f.config) if not any(p in e for e in f.errors)]
    f.errors.extend(f"{p} is 'auto' but kubetrain has no value for it: set a number" for p in left)
    if f.errors:
        raise ConfigError("deepspeed config:\n  - " + "\n  - ".join(f.errors))
    return f.config


def _hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for name in ("hidden_size", "d_model", "n_embd"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


# --- the strategy ----------------------------------------------------------------------
class Zero3Strategy(Strategy):
    """DeepSpeed ZeRO stage 3: parameters, gradients and optimizer state partitioned by the engine."""

    name: ClassVar[str] = "zero3"

    def __init__(self, config: Mapping[str, Any] | str | Path | None = None) -> None:
        """`config`: the DeepSpeed config (dict or JSON path); None: `args.deepspeed` at `prepare`."""
        self._source = config
        if config is not None:
            load_config(config)  # fail before training, not after the model is built
        self.config: dict[str, Any] | None = None
        """The filled config the engine runs with (after `prepare`)."""
        self.engine: Any = None
        self._grad_norm: torch.Tensor | None = None
        self._stage = CpuStager()

    def prepare(
        self,
        model: nn.Module,
        *,
        args: Any,
        num_training_steps: int,
        create_optimizer: OptimizerFactory,
        create_scheduler: SchedulerFactory,
    ) -> Prepared:
        import deepspeed

        source = self._source if self._source is not None else getattr(args, "deepspeed", None)
        if source is None:
            raise ConfigError("strategy zero3 needs a DeepSpeed config: set deepspeed to a JSON path or a dict")
        ensure_process_group()
        values = AutoValues.from_args(args, world_size=dist.get_world_size(),
                                      num_training_steps=num_training_steps, hidden_size=_hidden_size(model))
        self.config = fill_auto(load_config(source), values)
        # The config's optimizer/scheduler win (HF convention); else the Trainer's. A client
        # optimizer is built on the full parameters: ZeRO-3 partitions them in place afterwards.
        optimizer = None if "optimizer" in self.config else create_optimizer(model)
        scheduler = None if "scheduler" in self.config else create_scheduler
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=self.config)
        self.engine = engine
        # Take the scheduler back: the loop steps it once per step (see the module docstring).
        lr_scheduler, engine.lr_scheduler = engine.lr_scheduler, None
        return Prepared(model=engine, optimizer=engine.optimizer, lr_scheduler=lr_scheduler)

    # --- the step ------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        self._engine().backward(loss, scale_wrt_gas=False)

    @contextlib.contextmanager
    def no_sync(self, enabled: bool) -> Iterator[None]:
        yield  # ZeRO-3 partitions every micro-batch's gradients; the boundary is optimizer_step

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        engine = self._engine()
        clip = engine.gradient_clipping()
        if not _same(float(clip or 0.0), float(max_norm or 0.0)):
            raise ValueError(f"clip_grad_norm({max_norm}) but the engine clips at gradient_clipping={clip}: "
                             "fill the DeepSpeed config from the same TrainingArguments")
        self._grad_norm = torch.full((), float("nan"))
        return self._grad_norm

    def optimizer_step(self, stepped: Callable[[], None] | None = None) -> None:
        engine = self._engine()
        engine.step()  # finalises the accumulated partitions, clips, updates, zeroes the gradients (before `stepped`)
        if self._grad_norm is not None:
            norm = engine.get_global_grad_norm()
            if norm is not None:
                self._grad_norm.fill_(float(norm))
            self._grad_norm = None
        if stepped is not None:
            stepped()

    def skip_step(self) -> None:
        engine = self._engine()
        # Resets ZeRO-3's micro-step counter: the next backward overwrites the partitions.
        engine.optimizer.zero_grad(set_to_none=True)
        engine.zero_grad()
        self._grad_norm = None

    # --- checkpoints -----------------------------------------------------------------
    def save_checkpoint(self, directory: Path) -> None:
        # global_step<N>/ with per-rank optimizer partitions, and a `latest` file naming it (HF layout).
        self._engine().save_checkpoint(str(directory))
        write_rank_files(self._engine(), Path(directory))

    def stage_checkpoint(self, directory: Path) -> Callable[[], None]:
        """The engine's own save, with its checkpoint engine's `save(state, path)` turned into a CPU copy;
        the writer hands each copy to the real checkpoint engine (same files, same serialization)."""
        engine = self._engine()
        real, staged = engine.checkpoint_engine, []
        engine.checkpoint_engine = _Staging(real, staged, self._stage)
        try:
            engine.save_checkpoint(str(directory))
        finally:
            engine.checkpoint_engine = real

        def write() -> None:
            for state, path in staged:
                real.save(state, path)
            write_rank_files(engine, Path(directory))
        return write

    def can_load_checkpoint(self, directory: Path) -> bool:
        return (Path(directory) / "latest").is_file()  # written by world rank 0 (DeepSpeed's save_latest)

    def load_checkpoint(self, directory: Path) -> None:
        directory = Path(directory)
        if not (directory / "latest").is_file():
            raise FileNotFoundError(f"{directory}: no DeepSpeed checkpoint there (missing 'latest')")
        path, _ = self._engine().load_checkpoint(str(directory), load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"{directory}: DeepSpeed could not load the checkpoint")

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        engine = self._engine()
        module = engine.module
        entries = module.state_dict(keep_vars=True)
        expected = {k: tuple(getattr(t, "ds_shape", t.shape)) for k, t in entries.items()}
        rank0 = dist.get_rank() == 0
        if self.config.get("zero_optimization", {}).get("stage3_gather_16bit_weights_on_model_save"):
            state = engine._zero3_consolidated_16bit_state_dict()
        else:
            state = self._gather_fp32(entries, rank0)
        if not rank0:
            return None
        if state is None:
            raise RuntimeError("DeepSpeed returned no consolidated state dict on rank 0")
        check_complete(state, expected)
        # Own the memory: tied entries would otherwise share storage (safetensors refuses that).
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    @staticmethod
    def _gather_fp32(entries: Mapping[str, Any], rank0: bool) -> dict[str, torch.Tensor]:
        """*Collective.* fp32 master weights from the optimizer partitions (frozen ones from the model)."""
        from deepspeed.utils import safe_get_full_fp32_param
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        gathered: dict[int, torch.Tensor] = {}
        state: dict[str, torch.Tensor] = {}
        for name, tensor in entries.items():
            if not hasattr(tensor, "ds_id"):  # buffers are not partitioned
                state[name] = tensor.detach().cpu()
                continue
            if id(tensor) not in gathered:  # tied weights: gather once
                full = safe_get_full_fp32_param(tensor)  # same branch on every rank: it is collective
                if full is None:  # frozen: no fp32 master, take the model's copy
                    with GatheredParameters([tensor]):
                        full = tensor.data.detach().clone()
                gathered[id(tensor)] = full.reshape(tensor.ds_shape).cpu() if rank0 else full
            state[name] = gathered[id(tensor)]
        return state

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        from deepspeed.utils import safe_set_full_fp32_param
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        module = self._engine().module
        entries = module.state_dict(keep_vars=True)
        check_complete(state_dict, {k: tuple(getattr(t, "ds_shape", t.shape)) for k, t in entries.items()})
        rank0 = dist.get_rank() == 0
        done: set[int] = set()
        with torch.no_grad():
            for name, tensor in entries.items():
                value = state_dict[name]
                if not hasattr(tensor, "ds_id"):
                    tensor.copy_(value.to(tensor.device, tensor.dtype))
                    continue
                if id(tensor) in done:
                    continue
                done.add(id(tensor))
                # Rank 0 writes the gathered parameter; leaving the context re-partitions it everywhere.
                with GatheredParameters([tensor], modifier_rank=0):
                    if rank0:
                        tensor.data.copy_(value.to(tensor.device, tensor.dtype))
                # ...and the fp32 master the optimizer updates (every rank holds `value`: local).
                safe_set_full_fp32_param(tensor, value.to(torch.float32))

    def unwrap(self) -> nn.Module:
        return self._engine().module

    def _engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("Zero3Strategy: call prepare() first")
        return self.engine
