"""The Trainer methods HF users override, with the HF Trainer's signatures (a mixin of `Trainer`).

HF users customise a Trainer by subclassing it and overriding a handful of
methods the HF guide names. Each one here keeps the HF signature, and the loop
calls it where the HF Trainer does, so an override written for HF changes
kubetrain's training, evaluation and prediction the same way. The evaluation
side (`get_eval_dataloader`, `get_test_dataloader`, `prediction_step`,
`evaluate`, `predict`) lives in evaluation.py.

Two HF conventions need care:

- `compute_loss` has two signatures in use: the guide's
  `(model, inputs, return_outputs=False)` and the newer one with
  `num_items_in_batch`. The HF Trainer 5.x always passes `num_items_in_batch`
  and so breaks the guide's; here an override's signature is inspected (once
  per function) and the argument is passed only where it is declared. The
  same goes for `training_step`.
- `num_items_in_batch`, for a model whose loss normalises by it (a
  transformers causal LM; `counts_label_tokens`, or the settable
  `model_accepts_loss_kwargs`), is as in HF 5.x: the label tokens of the whole
  optimizer step (after the causal shift), summed over ranks
  (`average_tokens_across_devices`),
  passed to the model, which normalises its loss by it; the loss is then not
  divided by the accumulation steps, and is multiplied by the world size (the
  gradients are averaged over ranks). A step of several micro-batches of
  different lengths so trains as one batch of them would. With one
  micro-batch and one process the model's own mean is the same number, and
  nothing is counted. For any other model it is the label items of the
  micro-batch at hand (or None without "labels"), passed to an override that
  declares it; each micro-batch's loss is divided by the step's micro-batch
  count and averaged over ranks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from . import distributed as dist_util
from . import optim
from .args_accelerator import AcceleratorConfig
from .args_values import ConfigError
from .data import (EpochRelay, IterableShard, ResumableDistributedSampler, has_length, make_loader, remove_unused_columns,
                   to_device)
from .evaluation import call_model, count_items, extract_loss
from .length_grouping import BatchDealtSampler, LengthGroupedSampler, dataset_lengths

logger = logging.getLogger("kubetrain_trainer")


@functools.lru_cache(maxsize=None)
def _declares(function: Any, name: str) -> bool:
    params = inspect.signature(function).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def accepts_loss_kwargs(model: nn.Module) -> bool:
    """HF's `model_accepts_loss_kwargs`: the model says so (`accepts_loss_kwargs`), else its forward takes **kwargs."""
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def counts_label_tokens(model: nn.Module) -> bool:
    """Whether the model's loss normalises by `num_items_in_batch`: a transformers decoder whose loss is the
    causal-LM loss (labels shifted: position 0 is no target), as its `loss_function` resolves it (a class name
    without a known loss type, GPT2LMHeadModel, gets it; HF 5.x's Trainer counts those unshifted, a token per
    row too many). Any other model's loss is its own mean whatever it is passed (sequence classification, a
    plain module taking **kwargs; HF 5.17 counts for those too, and scales their loss by the accumulation steps
    and the world size), and an encoder-decoder's targets are not shifted."""
    transformers = sys.modules.get("transformers")  # a transformers model has imported it
    if transformers is None or not isinstance(model, getattr(transformers, "PreTrainedModel", ())):
        return False
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) or not accepts_loss_kwargs(model):
        return False
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return False
    return (vars(model).get("_loss_function") or LOSS_MAPPING.get(getattr(model, "loss_type", None) or "ForCausalLM")) \
        is ForCausalLMLoss


def accepts(method: Any, name: str) -> bool:
    """Whether `method` (bound or not) takes the keyword `name`; inspected once per function."""
    return _declares(getattr(method, "__func__", method), name)


class OverridableMixin:
    """Dataloader, optimizer, loss, step, logging and process-role methods of `Trainer`."""

    current_gradient_accumulation_steps: int = 1
    """Micro-batches of the step in progress (HF's name); `training_step` divides the loss by it."""
    _step_loss = None
    """`compute_loss` while train() runs, when it takes `num_items_in_batch` (checked once); else `_compute_loss`."""
    model_accepts_loss_kwargs: bool | None = None
    """HF's flag, settable: True or False says whether the step's label tokens are counted and passed as
    `num_items_in_batch` (see the module's docstring); None (default): a transformers causal LM's are."""
    _loss_kwargs = False
    """The step's label tokens are counted and passed (decided per train())."""
    _shifted_labels = False
    _count_always = False

    def _unwrapped_model(self) -> nn.Module:
        """The user's model: unwrapped from the strategy once prepared."""
        return self.strategy.unwrap() if self._prepared else self.model

    def _overrides(self, name: str) -> bool:
        """Whether this Trainer's class replaces the method `name` of this mixin."""
        return getattr(type(self), name) is not getattr(OverridableMixin, name)

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("training needs a train_dataset")
        args = self.args
        sampler, dataset, world, dispatch = None, self.train_dataset, dist_util.world_size(), 0
        drop_last, dispatch_batches = args.dataloader_drop_last, self._accelerator().dispatch_batches
        if dispatch_batches and world > 1 and not isinstance(dataset, IterableDataset):
            raise ConfigError("accelerator_config.dispatch_batches: true applies to an IterableDataset only: each rank "
                              "loads its own rows of a map-style training set (kubetrain's sampler shards it by "
                              "index, resumably); leave dispatch_batches out or set it false")
        if has_length(dataset):
            sampler = self._train_sampler(dataset, world)
        else:
            if args.group_by_length:  # as HF 5: without random access no grouping, with a warning
                logger.warning("group_by_length is ignored: the training data has no length (an IterableDataset); "
                               "its rows are trained in the order it yields them")
            if isinstance(dataset, IterableDataset):  # as HF: its loader gets no drop_last (nor accelerate's shard)
                if drop_last:
                    logger.warning("dataloader_drop_last is ignored for an IterableDataset, as HF ignores it: the "
                                   "short last batch of each pass over it is trained")
                drop_last = False
            if isinstance(dataset, IterableDataset) and world > 1:  # each rank its batches, as HF (not all of them),
                # read by rank 0 only, which deals them (HF's default, `dispatch_batches`), or by every rank (false)
                dispatch = 0 if dispatch_batches is False else world
                dataset = IterableShard(dataset, batch_size=args.per_device_train_batch_size, num_replicas=world,
                                        rank=None if dispatch else dist_util.rank(), drop_last=drop_last)
            if (args.dataloader_persistent_workers and args.dataloader_num_workers
                    and isinstance(dataset, IterableDataset) and hasattr(dataset, "set_epoch")):
                dataset = EpochRelay(dataset)  # kept workers hold copies made at the first epoch
        return make_loader(dataset, batch_size=args.per_device_train_batch_size, sampler=sampler,
                           collate_fn=self._collator("training data"), num_workers=args.dataloader_num_workers,
                           pin_memory=self._pin_memory, drop_last=drop_last,
                           generator_seed=args.data_seed, rank=dist_util.rank(),
                           persistent_workers=args.dataloader_persistent_workers,
                           prefetch_factor=args.dataloader_prefetch_factor, dispatch_to=dispatch)

    def _accelerator(self) -> AcceleratorConfig:
        """`args.accelerator_config` as an AcceleratorConfig (also when a script assigned a dict to it later)."""
        return AcceleratorConfig.parse(self.args.accelerator_config)

    def _train_sampler(self, dataset: Any, world: int) -> ResumableDistributedSampler:
        """The training data's order (`train_sampling_strategy`): shuffled per epoch, as it is, or grouped by
        length (`group_by_length`), as HF's."""
        args = self.args
        common = dict(num_replicas=world, rank=dist_util.rank(), seed=args.data_seed,
                      drop_last=args.dataloader_drop_last)
        if args.train_sampling_strategy == "sequential":  # HF's order as accelerate deals it: a batch is a run of rows
            return BatchDealtSampler(len(dataset), batch_size=args.per_device_train_batch_size, shuffle=False, **common)
        if not args.group_by_length:
            return ResumableDistributedSampler(len(dataset), shuffle=True, **common)
        names = getattr(self.processing_class, "model_input_names", None) or ["input_ids"]  # HF's choice
        lengths = dataset_lengths(dataset, column=args.length_column_name, model_input_name=names[0])
        return LengthGroupedSampler(lengths, batch_size=args.per_device_train_batch_size,
                                    group=args.per_device_train_batch_size * args.gradient_accumulation_steps,
                                    **common)

    def _collator(self, what: str):
        """`data_collator`, behind HF's column removal with `remove_unused_columns` (the default)."""
        if not self.args.remove_unused_columns:
            return self.data_collator
        model = self._unwrapped_model()
        return remove_unused_columns(self.data_collator, model, self.args.label_names, what)

    def _prepare_inputs(self, inputs: Any) -> Any:
        """The batch on this process's device (HF's name, which overrides often call)."""
        return to_device(inputs, self.device)  # a dict of tensors already there comes back as it is

    # ------------------------------------------------------- optimizer, scheduler
    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """The optimizer, then its scheduler.

        Called inside the strategy's `prepare` (after wrapping or sharding, so
        the optimizer sees the parameters it will update) when a subclass
        overrides it; otherwise the strategy calls `create_optimizer` and
        `create_scheduler` itself, as the HF Trainer's own loop does.
        """
        self.create_optimizer()
        self.create_scheduler(num_training_steps=num_training_steps)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = optim.create_optimizer(model if model is not None else self.model, self.args)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        if self.lr_scheduler is None:
            self.lr_scheduler = optim.create_scheduler(optimizer or self.optimizer, self.args, num_training_steps)
        return self.lr_scheduler

    def _optimizer_for(self, max_steps: int, model: nn.Module) -> torch.optim.Optimizer:
        """The strategy's optimizer factory: through `create_optimizer_and_scheduler` when a subclass overrides it."""
        if self._overrides("create_optimizer_and_scheduler"):
            self.create_optimizer_and_scheduler(num_training_steps=max_steps)
            return self.optimizer
        return self.create_optimizer(model)

    def _scheduler_for(self, max_steps: int, optimizer: torch.optim.Optimizer):
        return self.create_scheduler(max_steps, optimizer)

    # ------------------------------------------------------------ loss and step
    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        if num_items_in_batch is not None and self._loss_kwargs and model.training:  # HF: the step's tokens
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}  # normalise the model's loss
        # The common shapes (a dict batch; a dict or ModelOutput back) without a call: this runs every step.
        outputs = model(**inputs) if type(inputs) is dict else call_model(model, inputs)
        loss = outputs.get("loss") if isinstance(outputs, dict) else extract_loss(outputs)
        if loss is None:
            raise ValueError("the model returned no loss: return a tensor, a dict with 'loss', or outputs with "
                             ".loss (or override Trainer.compute_loss)")
        return (loss, outputs) if return_outputs else loss

    def _compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False,
                      num_items_in_batch: torch.Tensor | int | None = None):
        """`compute_loss` with `num_items_in_batch` only where its signature declares it."""
        if accepts(self.compute_loss, "num_items_in_batch"):
            return self.compute_loss(model, inputs, return_outputs=return_outputs,
                                     num_items_in_batch=num_items_in_batch)
        return self.compute_loss(model, inputs, return_outputs=return_outputs)

    def training_step(self, model: nn.Module, inputs: Any,
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its loss over the step's micro-batches, detached."""
        inputs = self._prepare_inputs(inputs)
        compute = self._step_loss or self._compute_loss  # the signature check is done once per train()
        if self._autocast is contextlib.nullcontext:  # no bf16/fp16: no context to enter and leave every step
            loss = compute(model, inputs, return_outputs=False, num_items_in_batch=num_items_in_batch)
        else:
            with self._autocast():
                loss = compute(model, inputs, return_outputs=False, num_items_in_batch=num_items_in_batch)
        counted = num_items_in_batch is not None and self._loss_kwargs  # normalised by the step's tokens (HF)
        if self.current_gradient_accumulation_steps != 1 and not counted:  # x / 1 is x: no op to run
            loss = loss / self.current_gradient_accumulation_steps
        elif counted and self._world > 1 and self.args.average_tokens_across_devices:
            loss = loss * self._world  # by every rank's tokens, and the gradients are averaged over ranks
        self.strategy.backward(loss)
        return loss.detach()

    def _clip_and_step(self) -> torch.Tensor:
        """Clip the gradients (their norm before is returned), then the optimizer step, between HF's
        `on_pre_optimizer_step` and `on_optimizer_step` (before the gradients are zeroed, as in HF)."""
        args, state, handler = self.args, self.state, self.callback_handler
        grad_norm = self.strategy.clip_grad_norm(args.max_grad_norm)
        self.control = handler.on_pre_optimizer_step(args, state, self.control)

        def stepped() -> None:
            self.control = handler.on_optimizer_step(args, state, self.control)
        self.strategy.optimizer_step(stepped)
        return grad_norm

    def _wants_item_counts(self) -> bool:
        """Whether an override takes `num_items_in_batch` (the built-in methods ignore it: no count needed)."""
        return any(self._overrides(name) and accepts(getattr(self, name), "num_items_in_batch")
                   for name in ("compute_loss", "training_step"))

    def _training_step(self, model: nn.Module, inputs: Any, count: bool) -> torch.Tensor:
        """`training_step` as the loop calls it, with `num_items_in_batch` where declared (and `count`)."""
        return self._training_step_caller(count)(model, inputs)

    def _training_step_caller(self, count: bool):
        """`_training_step` as a function of (model, inputs), its signature checks done once (the loop's per-step call)."""
        model = self._unwrapped_model()
        causal = counts_label_tokens(model)
        chosen = causal if self.model_accepts_loss_kwargs is None else bool(self.model_accepts_loss_kwargs)
        # A compute_loss override that does not take the count returns the model's mean: no counting for it.
        self._loss_kwargs = chosen and (not self._overrides("compute_loss") or accepts(self.compute_loss,
                                                                                     "num_items_in_batch"))
        self._shifted_labels, self._count_always = self._loss_kwargs and causal, count
        self._step_loss = self.compute_loss if accepts(self.compute_loss, "num_items_in_batch") else None
        step = self.training_step
        if not accepts(step, "num_items_in_batch"):
            return step
        if count:
            return lambda model, inputs: step(model, inputs, num_items_in_batch=count_items(inputs))
        return functools.partial(step, num_items_in_batch=None)

    def _counted_step_caller(self):
        """`training_step` as a function of (model, inputs, num_items_in_batch) for `_step_items`' counts."""
        step = self.training_step
        if accepts(step, "num_items_in_batch"):
            return lambda model, inputs, items: step(model, inputs, num_items_in_batch=items)
        return lambda model, inputs, items: step(model, inputs)

    def _step_items(self, micro: list) -> torch.Tensor | None:
        """HF's `num_items_in_batch` of a step, for a model that takes it (see the module's docstring): the label
        tokens of every micro-batch (`shift_labels` if given, else `labels`, after the causal shift for a causal
        LM) on every rank. None for any other model, a step without labels, or one micro-batch on one process."""
        if not self._loss_kwargs or (len(micro) == 1 and self._world == 1 and not self._count_always):
            return None
        labelled = all(isinstance(b, Mapping) and isinstance(b.get("labels"), torch.Tensor) for b in micro)
        n = sum((b["shift_labels"] if "shift_labels" in b else b["labels"][..., 1:] if self._shifted_labels
                 else b["labels"]).ne(-100).sum() for b in micro) if labelled else torch.zeros((), dtype=torch.long)
        if self._world > 1 and self.args.average_tokens_across_devices:  # every rank takes part, labels or not:
            both = torch.stack([n, torch.tensor(0 if labelled else 1)]).to(self.device)  # one collective each
            torch.distributed.all_reduce(both)
            n, unlabelled = both[0], both[1].item()
            return None if unlabelled else n
        return n.to(self.device) if labelled else None

    # --------------------------------------------------------------- logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch  # in the caller's dict too, as HF: evaluate()'s metrics carry it
        if self.args.include_num_input_tokens_seen != "no":
            self._token_logs(logs, start_time)  # tokens_seen.py
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs=logs)

    # ---------------------------------------------------------- process roles
    def is_world_process_zero(self) -> bool:
        """Whether this is the global main process (exactly one in the run)."""
        return dist_util.is_main_process()

    def is_local_process_zero(self) -> bool:
        """Whether this is the main process of its node."""
        return dist_util.is_local_main_process()

    def save_state(self) -> None:
        """`<output_dir>/trainer_state.json` from the main process (HF scripts call it after `save_model`)."""
        if self.is_world_process_zero():
            out = Path(self.args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            self.state.save_to_json(out / "trainer_state.json")
