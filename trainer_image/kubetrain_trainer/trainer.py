"""The training loop: HF-Trainer-shaped API, strategy-agnostic, exactly resumable.

`Trainer.train` reads top to bottom: plan the steps, prepare the model through
the `Strategy` (the only place that knows DDP/FSDP/ZeRO-3), restore a
checkpoint through the resume registry, then loop over optimizer steps. The
loop's side decisions (when to log, evaluate, save, stop) come from callbacks
via `TrainerControl`. A SIGTERM (preemption) only sets a flag; the loop
finishes the current step, writes an emergency checkpoint and raises
`TrainingPreempted`, which the entrypoint turns into the "preempted" exit code.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from . import checkpoint as ckpt
from . import distributed as dist_util
from . import rng
from .args import ConfigError, TrainingArguments
from .args_values import MetricNotFound
from .background_save import BackgroundSaver
from .batch_metrics import BatchMetricsMixin, check_batch_metrics
from .callbacks import (CallbackHandler, DefaultFlowCallback, LoggingCallback, ProgressCallback, TrainerCallback,
                        TrainerControl)
from .data import default_data_collator
from .evaluation import EvaluationMixin, check_eval_dataset
from .flos import FlosCounter, non_embedding_parameters
from .hooks import autocast_factory, neftune_hook
from .loglevels import apply_process_log_level
from .modelio import save_model_config, save_model_files
from .overridable import OverridableMixin
from .reporting import reporters_for
from .resuming import ResumingMixin
from .saving import SavingMixin
from .state import DataPosition, NonFiniteLossError, TrainerState, TrainOutput, defer_epoch_end
from .steps import StepPlan, epoch_batches, plan_steps
from .strategies import Strategy, get_strategy, strategy_options
from .tokens_seen import TokenCountingMixin
from .workerenv import WorkerEnv, unwatched_output_dir

logger = logging.getLogger("kubetrain_trainer")


class Trainer(OverridableMixin, EvaluationMixin, SavingMixin, ResumingMixin, TokenCountingMixin, BatchMetricsMixin):
    """Trains `model` on `train_dataset` as `args` says. See the module docstring."""

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None,
                 data_collator: Callable | None = None, train_dataset: Dataset | None = None,
                 eval_dataset: Dataset | None = None, processing_class: Any = None, *,
                 compute_metrics: Callable | None = None, callbacks: list[TrainerCallback] | None = None,
                 optimizers: tuple[Any, Any] = (None, None), preprocess_logits_for_metrics: Callable | None = None):
        if model is None:
            raise ValueError("Trainer needs a model")
        self.args = args = args if args is not None else TrainingArguments()
        if args.save_strategy != "no" and (unwatched := unwatched_output_dir(args.output_dir,
                                                                            WorkerEnv.from_environ())) is not None:
            raise ConfigError(unwatched)
        dist_util.init_process_group(use_cpu=args.use_cpu, timeout_s=args.ddp_timeout)
        if args.should_save:  # as HF: the output folder exists once the Trainer does (a script may write there)
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        self.device = dist_util.device_for(args.use_cpu)
        if args.fp16 and self.device.type != "cuda":
            raise ConfigError("fp16 needs a GPU; on CPU set bf16: true instead")
        if args.eval_strategy != "no" and eval_dataset is None:
            raise ConfigError(f"eval_strategy is {args.eval_strategy!r} but no eval_dataset was given: "
                              "pass one or set eval_strategy: no")
        check_eval_dataset(eval_dataset, self)
        if args.neftune_noise_alpha and not hasattr(model, "get_input_embeddings"):
            raise ConfigError("neftune_noise_alpha needs a model with get_input_embeddings(); unset it")
        if args.gradient_checkpointing:
            if not hasattr(model, "gradient_checkpointing_enable"):
                raise ConfigError("gradient_checkpointing: this model has no gradient_checkpointing_enable(); "
                                  "set gradient_checkpointing: false")
            model.gradient_checkpointing_enable()
        self.model = model
        self.model_wrapped: nn.Module | None = None
        self.data_collator = data_collator if data_collator is not None else default_data_collator  # as HF
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class = processing_class
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics  # (logits, labels) -> what is gathered
        self.compute_metrics = compute_metrics
        check_batch_metrics(args, compute_metrics)
        self.optimizer, self.lr_scheduler = optimizers
        if self.optimizer is not None and args.strategy in ("fsdp", "zero3"):
            # Sharding replaces the parameters: an optimizer built before would update stale tensors.
            raise ConfigError(f"optimizers: a ready-made optimizer cannot be used with strategy={args.strategy!r}; "
                              "override create_optimizer() instead (it is called on the sharded model)")
        # Options are validated here, so a bad fsdp_config / DeepSpeed config fails before training.
        self.strategy: Strategy = get_strategy(args.strategy, **strategy_options(args))
        self._prepared = False
        self._pin_memory = args.dataloader_pin_memory and self.device.type == "cuda"
        self._autocast = autocast_factory(args, self.device)
        self._stop_requested = False
        self._world = 1
        self._new_best = False
        self._saves, self._save_landed = BackgroundSaver(), False  # async_save: the save in flight
        main = dist_util.is_main_process()
        self.state = TrainerState(is_world_process_zero=main, is_local_process_zero=dist_util.is_local_main_process())
        self.control = TrainerControl()
        apply_process_log_level(args, dist_util.rank())
        builtins: list[TrainerCallback] = [DefaultFlowCallback(), LoggingCallback(), *reporters_for(args)]
        if main and not args.disable_tqdm:
            builtins.append(ProgressCallback())
        self.callback_handler = CallbackHandler([*builtins, *(callbacks or [])])
        self.control = self.callback_handler.on_init_end(args, self.state, self.control)

    # ------------------------------------------------------------ callbacks API
    def add_callback(self, callback) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.remove_callback(callback)

    # ------------------------------------------------------------------- train
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> TrainOutput:
        """Train; `resume_from_checkpoint` is None (fresh), True (newest complete checkpoint) or a folder."""
        if kwargs:
            raise TypeError(f"train() got unexpected arguments: {', '.join(kwargs)}")
        args = self.args
        if resume_from_checkpoint is None:
            resume_from_checkpoint = args.resume_from_checkpoint
        resume_dir = self._resolve_resume(resume_from_checkpoint)
        rng.set_seed(args.seed)
        dataloader = self.get_train_dataloader()
        plan = plan_steps(dataloader, args)
        self._init_state(plan)
        if not self._prepared:  # counted whole, before the strategy shards the parameters
            self._flos_parameters = non_embedding_parameters(self.model)
        self._prepare(plan.max_steps)
        if dist_util.is_local_main_process():
            ckpt.remove_incomplete(args.output_dir)
        registry = self.resume_registry()
        self._check_same_resume(resume_dir)
        if resume_dir is not None:
            logger.info("resuming from %s", resume_dir)
            registry.load_all(resume_dir)
            self._check_resumed_state(plan)
        self.callback_handler.objects = dict(model=self.model, processing_class=self.processing_class,
                                             optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                                             train_dataloader=dataloader)
        neftune = neftune_hook(self.strategy.unwrap(), args.neftune_noise_alpha)
        previous_handler = self._install_sigterm_handler()
        try:
            return self._loop(dataloader, plan, registry)
        finally:
            self._step_loss = None  # checked per train(): a compute_loss replaced afterwards is the one called
            neftune.remove()
            if previous_handler is not None:
                signal.signal(signal.SIGTERM, previous_handler)

    def _loop(self, dataloader: DataLoader, plan: StepPlan, registry: ckpt.ResumeRegistry) -> TrainOutput:
        args, state, strategy = self.args, self.state, self.strategy
        model = self.model_wrapped
        world = self._world = dist_util.world_size()
        saves = self._saves
        samples_per_batch = args.per_device_train_batch_size * world
        ga, sync_each = args.gradient_accumulation_steps, self._accelerator().sync_each_batch
        start_time, start_step = time.perf_counter(), state.global_step
        step_fn = self._training_step_caller(self._wants_item_counts())  # signatures inspected once, not per step
        counted_fn = self._counted_step_caller()  # for a model normalising its loss by the step's tokens (HF)
        step_fn, counted_fn = self._token_counting(step_fn, counted_fn)  # wrapped only to count the tokens seen
        flos, batch = FlosCounter(self.model, self._flos_parameters, state.global_step, samples_per_batch * ga), None
        model.train()
        self.control = self.callback_handler.on_train_begin(args, state, self.control)
        if args.eval_on_start:  # as HF: before the first step, on every train() (a resume's too)
            self.evaluate()
        self._end_deferred_epoch(registry)
        preempted = False
        while state.global_step < state.max_steps and not self.control.should_training_stop and not preempted:
            epoch = state.data_position.epoch
            if args.max_steps <= 0 and epoch >= plan.num_epochs:  # epochs cut short (should_epoch_stop): HF
                break  # trains num_train_epochs of them; a max_steps run trains its steps
            skip = 0 if args.ignore_data_skip else state.data_position.samples
            batches = epoch_batches(dataloader, epoch=epoch, skip_samples=skip, args=args, world_size=world)
            done = skip // samples_per_batch  # micro-batches of this epoch already consumed (per rank)
            self.control.should_epoch_stop = False  # before on_epoch_begin, which fires on a resume too (as HF)
            self.control = self.callback_handler.on_epoch_begin(args, state, self.control)
            epoch_done = False
            grad_norm = lr = None
            while state.global_step < state.max_steps:
                micro = list(itertools.islice(batches, ga))
                if not micro:  # the iterator ran dry (an iterable dataset, or a shorter custom loader)
                    epoch_done, state.data_position = True, DataPosition(epoch + 1, 0)
                    break
                self.control = self.callback_handler.on_step_begin(args, state, self.control)
                self.current_gradient_accumulation_steps = len(micro)
                last = len(micro) - 1
                step_loss, items = None, self._step_items(micro)
                run = step_fn if items is None else functools.partial(counted_fn, items=items)
                for i, batch in enumerate(micro):
                    if i < last:  # gradients are synchronised on the last micro-batch only (or each: sync_each)
                        with strategy.no_sync(not sync_each):
                            loss = run(model, batch)
                    else:
                        loss = run(model, batch)
                    # The step's loss sum, in float32 over several micro-batches (one needs no sum and no cast:
                    # `.item()` reads a bf16 value exactly; the collective of several ranks casts it).
                    if step_loss is None:
                        step_loss = loss if last == 0 else loss.float()
                    else:
                        step_loss = step_loss + loss
                    if i < last:
                        self.control = self.callback_handler.on_substep_end(args, state, self.control)
                # One collective and host sync per step: the mean loss over ranks, whether it is finite
                # everywhere, and whether any rank got SIGTERM (all ranks must take the same branch). The
                # loss comes back as a number, so the sums since the last log and in total are plain floats.
                if world == 1 and not saves.busy:  # nothing to agree on, no save to watch: the step's one host sync
                    step_loss = step_loss.item()
                    finite, stop = math.isfinite(step_loss), self._stop_requested
                else:
                    step_loss, finite, stop = self._reduce_step(step_loss)
                grad_norm = None
                if finite:
                    grad_norm = self._clip_and_step()  # with HF's on_pre_optimizer_step / on_optimizer_step
                    state.loss_since_log += step_loss
                    state.loss_total += step_loss
                    state.steps_since_log += 1
                    state.loss_count += 1
                else:
                    self._handle_non_finite(step_loss)
                    if not args.logging_nan_inf_filter:
                        state.loss_since_log += step_loss
                        state.steps_since_log += 1
                lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used: HF logs it, not the next one
                self.lr_scheduler.step()
                state.global_step += 1
                done += len(micro)
                epoch_done = plan.batches_per_epoch is not None and done >= plan.batches_per_epoch
                state.epoch = epoch + (done / plan.batches_per_epoch if plan.batches_per_epoch else 0.0)
                state.data_position = (DataPosition(epoch + 1, 0) if epoch_done
                                       else DataPosition(epoch, done * samples_per_batch))
                control = self.control = self.callback_handler.on_step_end(args, state, self.control)
                if control.should_epoch_stop:  # the epoch ends here (HF): its next batch is the next epoch's first
                    epoch_done, state.data_position = True, DataPosition(epoch + 1, 0)
                if control.should_log or control.should_evaluate or control.should_save or self._save_landed:
                    flos.store(state, batch)
                    self._maybe_log_save_evaluate(grad_norm, registry, lr)
                    if self.control.should_epoch_stop:  # set in on_log/on_evaluate/on_save: the same epoch end
                        epoch_done, state.data_position = True, DataPosition(epoch + 1, 0)
                if stop and state.global_step < state.max_steps:  # at the last step: just finish
                    preempted = True
                    if epoch_done:  # its end (on_epoch_end, the "epoch" eval/save/log) is the resumed run's first
                        defer_epoch_end(state, grad_norm, lr)
                    break
                if epoch_done or self.control.should_training_stop or self.control.should_epoch_stop:
                    break
            if preempted:  # no epoch end: the emergency checkpoint resumes where this stopped
                break
            if self.control.should_epoch_stop or (epoch_done and plan.batches_per_epoch is None):
                state.data_position = DataPosition(epoch + 1, 0)
            if done == 0 and not skip:  # not one batch in a whole epoch: stop (HF), or an empty iterable loops
                logger.warning("epoch %d has no batch: stopping at step %d", epoch, state.global_step)
                self.control.should_training_stop = True
            # As HF: the epoch ends when its data does, at max_steps and on should_epoch_stop/should_training_stop.
            self.control = self.callback_handler.on_epoch_end(args, state, self.control)
            flos.store(state, batch)
            self._maybe_log_save_evaluate(grad_norm, registry, lr)
        flos.store(state, batch)
        if preempted:
            self._preempt(registry)
        return self._finish(start_time, start_step)

    # ---------------------------------------------------------------- helpers
    def _reduce_step(self, step_loss: torch.Tensor) -> tuple[float, bool, bool]:
        """The step's loss (mean over ranks) as a number, whether it is finite everywhere, and whether to stop."""
        busy = self._saves.busy  # the same on every rank; then the flag "my background save has ended" rides along
        if self._world == 1:  # nothing to agree on: one read of the loss is the step's only host sync
            self._save_landed = busy and self._saves.finished()
            value = step_loss.item()
            return value, math.isfinite(value), self._stop_requested
        flags = [self._stop_requested, self._saves.finished()] if busy else [self._stop_requested]
        packed = torch.stack([step_loss.float(), (~torch.isfinite(step_loss)).float(),
                              *(torch.tensor(float(f), device=self.device) for f in flags)])
        torch.distributed.all_reduce(packed)
        packed[0] /= self._world
        loss, non_finite, stop, *landed = packed.tolist()
        self._save_landed = busy and landed[0] == self._world
        return loss, not non_finite, bool(stop)

    def _handle_non_finite(self, value: float) -> None:
        step = self.state.global_step + 1
        if self.args.nan_inf_policy == "stop":
            raise NonFiniteLossError(f"step {step}: the loss is {value} on at least one rank; stopping "
                                     "(nan_inf_policy: stop). Lower the learning rate or check the data.")
        self.strategy.skip_step()
        self.state.skipped_steps += 1
        logger.warning("step %d: loss is %s on at least one rank; update skipped (nan_inf_policy: skip)", step, value)

    def _maybe_log_save_evaluate(self, grad_norm, registry, lr=None) -> None:
        """`lr`: the rate of the step just taken (what HF logs); None: the scheduler's current one."""
        control, state = self.control, self.state
        if self._save_landed:  # committed on every rank: its on_save fires now, at the same step everywhere
            self._save_landed = False
            self._wait_for_save()
        if control.should_log and state.steps_since_log:
            lr = self.lr_scheduler.get_last_lr()[0] if lr is None else lr
            logs = {"loss": state.loss_since_log / state.steps_since_log,
                    "learning_rate": lr.item() if isinstance(lr, torch.Tensor) else lr}
            if grad_norm is not None:
                logs["grad_norm"] = grad_norm.item()
            state.loss_since_log = 0.0
            state.steps_since_log = 0
            self.log(logs, self._train_start_time)
        control.should_log = False
        metrics = None
        if control.should_evaluate:
            control.should_evaluate = False
            metrics = self.evaluate()
            self._update_best(metrics)
            if self.args.save_strategy == "best":
                control.should_save = self._new_best
        if control.should_save:
            control.should_save = False
            if control.should_epoch_stop and state.data_position.samples:  # set by on_log/on_evaluate just now:
                state.data_position = DataPosition(state.data_position.epoch + 1, 0)  # the checkpoint says so
            self._save_checkpoint(registry)

    def _update_best(self, metrics: dict[str, float]) -> None:
        name = self.args.metric_for_best_model
        self._new_best = False
        if not name:
            return
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise MetricNotFound(f"metric_for_best_model {name!r} not in the eval metrics ({', '.join(metrics)}); "
                           "fix the name or return it from compute_metrics")
        value, best = metrics[key], self.state.best_metric
        if best is None or (value > best if self.args.greater_is_better else value < best):
            self.state.best_metric, self.state.best_global_step = value, self.state.global_step  # as HF
            self._new_best = True

    def _finish(self, start_time: float, start_step: int) -> TrainOutput:
        self._wait_for_save()
        args, state = self.args, self.state
        if args.load_best_model_at_end and state.best_model_checkpoint:
            self._load_best_model()
        runtime = time.perf_counter() - start_time
        steps = state.global_step - start_step
        train_loss = state.loss_total / state.loss_count if state.loss_count else float("nan")
        samples = steps * state.train_batch_size * args.gradient_accumulation_steps * state.world_size
        metrics = {"train_runtime": round(runtime, 4),
                   "train_samples_per_second": round(samples / max(runtime, 1e-9), 3),
                   "train_steps_per_second": round(steps / max(runtime, 1e-9), 3),
                   "total_flos": state.total_flos, "train_loss": train_loss, "epoch": state.epoch}
        self.log(metrics)
        self.control = self.callback_handler.on_train_end(args, state, self.control)
        return TrainOutput(state.global_step, train_loss, metrics)

    def _init_state(self, plan: StepPlan) -> None:
        args = self.args
        self.state = TrainerState(
            max_steps=plan.max_steps, num_train_epochs=plan.num_epochs,
            logging_steps=args.resolve_steps(args.logging_steps, plan.max_steps),
            eval_steps=args.resolve_steps(args.eval_steps, plan.max_steps),
            save_steps=args.resolve_steps(args.save_steps, plan.max_steps),
            train_batch_size=args.per_device_train_batch_size,  # one process's micro-batch, as HF's
            world_size=dist_util.world_size(),
            is_world_process_zero=dist_util.is_main_process(),
            is_local_process_zero=dist_util.is_local_main_process(),
        )
        self.control = TrainerControl()

    def _prepare(self, max_steps: int) -> None:
        """*Collective.* Wrap the model and build optimizer and scheduler through the strategy (once)."""
        if self._prepared:
            self.lr_scheduler = None  # a second train() call plans anew
            self.create_scheduler(max_steps, self.optimizer)
            return
        prepared = self.strategy.prepare(self.model, args=self.args, num_training_steps=max_steps,
                                         create_optimizer=functools.partial(self._optimizer_for, max_steps),
                                         create_scheduler=functools.partial(self._scheduler_for, max_steps))
        self.model_wrapped, self.optimizer, self.lr_scheduler = prepared.model, prepared.optimizer, prepared.lr_scheduler
        self._prepared = True

    def resume_registry(self) -> ckpt.ResumeRegistry:
        """Everything a resume needs, in load order (the trainer state goes last: it marks completion)."""
        reg = ckpt.ResumeRegistry()
        main = dist_util.is_main_process
        reg.register("model+optimizer", save=self.strategy.save_checkpoint, load=self.strategy.load_checkpoint,
                     stage=self.strategy.stage_checkpoint, collective=not self.strategy.loads_locally)

        def save_scheduler(d: Path) -> None:
            if main():
                torch.save(self.lr_scheduler.state_dict(), d / "scheduler.pt")
        reg.register("scheduler", save=save_scheduler,
                     load=lambda d: self.lr_scheduler.load_state_dict(torch.load(d / "scheduler.pt", weights_only=False)))
        ranks = dict(rank=dist_util.rank(), world_size=dist_util.world_size())
        reg.register("rng", save=lambda d: rng.save(d, **ranks), load=lambda d: rng.load(d, **ranks))

        def save_args(d: Path) -> None:
            if main():
                (d / "training_args.json").write_text(self.args.to_json_string() + "\n")
                save_model_config(self.strategy.unwrap(), d, processing_class=self._processing_to_save())  # as HF
        reg.register("training_args and model config", save=save_args, load=lambda d: None)

        def save_state(d: Path) -> None:
            if main():  # kubetrain's fields first: trainer_state.json (HF's fields only) marks completion
                self.state.save_resume_fields(d)
                self.state.save_to_json(d / ckpt.COMPLETE_MARKER)
        reg.register("trainer_state", save=save_state, load=self._load_state)
        return reg

    @property
    def stop_requested(self) -> bool:
        """Whether this process got SIGTERM during `train` (local; the loop agrees across ranks each step)."""
        return self._stop_requested

    def _processing_to_save(self) -> Any:
        """What is saved beside the model: the processing class or, without one, the data collator's tokenizer
        (as HF: `AutoTokenizer.from_pretrained` of the checkpoint found no tokenizer and built a useless one)."""
        if self.processing_class is not None:
            return self.processing_class
        return getattr(self.data_collator, "tokenizer", None)

    def _install_sigterm_handler(self):
        if threading.current_thread() is not threading.main_thread():
            return None  # signal handlers can only be set from the main thread

        def request_stop(signum, frame):
            self._stop_requested = True
            logger.warning("SIGTERM received: finishing the current step, then an emergency checkpoint")
        self._stop_requested = False
        return signal.signal(signal.SIGTERM, request_stop)

    # ------------------------------------------------------------------- saving
    def save_model(self, output_dir: str | None = None) -> None:
        """*Collective.* The final model in the layout `from_pretrained` loads (config.json + model.safetensors)."""
        out = Path(output_dir or self.args.output_dir)
        state_dict = self.strategy.full_state_dict() if self._prepared else self.model.state_dict()
        if self.is_world_process_zero():
            module = self._unwrapped_model()
            save_model_files(module, state_dict, out, safe_serialization=self.args.save_safetensors,
                             processing_class=self._processing_to_save())
            (out / "training_args.json").write_text(self.args.to_json_string() + "\n")
        dist_util.barrier()
