"""The one seam between the training loop and a distributed strategy.

The `Trainer` never branches on DDP / FSDP / ZeRO-3: it asks a `Strategy` to
wrap the model, run backward, clip, step, and save or load what a resume
needs. Each strategy lives in its own module (`ddp.py`, `fsdp.py`,
`zero3.py`) and is picked by name through `get_strategy`.

Collective methods (marked *collective*) must be called on every rank in the
same order; the others are local.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch import nn


@dataclass
class Prepared:
    """What `Strategy.prepare` hands back to the loop."""

    model: nn.Module
    """The wrapped model: call it for forward passes."""
    optimizer: Any
    """A torch optimizer, or an engine-owned one (DeepSpeed)."""
    lr_scheduler: Any
    """A torch LR scheduler (stepped by the loop once per optimizer step)."""


OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
"""Builds the optimizer for the (already wrapped/sharded) model's parameters."""
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
"""Builds the LR scheduler for an optimizer."""


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """What reading `path` raises carries its name (a note, the exception itself unchanged)."""
    try:
        yield
    except Exception as exc:  # re-raised as it is, with a note
        exc.add_note(f"while reading {path}")
        raise


class StateDictMismatch(RuntimeError):
    """A checkpoint's model weights do not fit the model (other names or shapes): another model saved it."""


class Strategy(ABC):
    """A distributed training strategy. One instance per process and run."""

    name: ClassVar[str]
    loads_locally: ClassVar[bool] = False
    """Whether `load_checkpoint` only reads this rank's files (no collective): its failure is this folder's."""

    @abstractmethod
    def prepare(
        self,
        model: nn.Module,
        *,
        args: Any,
        num_training_steps: int,
        create_optimizer: OptimizerFactory,
        create_scheduler: SchedulerFactory,
    ) -> Prepared:
        """*Collective.* Move/wrap/shard the model and build optimizer and scheduler.

        `args` is the `TrainingArguments`; `num_training_steps` the optimizer
        steps the run plans (the Trainer's max_steps, known from the
        dataloader when only num_train_epochs is set), which a schedule
        spans. The process group is already initialised (or the world size is 1).
        """

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass for one micro-batch (the loss is already scaled for accumulation)."""

    @abstractmethod
    def no_sync(self, enabled: bool):
        """Context manager: skip gradient synchronisation while `enabled` (accumulation micro-steps)."""

    @abstractmethod
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """*Collective.* Clip gradients to `max_norm` (global norm) and return the total norm before clipping."""

    @abstractmethod
    def optimizer_step(self, stepped: Callable[[], None] | None = None) -> None:
        """Apply the update and zero the gradients; `stepped()` runs in between (HF's `on_optimizer_step`)."""

    @abstractmethod
    def skip_step(self) -> None:
        """Drop the accumulated gradients without updating (NaN/inf loss handling)."""

    @abstractmethod
    def save_checkpoint(self, directory: Path) -> None:
        """*Collective.* Write model and optimizer state for resume into `directory`.

        The scheduler, RNG and trainer state are saved by the caller; this
        writes only what is sharded or engine-owned. `directory` exists on every rank.
        """

    def stage_checkpoint(self, directory: Path) -> Callable[[], None]:
        """*Collective.* For `async_save`: capture what `save_checkpoint` writes and return the writer that
        writes it later, on another thread, using no collective of the default process group.

        What is captured must not change when training goes on (a copy in fresh CPU memory). This
        default writes at once and returns a writer with nothing left to do.
        """
        self.save_checkpoint(directory)
        return _nothing_left

    @abstractmethod
    def load_checkpoint(self, directory: Path) -> None:
        """*Collective.* Restore what `save_checkpoint` wrote."""

    def can_load_checkpoint(self, directory: Path) -> bool:
        """Whether what `load_checkpoint` reads on this rank is in `directory`. Nodes that share no disk each
        hold only what their own ranks wrote (world rank 0 writes what is not sharded): a node's committed
        folder can lack it."""
        return Path(directory).is_dir()

    def load_model_from_main_rank(self, directory: Path) -> bool:
        """*Collective.* Load the model weights in `directory` on world rank 0 and send them to every rank (for a
        folder only rank 0's node holds whole); False, doing nothing, where this strategy cannot."""
        return False

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """*Collective.* The consolidated model state dict on rank 0 (CPU tensors), None elsewhere.

        Never silently incomplete: raise if a parameter cannot be gathered.
        """

    @abstractmethod
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """*Collective.* Load a consolidated state dict (given on every rank) into the wrapped model."""

    @abstractmethod
    def unwrap(self) -> nn.Module:
        """The user's module underneath the wrappers (for config, saving, eval)."""


def _nothing_left() -> None:
    return None


class CpuStager:
    """Copies of state dicts in CPU memory that training can change under, by DCP's own stager (`DefaultStager`,
    synchronous): containers are deep-copied, tensors that share a storage still share one, and each source
    storage's copy is kept and overwritten at the next save (free again by then: a save first waits for the
    write in flight), so only the first save pays for allocating it."""

    def __init__(self) -> None:
        self._stager: Any = None

    def default_stager(self) -> Any:
        """The `torch.distributed.checkpoint.staging.DefaultStager` behind it (DCP's `async_stager`)."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=False))
        return self._stager

    def __call__(self, state: Any) -> Any:
        return self.default_stager().stage(state)


_REGISTRY: dict[str, str] = {
    "ddp": "kubetrain_trainer.strategies.ddp:DDPStrategy",
    "fsdp": "kubetrain_trainer.strategies.fsdp:FSDPStrategy",
    "zero3": "kubetrain_trainer.strategies.zero3:Zero3Strategy",
}


def strategy_names() -> list[str]:
    return sorted(_REGISTRY)


def get_strategy(name: str, **options: Any) -> Strategy:
    """Instantiate the strategy registered as `name` (`ddp`, `fsdp`, `zero3`)."""
    if name not in _REGISTRY:
        raise ValueError(f"strategy: unknown value {name!r}; allowed: {', '.join(strategy_names())}")
    import importlib

    module_name, class_name = _REGISTRY[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**options)
