"""DDP: every rank holds the whole model; gradients are averaged in backward.

With a world size of one the model is not wrapped at all, so single-process
training pays nothing for the strategy seam. Checkpoints hold the full model
(`model.safetensors`) and optimizer (`optimizer.pt`), written by rank 0 and
read by every rank. fp16 uses a gradient scaler, whose state is saved too.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import clip_grad_norm_

from .. import distributed as dist_util
from ..adam_step import DirectAdamStep
from ..optim import step_groups_at_once
from .base import CpuStager, OptimizerFactory, Prepared, SchedulerFactory, StateDictMismatch, Strategy, reading

WEIGHTS_NAME = "model.safetensors"
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
OPTIMIZER_NAME = "optimizer.pt"
SCALER_NAME = "scaler.pt"
_NO_CONTEXT = contextlib.nullcontext()  # reusable: entering it does nothing


def safetensors_ready(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two entries sharing storage (safetensors refuses tied tensors)."""
    seen: set[int] = set()
    out = {}
    for key, value in state_dict.items():
        t = value.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[key] = t
    return out


class DDPStrategy(Strategy):
    name = "ddp"
    loads_locally = True

    def __init__(self) -> None:
        self._module: nn.Module | None = None
        self._params: list[nn.Parameter] = []
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scaler: torch.amp.GradScaler | None = None
        self._safetensors = True
        self.device = torch.device("cpu")
        self._stage = CpuStager()
        self._direct = DirectAdamStep()

    def prepare(self, model: nn.Module, *, args: Any, num_training_steps: int, create_optimizer: OptimizerFactory,
                create_scheduler: SchedulerFactory) -> Prepared:
        self.device = dist_util.device_for(args.use_cpu)
        self._safetensors = args.save_safetensors
        self._module = model.to(self.device)
        self._params = list(self._module.parameters())  # clipped each step: not re-walked every step
        if dist_util.world_size() > 1:
            self._model = DistributedDataParallel(
                model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=bool(args.ddp_find_unused_parameters),
            )
        else:
            self._model = model
        self._optimizer = create_optimizer(self._module)
        scheduler = create_scheduler(self._optimizer)
        if args.fp16:
            self._scaler = torch.amp.GradScaler(self.device.type)
        return Prepared(model=self._model, optimizer=self._optimizer, lr_scheduler=scheduler)

    def backward(self, loss: torch.Tensor) -> None:
        (self._scaler.scale(loss) if self._scaler else loss).backward()

    def no_sync(self, enabled: bool):
        if enabled and isinstance(self._model, DistributedDataParallel):
            return self._model.no_sync()
        return _NO_CONTEXT

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if self._scaler:
            self._scaler.unscale_(self._optimizer)
        # max_norm <= 0 means "do not clip": an infinite bound still yields the norm for logging.
        bound = max_norm if max_norm and max_norm > 0 else float("inf")
        return clip_grad_norm_(self._params, bound)  # it skips parameters without a gradient

    def optimizer_step(self, stepped: Callable[[], None] | None = None) -> None:
        if self._scaler:
            self._scaler.step(self._optimizer)
            self._scaler.update()
        elif self._direct.step(self._optimizer):  # a fused Adam/AdamW: its kernel called straight, same bits
            pass
        elif (merged := step_groups_at_once(self._optimizer)) is not None:
            groups, self._optimizer.param_groups = self._optimizer.param_groups, merged
            try:
                self._optimizer.step()
            finally:
                self._optimizer.param_groups = groups
        else:
            self._optimizer.step()
        if stepped is not None:
            stepped()
        self._optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        self._optimizer.zero_grad(set_to_none=True)

    def save_checkpoint(self, directory: Path) -> None:
        if dist_util.rank() != 0:
            return  # replicas hold identical copies
        self._write(Path(directory), self._module.state_dict(), self._optimizer.state_dict(),
                    self._scaler.state_dict() if self._scaler else None)

    def stage_checkpoint(self, directory: Path) -> Callable[[], None]:
        if dist_util.rank() != 0:
            return lambda: None
        # The only blocked part of an async save: a copy of the weights and the optimizer state in CPU memory.
        staged = (self._stage(self._module.state_dict()), self._stage(self._optimizer.state_dict()),
                  self._scaler.state_dict() if self._scaler else None)
        return functools.partial(self._write, Path(directory), *staged)

    def _write(self, directory: Path, state: dict, optimizer_state: dict, scaler_state: dict | None) -> None:
        if self._safetensors:
            save_file(safetensors_ready(state), str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
        else:
            torch.save(state, directory / PICKLE_WEIGHTS_NAME)
        torch.save(optimizer_state, directory / OPTIMIZER_NAME)
        if scaler_state is not None:
            torch.save(scaler_state, directory / SCALER_NAME)

    def load_checkpoint(self, directory: Path) -> None:
        directory = Path(directory)
        load_weights(self._module, self._read_weights(directory))
        if (directory / OPTIMIZER_NAME).is_file():
            self._direct.forget()  # it holds the state this load replaces (load_best_model_at_end: no step follows)
            with reading(directory / OPTIMIZER_NAME):
                self._optimizer.load_state_dict(torch.load(directory / OPTIMIZER_NAME, map_location=self.device,
                                                           weights_only=True))
        if self._scaler and (directory / SCALER_NAME).is_file():
            with reading(directory / SCALER_NAME):
                self._scaler.load_state_dict(torch.load(directory / SCALER_NAME, weights_only=True))

    def can_load_checkpoint(self, directory: Path) -> bool:
        return (Path(directory) / WEIGHTS_NAME).is_file() or (Path(directory) / PICKLE_WEIGHTS_NAME).is_file()

    def load_model_from_main_rank(self, directory: Path) -> bool:
        if dist_util.rank() == 0:
            load_weights(self._module, self._read_weights(Path(directory)))
        if dist_util.world_size() > 1:
            with torch.no_grad():  # the replicas are the same model: rank 0's tensors, in place, everywhere
                for tensor in self._module.state_dict().values():
                    torch.distributed.broadcast(tensor, src=0)
        return True

    def _read_weights(self, directory: Path) -> dict[str, torch.Tensor]:
        if (directory / WEIGHTS_NAME).is_file():
            with reading(directory / WEIGHTS_NAME):
                return load_file(str(directory / WEIGHTS_NAME), device=str(self.device))
        if (directory / PICKLE_WEIGHTS_NAME).is_file():
            with reading(directory / PICKLE_WEIGHTS_NAME):
                return torch.load(directory / PICKLE_WEIGHTS_NAME, map_location=self.device, weights_only=True)
        raise FileNotFoundError(f"{directory}: no {WEIGHTS_NAME} or {PICKLE_WEIGHTS_NAME}")

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        if dist_util.rank() != 0:
            return None
        return {k: v.detach().cpu() for k, v in self._module.state_dict().items()}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self._module.load_state_dict(state_dict)

    def unwrap(self) -> nn.Module:
        return self._module


def load_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """`module.load_state_dict(weights)`, where a tied weight the file holds once is no missing key: the HF Trainer
    (and `save_pretrained`) saves GPT-2's `lm_head.weight` only as `transformer.wte.weight`, and a strict load
    refused its checkpoints as another model's. StateDictMismatch for anything else missing, unexpected or
    differently shaped."""
    try:
        missing, unexpected = module.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # differently shaped entries
        raise StateDictMismatch(str(exc)) from exc
    own = module.state_dict()

    def view(t: torch.Tensor) -> tuple:  # the same tensor under another name: a tie, not a part of one
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
    loaded = {view(own[k]) for k in weights if k in own and own[k].numel()}
    missing = [k for k in missing if not own[k].numel() or view(own[k]) not in loaded]
    if missing or unexpected:
        raise StateDictMismatch(f"Error(s) in loading state_dict for {type(module).__name__}: Missing key(s) in "
                                f"state_dict: {missing[:8]}; Unexpected key(s) in state_dict: {unexpected[:8]}")
