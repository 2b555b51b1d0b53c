"""FSDP2 (`torch.distributed.fsdp.fully_shard`) behind the `Strategy` seam.

Why a module of its own: FSDP2 changes what a parameter *is* (a DTensor
shard), so every step that touches whole parameters — clipping, saving,
restoring, exporting the final model — needs the sharding-aware call, and the
loop must not know any of it. This module owns those calls:

- sharding: each transformer block (the elements of the model's outermost
  `nn.ModuleList`s, e.g. `model.layers` / `transformer.h`), or else each
  top-level child with parameters, then the root;
- resume checkpoints: torch.distributed.checkpoint (DCP), each rank writing its
  own shards, in the directory names the HF Trainer / Accelerate use
  (`pytorch_model_fsdp_0/`, `optimizer_0/`);
- the final model: a consolidated state dict gathered to rank 0 on CPU, checked
  for completeness against the model's own parameter names and shapes.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Literal, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from kubetrain_trainer.args import ConfigError
from kubetrain_trainer.distributed import device_for
from kubetrain_trainer.strategies.dcp_files import RankFilesWriter
from kubetrain_trainer.strategies.base import CpuStager, OptimizerFactory, Prepared, SchedulerFactory, Strategy

MODEL_DIR = "pytorch_model_fsdp_0"
"""DCP folder of the sharded model inside a checkpoint (the name Accelerate/HF use)."""
OPTIMIZER_DIR = "optimizer_0"
"""DCP folder of the sharded optimizer state inside a checkpoint."""

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class FSDPOptions:
    """FSDP2 settings (`TrainingArguments.fsdp_config`, the TrainingJob's `strategy.fsdp`)."""

    reshard_after_forward: bool = True
    """Free the gathered parameters after forward and gather them again in backward
    (ZeRO-3 memory); False keeps them until backward (ZeRO-2-like, less communication)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and the optimizer step on the CPU."""
    mixed_precision: Literal["none", "bf16", "fp16"] = "none"
    """Dtype of the gathered parameters in forward/backward; gradients are reduced in
    fp32 and the sharded master parameters stay fp32. fp16 adds a gradient scaler."""
    shard_modules: tuple[str, ...] = ()
    """Class names of the submodules to shard one by one (e.g. `("LlamaDecoderLayer",)`);
    empty: the elements of the model's outermost `nn.ModuleList`s, or else its top-level children."""

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> "FSDPOptions":
        """Build from keyword options; accepts camelCase (CRD) and snake_case names."""
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        errors = []
        for key, value in options.items():
            name = option_name(key)
            if name not in known:
                near = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f"; did you mean {near[0]!r}?" if near else f"; allowed: {', '.join(sorted(known))}"
                errors.append(f"fsdp_config: unknown option {key!r}{hint}")
                continue
            values[name] = value
        if "shard_modules" in values:
            modules = values["shard_modules"]
            values["shard_modules"] = (modules,) if isinstance(modules, str) else tuple(modules)
        if values.get("mixed_precision", "none") not in ("none", "bf16", "fp16"):
            errors.append(f"fsdp_config.mixed_precision: {values['mixed_precision']!r} is not one of none, bf16, fp16")
        for flag in ("reshard_after_forward", "cpu_offload"):
            if flag in values and not isinstance(values[flag], bool):
                errors.append(f"fsdp_config.{flag}: expected true or false, got {values[flag]!r}")
        if errors:
            raise ConfigError("; ".join(errors))
        return cls(**values)


def option_name(key: str) -> str:
    """An FSDP option's field name: the CRD's camelCase (`cpuOffload`) or already snake_case."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


def modules_to_shard(model: nn.Module, class_names: tuple[str, ...] = ()) -> list[nn.Module]:
    """The submodules that get their own FSDP group, in bottom-up (post-)order.

    A module whose parameters are shared with the rest of the model (tied
    embeddings) is left to the root group: one parameter can belong to one
    FSDP group only.
    """
    if class_names:
        picked = [m for m in model.modules() if m is not model and type(m).__name__ in class_names]
    else:
        picked, taken = [], set()
        for name, module in model.named_modules():
            if any(name == t or name.startswith(t + ".") for t in taken):
                continue  # inside a block already picked: its parameters go with that block
            if isinstance(module, nn.ModuleList):
                picked.extend(module)
                taken.add(name)
        if not picked:
            picked = [c for c in model.children() if any(True for _ in c.parameters())]
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1

    def self_contained(m: nn.Module) -> bool:
        inner: dict[int, int] = {}
        for _, p in m.named_parameters(remove_duplicate=False):
            inner[id(p)] = inner.get(id(p), 0) + 1
        return bool(inner) and all(uses[k] == n for k, n in inner.items())

    picked = [m for m in picked if self_contained(m)]
    # fully_shard must run bottom-up: deeper modules first.
    depth = {id(m): name.count(".") + 1 for name, m in model.named_modules() if name}
    return sorted(picked, key=lambda m: -depth[id(m)])


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> global shape of every state-dict entry (DTensor shards report the full shape)."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def check_complete(state_dict: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]]) -> None:
    """Raise if `state_dict` lacks an entry of `expected` or has one of another shape."""
    missing = sorted(set(expected) - set(state_dict))
    wrong = sorted(
        f"{k}: {tuple(state_dict[k].shape)} != {shape}"
        for k, shape in expected.items()
        if k in state_dict and tuple(state_dict[k].shape) != shape
    )
    if missing or wrong:
        raise RuntimeError(
            "consolidated state dict is incomplete: "
            + (f"missing {missing[:10]}{' ...' if len(missing) > 10 else ''} " if missing else "")
            + (f"wrong shapes {wrong[:10]}" if wrong else "")
        )


def ensure_process_group() -> None:
    """FSDP needs a process group even on one process: make a private one-rank group."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class FSDPStrategy(Strategy):
    """Fully sharded data parallel (FSDP2): parameters, gradients and optimizer state sharded on dim 0."""

    name: ClassVar[str] = "fsdp"

    def __init__(self, **options: Any) -> None:
        """`options`: `FSDPOptions` fields; none given: `args.fsdp_config` at `prepare`."""
        self.options = FSDPOptions.from_dict(options)
        self._explicit = bool(options)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler: Any = None
        self._save_groups: tuple[Any, Any] | None = None
        self._stage = CpuStager()

    # --- setup ---------------------------------------------------------------------
    @staticmethod
    def _device(args: Any) -> torch.device:
        device = device_for(getattr(args, "use_cpu", False))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device

    def prepare(
        self,
        model: nn.Module,
        *,
        args: Any,
        num_training_steps: int,
        create_optimizer: OptimizerFactory,
        create_scheduler: SchedulerFactory,
    ) -> Prepared:
        if not self._explicit and getattr(args, "fsdp_config", None):
            self.options = FSDPOptions.from_dict(args.fsdp_config)
        ensure_process_group()
        device = self._device(args)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        opts = self.options
        offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if opts.cpu_offload else OffloadPolicy()
        if opts.mixed_precision == "none":
            mp = MixedPrecisionPolicy()
        else:
            # Reduce in fp32: summing low-precision gradients over ranks loses bits for nothing.
            mp = MixedPrecisionPolicy(param_dtype=_DTYPES[opts.mixed_precision], reduce_dtype=torch.float32)
        if not opts.cpu_offload:
            model.to(device)
        shard = dict(mesh=mesh, reshard_after_forward=opts.reshard_after_forward, mp_policy=mp, offload_policy=offload)
        blocks = modules_to_shard(model, opts.shard_modules)
        if opts.shard_modules and not blocks:
            raise ConfigError(f"fsdp_config.shard_modules: no submodule of class {list(opts.shard_modules)} in the model")
        for block in blocks:
            fully_shard(block, **shard)
        fully_shard(model, **shard)
        self.model = model
        # The optimizer must see the sharded (DTensor) parameters, so it is built after sharding.
        self.optimizer = create_optimizer(model)
        if opts.mixed_precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=device.type)
        scheduler = create_scheduler(self.optimizer)
        return Prepared(model=model, optimizer=self.optimizer, lr_scheduler=scheduler)

    # --- the step ------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    @contextlib.contextmanager
    def no_sync(self, enabled: bool) -> Iterator[None]:
        # FSDP2 keeps the unsharded gradients and reduce-scatters them on the first synced backward.
        model = self._fsdp_model()
        model.set_requires_gradient_sync(not enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        assert self.optimizer is not None, "prepare() first"
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if max_norm and max_norm > 0 and max_norm != float("inf"):
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        else:  # clipping disabled: the norm is still wanted for logging
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        # The norm of DTensor gradients is a partial DTensor: full_tensor() all-reduces it.
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def optimizer_step(self, stepped: Callable[[], None] | None = None) -> None:
        assert self.optimizer is not None, "prepare() first"
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if stepped is not None:
            stepped()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        assert self.optimizer is not None, "prepare() first"
        if self.scaler is not None:
            # Let the scaler see this step's gradients: an fp16 overflow lowers the scale.
            self.scaler.unscale_(self.optimizer)
            self.scaler.update()
        # Called after the synced (last) micro-batch: every gradient is in the sharded .grad.
        self.optimizer.zero_grad(set_to_none=True)

    # --- checkpoints -----------------------------------------------------------------
    def save_checkpoint(self, directory: Path) -> None:
        model, optimizer = self._fsdp_model(), self.optimizer
        directory = Path(directory)
        # Each rank's proper shards in files of their own, so a restore fetches only its node's (dcp_files.py).
        dcp.save({"model": get_model_state_dict(model)}, storage_writer=RankFilesWriter(directory / MODEL_DIR))
        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)},
                 storage_writer=RankFilesWriter(directory / OPTIMIZER_DIR))
        if self.scaler is not None and dist.get_rank() == 0:
            torch.save(self.scaler.state_dict(), directory / "scaler.pt")

    def stage_checkpoint(self, directory: Path) -> Callable[[], None]:
        """DCP's own `async_save`: it copies the shards to CPU memory now and writes them in a thread."""
        model, optimizer = self._fsdp_model(), self.optimizer
        directory = Path(directory)
        if self._save_groups is None:  # collective, once: one gloo group per background save, not the loop's
            self._save_groups = (dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
        stager = self._stage.default_stager()  # ours, so its CPU copies are reused from save to save
        futures = [
            dcp.async_save({"model": get_model_state_dict(model)}, storage_writer=RankFilesWriter(directory / MODEL_DIR),
                           process_group=self._save_groups[0], async_stager=stager),
            dcp.async_save({"optimizer": get_optimizer_state_dict(model, optimizer)},
                           storage_writer=RankFilesWriter(directory / OPTIMIZER_DIR), process_group=self._save_groups[1],
                           async_stager=stager),
        ]
        if self.scaler is not None and dist.get_rank() == 0:
            torch.save(self.scaler.state_dict(), directory / "scaler.pt")
        return lambda: [f.result() for f in futures]  # type: ignore[union-attr]

    def can_load_checkpoint(self, directory: Path) -> bool:
        return all((Path(directory) / sub / ".metadata").is_file() for sub in (MODEL_DIR, OPTIMIZER_DIR))

    def load_checkpoint(self, directory: Path) -> None:
        model, optimizer = self._fsdp_model(), self.optimizer
        directory = Path(directory)
        for sub in (MODEL_DIR, OPTIMIZER_DIR):
            if not (directory / sub / ".metadata").is_file():
                raise FileNotFoundError(f"{directory / sub}: no FSDP (DCP) checkpoint there (missing .metadata)")
        # DCP loads in place into tensors of the right sharding: start from the live state dicts.
        model_sd = {"model": get_model_state_dict(model)}
        dcp.load(model_sd, checkpoint_id=directory / MODEL_DIR)
        set_model_state_dict(model, model_sd["model"])
        optim_sd = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(optim_sd, checkpoint_id=directory / OPTIMIZER_DIR)
        set_optimizer_state_dict(model, optimizer, optim_sd["optimizer"])
        if self.scaler is not None and (directory / "scaler.pt").is_file():
            self.scaler.load_state_dict(torch.load(directory / "scaler.pt", weights_only=True))

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        model = self._fsdp_model()
        expected = expected_shapes(model)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() != 0:
            return None
        check_complete(state, expected)
        # Own the memory: tied entries would otherwise share storage (safetensors refuses that).
        return {k: v.detach().clone() for k, v in state.items()}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        check_complete(state_dict, expected_shapes(self._fsdp_model()))
        set_model_state_dict(self._fsdp_model(), state_dict, options=StateDictOptions(full_state_dict=True))

    def unwrap(self) -> nn.Module:
        # fully_shard works in place: the user's module is the wrapped one (its class is
        # swapped for an FSDP subclass, its parameters are DTensor shards).
        return self._fsdp_model()

    def _fsdp_model(self) -> Any:
        if not isinstance(self.model, FSDPModule):
            raise RuntimeError("FSDPStrategy: call prepare() first")
        return self.model
