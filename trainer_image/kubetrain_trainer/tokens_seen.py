"""`include_num_input_tokens_seen`: the input tokens trained on, counted as HF 5 counts them (a mixin of `Trainer`).

Off (the default), none of this runs in a step: the loop's step functions are
wrapped once per `train()`, and only when it is on. Then each micro-batch's
main input (the model's `main_input_name`) is counted before its training step
(a whole tensor with "all"; with "non_padding" its `attention_mask`'s ones,
else the tokens that are not the tokenizer's pad token), and after the step's
last micro-batch the step's count, summed over the ranks (HF gathers each
micro-batch's), is added to `state.num_input_tokens_seen`: every rank holds
the same total before `on_step_end`. The state's `trainer_state.json` keeps
it, so a resumed run continues the count. `log` adds it to every log, and to
the step logs `train_runtime` and `train_tokens_per_second` of the tokens of
this `train()` call, as HF's `log(logs, start_time)`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Callable

import torch

from . import distributed as dist_util

logger = logging.getLogger("kubetrain_trainer")


class TokenCountingMixin:
    """`_token_counting` (the loop's step functions, counting) and `_token_logs` (what `log` adds) of `Trainer`."""

    _initial_num_input_tokens_seen = 0
    """`state.num_input_tokens_seen` when this `train()` started (a resume's count), for the tokens per second."""
    _train_start_time: float | None = None
    """`time.time()` when this `train()`'s loop started: the `start_time` of its step logs (HF's)."""

    def _token_counting(self, step_fn: Callable, counted_fn: Callable) -> tuple[Callable, Callable]:
        """Once per train(): the loop's step functions (`(model, batch)` and `(model, batch, items)`), counting
        the tokens when `include_num_input_tokens_seen` is on; as they are when it is off."""
        self._train_start_time = time.time()
        self._initial_num_input_tokens_seen = self.state.num_input_tokens_seen
        if self.args.include_num_input_tokens_seen == "no":
            return step_fn, counted_fn
        counter = _TokenCounter(self)

        def step(model: Any, batch: Any) -> torch.Tensor:
            counter.add(batch)
            loss = step_fn(model, batch)
            counter.micro_batch_done()
            return loss

        def counted(model: Any, batch: Any, items: Any) -> torch.Tensor:
            counter.add(batch)
            loss = counted_fn(model, batch, items=items)
            counter.micro_batch_done()
            return loss
        return step, counted

    def _token_logs(self, logs: dict[str, float], start_time: float | None) -> None:
        """HF's additions to a log with `include_num_input_tokens_seen`: the count, and with `start_time` (a
        step log) this train() call's runtime and tokens per second (`speed_metrics("train", ...)`)."""
        logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        if start_time is None:
            return
        runtime = time.time() - start_time
        logs["train_runtime"] = round(runtime, 4)
        if runtime:
            tokens = self.state.num_input_tokens_seen - self._initial_num_input_tokens_seen
            logs["train_tokens_per_second"] = round(tokens / runtime, 3)


class _TokenCounter:
    """One train()'s count of a step's tokens, added to the state (summed over ranks) after its last micro-batch."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.non_padding = trainer.args.include_num_input_tokens_seen == "non_padding"
        self.name = getattr(trainer._unwrapped_model(), "main_input_name", "input_ids")  # HF's
        self.pad = getattr(trainer.processing_class, "pad_token_id", None)
        self.step_tokens: int | torch.Tensor = 0
        self.micro_batches = 0
        self.warned = False

    def add(self, batch: Any) -> None:
        if not isinstance(batch, Mapping) or self.name not in batch:
            self._warn_once(f"include_num_input_tokens_seen: a training batch has no {self.name!r} (the model's "
                            "main_input_name; batches must be dicts holding it): its tokens are not counted")
            return
        ids = batch[self.name]
        if not self.non_padding:
            self.step_tokens += ids.numel()
        elif "attention_mask" in batch:
            self.step_tokens += batch["attention_mask"].sum()
        elif self.pad is not None:
            self.step_tokens += (ids != self.pad).sum()
        else:
            self._warn_once("include_num_input_tokens_seen 'non_padding': no attention_mask in the batch and no "
                            "pad_token_id on the processing class: counting all tokens")
            self.step_tokens += ids.numel()

    def micro_batch_done(self) -> None:
        self.micro_batches += 1
        if self.micro_batches < self.trainer.current_gradient_accumulation_steps:
            return
        tokens, self.step_tokens, self.micro_batches = self.step_tokens, 0, 0
        if dist_util.world_size() > 1:  # every rank's, as HF's gather: the same total on each
            total = torch.as_tensor(tokens, dtype=torch.int64).to(self.trainer.device)
            torch.distributed.all_reduce(total)
            tokens = total
        self.trainer.state.num_input_tokens_seen += int(tokens)

    def _warn_once(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            logger.warning(message)
