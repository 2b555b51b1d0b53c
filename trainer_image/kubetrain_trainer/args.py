"""`TrainingArguments`: every knob of a run, typed, validated once, before training.

The names and meanings follow the Hugging Face Trainer so that an HF user is at home at once. The operator
passes the TrainingJob's `spec.trainer.args` as a JSON dict (`KUBETRAIN_TRAINER_ARGS`), users pass a YAML/JSON
file or command line flags: all three go through `from_dict`, which coerces strings, rejects unknown names with
the nearest valid one suggested, and checks that the settings work together. Every problem is a `ConfigError`,
which the entrypoint maps to the "invalid configuration" exit code (82): such a job can never succeed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from . import args_accelerator
from .args_accelerator import AcceleratorConfig
from .args_help import print_help_and_exit, wants_help
from .args_values import (ConfigError, _coerce, _refusing_unknown_names, load_mapping_file, parse_cli,
                          unknown_choices, unknown_name_message)
from .args_process import ProcessArguments
from .loglevels import LogLevel

IntervalStrategy = Literal["no", "steps", "epoch"]
SaveStrategy = Literal["no", "steps", "epoch", "best"]
SchedulerType = Literal["linear", "cosine", "constant", "constant_with_warmup"]
Reporter = Literal["tensorboard", "jsonl", "all", "none"]


@dataclass
class TrainingArguments(ProcessArguments):
    """Arguments of one training run (Hugging Face `TrainingArguments` names and semantics)."""

    # --- output and checkpoints -------------------------------------------------
    output_dir: str = "trainer_output"
    """Where checkpoints (`checkpoint-<step>/`), logs and the final model go."""
    save_strategy: SaveStrategy = "steps"
    """When to checkpoint: every `save_steps`, every epoch, on a new best eval metric, or never."""
    save_steps: float = 500
    """Checkpoint every N optimizer steps; a value below 1 is a fraction of the total steps."""
    save_total_limit: int | None = None
    """Keep at most this many checkpoints; the best and the newest are never deleted."""
    save_safetensors: bool = True
    """Write model weights as safetensors (`model.safetensors`) rather than a pickle (HF 5 has no such argument:
    it always writes safetensors, and so does `save_model()` of a transformers model here; false applies to the
    checkpoints and to a plain module's final model)."""
    async_save: bool = False
    """Copy the state to CPU memory in the loop, write and commit the checkpoint in a thread (docs/trainer.md)."""
    resume_from_checkpoint: str | None = None
    """Checkpoint folder to resume from (the entrypoint passes it to `train`)."""
    ignore_data_skip: bool = False
    """On resume, start the epoch's data from the beginning instead of the exact next batch."""

    # --- batch and optimisation ---------------------------------------------------
    per_device_train_batch_size: int = 8
    """Micro-batch size per process for training."""
    per_device_eval_batch_size: int = 8
    """Batch size per process for evaluation and prediction."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (gradients are synchronised on the last one only)."""
    learning_rate: float = 5e-5
    """Peak learning rate of the AdamW optimizer."""
    weight_decay: float = 0.0
    """Decoupled weight decay; never applied to biases and normalisation weights."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    optim: Literal["adamw_torch", "adamw_torch_fused", "sgd"] = "adamw_torch_fused"
    """Optimizer implementation. The default is HF's for torch >= 2.8: the fused AdamW kernel (CPU and GPU);
    `adamw_torch` is the multi-tensor one (same update, rounded differently)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping; the norm is still logged)."""
    num_train_epochs: float = 3.0
    """Epochs to train (fractional allowed); ignored when `max_steps` > 0."""
    max_steps: int = -1
    """Total optimizer steps; overrides `num_train_epochs` when > 0."""
    lr_scheduler_type: SchedulerType = "linear"
    """Learning-rate schedule after warmup."""
    warmup_steps: float = 0
    """Linear warmup steps; a value below 1 is a fraction of the total steps."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of the total steps (used when `warmup_steps` is 0)."""
    seed: int = 42
    """Seed for python, numpy and torch at the start of training."""
    data_seed: int | None = None
    """Seed of the data order (defaults to `seed`)."""
    nan_inf_policy: Literal["skip", "stop"] = "skip"
    """On a NaN/inf loss: drop that step's update ("skip") or stop training with an error ("stop")."""

    # --- precision and memory -----------------------------------------------------
    bf16: bool = False
    """bfloat16 autocast for forward passes (CPU and GPU)."""
    fp16: bool = False
    """float16 autocast with a gradient scaler (GPU only)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (the model must support it)."""
    neftune_noise_alpha: float | None = None
    """NEFTune: add uniform noise of this scale to input embeddings while training."""
    use_cpu: bool = False
    """Train on CPU even when a GPU is present."""

    # --- distributed strategy ---------------------------------------------------
    strategy: Literal["ddp", "fsdp", "zero3"] = "ddp"
    """How parameters are replicated or sharded across processes."""
    deepspeed: str | dict | None = None
    """DeepSpeed config (path to a JSON file or a dict); required by `strategy: zero3`."""
    fsdp_config: dict | None = None
    """FSDP2 options (only with `strategy: fsdp`)."""
    ddp_timeout: int = 1800
    """Seconds a collective may wait before the process group gives up."""
    ddp_find_unused_parameters: bool | None = None
    """Passed to DistributedDataParallel (default: False)."""
    accelerator_config: dict | str | AcceleratorConfig | None = None
    """HF's settings for accelerate (a dict, a JSON string, a JSON file's path or an AcceleratorConfig), e.g.
    `dispatch_batches: false`: every rank reads an iterable training set itself (args_accelerator.py)."""

    # --- data ---------------------------------------------------------------------
    dataloader_num_workers: int = 0
    """Worker processes per dataloader (0 loads in the training process)."""
    dataloader_pin_memory: bool = True
    """Pin host memory of batches (only used with a GPU)."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete batch of each epoch (map-style training data: HF ignores it for a stream)."""
    dataloader_persistent_workers: bool = False
    """Keep the worker processes between epochs and between evaluations (needs `dataloader_num_workers` > 0)."""
    dataloader_prefetch_factor: int | None = None
    """Batches each worker loads ahead (torch's default, 2, when null; needs `dataloader_num_workers` > 0)."""
    group_by_length: bool = False
    """Train on batches of samples of similar length (HF's grouped order; map-style training data only)."""
    train_sampling_strategy: Literal["random", "sequential", "group_by_length"] = "random"
    """The training data's order: shuffled per epoch, as it is, or `group_by_length` (HF 5.2's name for it)."""
    length_column_name: str = "length"
    """The training data's column of lengths for `group_by_length` (else each row's `input_ids` is measured)."""
    remove_unused_columns: bool = True
    """Drop the keys of dict rows that the model's `forward` does not take (and no label column), as HF does."""
    average_tokens_across_devices: bool = True
    """With a model that normalises its loss by `num_items_in_batch`: count the step's label tokens over every
    rank (HF's default), so each token weighs the same wherever it was trained."""
    label_names: list[str] | None = None
    """The batch keys that hold the labels; default: the model's `forward` arguments named like "label"."""

    # --- evaluation ---------------------------------------------------------------
    eval_strategy: IntervalStrategy = "no"
    """When to evaluate: every `eval_steps`, every epoch, or never."""
    eval_steps: float | None = None
    """Evaluate every N steps (defaults to `logging_steps`); below 1 is a fraction of the total."""
    prediction_loss_only: bool = False
    """Evaluate the loss only; do not collect predictions for `compute_metrics`."""
    include_for_metrics: list[str] = field(default_factory=list)
    """Also give `compute_metrics` the samples' main input (`EvalPrediction.inputs`) and losses (`.losses`), as HF."""
    eval_on_start: bool = False
    """Evaluate once before the first step, as HF (on every `train()`: a resumed attempt evaluates at its step)."""
    batch_eval_metrics: bool = False
    """Call `compute_metrics` on each eval batch with `compute_result` (True on the last), as HF, keeping no logits."""
    load_best_model_at_end: bool = False
    """Reload the best checkpoint (by `metric_for_best_model`) when training ends."""
    metric_for_best_model: str | None = None
    """Eval metric that ranks checkpoints (`loss` when `load_best_model_at_end` is set)."""
    greater_is_better: bool | None = None
    """Whether a larger `metric_for_best_model` is better (default: False for names ending in loss)."""

    # --- logging ------------------------------------------------------------------
    logging_strategy: IntervalStrategy = "steps"
    """When to log the training loss."""
    logging_steps: float = 500
    """Log every N steps; below 1 is a fraction of the total steps."""
    logging_first_step: bool = False
    """Also log after the first step."""
    logging_nan_inf_filter: bool = True
    """Leave NaN/inf losses out of the logged average (the step is still handled by `nan_inf_policy`)."""
    include_num_input_tokens_seen: str | bool = "no"
    """Count the main input's tokens ("all", or "non_padding") over every rank in `state.num_input_tokens_seen` and
    log it, with `train_tokens_per_second`, as HF (true is "all", false "no"; typed as HF's for its parser)."""
    logging_dir: str | None = None
    """Where reporters write (default `<output_dir>/runs`): `log.jsonl`, and TensorBoard a folder per run (HF's)."""
    report_to: str | list[str] = field(default_factory=lambda: ["jsonl"])
    """Reporters: tensorboard, jsonl (`<logging_dir>/log.jsonl`), all or none; one name, several, or a comma list
    (typed as HF types it, so HF's `HfArgumentParser` parses `--report_to none`)."""
    log_level: LogLevel = "passive"
    """Log level of the main process ("passive": the application's level stays as it is)."""
    log_level_replica: LogLevel = "warning"
    """Log level of the other processes ("passive" as for `log_level`)."""
    log_on_each_node: bool = True
    """`log_level` on the local main process of every node; false: only on node 0's (see loglevels.py)."""
    disable_tqdm: bool | None = None
    """Hide the progress bar (shown on the main process by default)."""
    run_name: str | None = None
    """A name for reporters."""

    # --- HF's flags for the user's script (the Trainer does not read them, as in HF) ------------------------
    do_train: bool = False
    """For your script (`if args.do_train:`), as in HF."""
    do_eval: bool = False
    """For your script, as in HF."""
    do_predict: bool = False
    """For your script, as in HF."""
    push_to_hub: bool = False
    """Only false: kubetrain does not push to the Hub (checkpoint storage and `save_model` keep the model)."""

    def __post_init__(self) -> None:
        errors: list[str] = []
        hints = _field_types(type(self))
        for f in dataclasses.fields(self):
            try:
                setattr(self, f.name, _coerce(getattr(self, f.name), hints[f.name], f.name))
            except ConfigError as exc:
                errors.append(str(exc))
        if not errors:
            errors = self._reporters() + args_accelerator.apply(self)
        if not errors:
            errors = self._incompatibilities()
        if errors:
            raise ConfigError("invalid training arguments:\n  - " + "\n  - ".join(errors))
        if self.eval_strategy == "steps" and not self.eval_steps:  # None or 0: logging_steps (HF's rule)
            self.eval_steps = self.logging_steps
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.metric_for_best_model and self.greater_is_better is None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if "all" in self.report_to:
            self.report_to = ["tensorboard", "jsonl"]
        elif "none" in self.report_to:
            self.report_to = []
        if self.group_by_length or self.train_sampling_strategy == "group_by_length":  # either name sets both
            self.group_by_length, self.train_sampling_strategy = True, "group_by_length"
        if isinstance(self.include_num_input_tokens_seen, bool):  # HF's mapping
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"
        if self.data_seed is None:
            self.data_seed = self.seed
        if self.logging_dir is None:
            self.logging_dir = str(Path(self.output_dir) / "runs")

    # ------------------------------------------------------------------ checks
    def _reporters(self) -> list[str]:
        """`report_to` as a list of known reporter names."""
        value = self.report_to
        if isinstance(value, str) and value.strip().startswith("["):  # '["jsonl", "tensorboard"]' as before
            try:
                value = json.loads(value)
            except ValueError:
                return [f"report_to: {value!r} is not a JSON list"]
        given = [value] if isinstance(value, str) else list(value or [])
        self.report_to = [r.strip() for item in given for r in str(item).split(",") if r.strip()]
        return unknown_choices("report_to", self.report_to, typing.get_args(Reporter))

    def _incompatibilities(self) -> list[str]:
        """Settings that are each valid but do not work together; each message says what to change."""
        e: list[str] = []
        if not self.output_dir:
            e.append("output_dir must name a folder, got an empty string (leave it out for the default)")
        if self.push_to_hub:
            e.append("push_to_hub: kubetrain does not push to the Hugging Face Hub; leave it false (checkpoint "
                     "storage and save_model() keep the model; push it from there)")
        if self.per_device_train_batch_size < 1 or self.per_device_eval_batch_size < 1:
            e.append("per_device_train_batch_size and per_device_eval_batch_size must be >= 1")
        if self.gradient_accumulation_steps < 1:
            e.append("gradient_accumulation_steps must be >= 1")
        for name in ("learning_rate", "weight_decay", "adam_epsilon"):
            if getattr(self, name) < 0:
                e.append(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                e.append(f"{name} must be within [0, 1), got {getattr(self, name)}")
        if self.ddp_timeout <= 0:
            e.append(f"ddp_timeout must be > 0 (seconds a collective may wait), got {self.ddp_timeout}")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            e.append("set max_steps > 0 or num_train_epochs > 0: nothing to train")
        for name in ("save_steps", "logging_steps", "eval_steps", "warmup_steps"):
            value = getattr(self, name)
            if value is not None and value < 0:
                e.append(f"{name} must be >= 0 (a value below 1 is a fraction of the total steps)")
            elif value is not None and value > 1 and value != int(value):
                e.append(f"{name}={value}: above 1 it must be a whole number of steps")
        if not 0 <= self.warmup_ratio <= 1:
            e.append("warmup_ratio must be within [0, 1]")
        if self.save_strategy == "steps" and not self.save_steps:
            e.append("save_strategy 'steps' needs save_steps > 0 (or set save_strategy: no)")
        if self.eval_strategy == "steps" and not self.eval_steps and not self.logging_steps:
            e.append("eval_strategy 'steps' needs eval_steps > 0, or logging_steps > 0 (which an unset or 0 "
                     "eval_steps takes)")
        if self.logging_strategy == "steps" and not self.logging_steps:
            e.append("logging_strategy 'steps' needs logging_steps > 0 (or set logging_strategy: no)")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            e.append("save_total_limit must be >= 1 (or null to keep every checkpoint)")
        if self.bf16 and self.fp16:
            e.append("bf16 and fp16 are both set: pick one")
        if self.load_best_model_at_end:
            if self.eval_strategy == "no":
                e.append("load_best_model_at_end needs evaluation: set eval_strategy to 'steps' or 'epoch'")
            elif self.save_strategy == "no":
                e.append("load_best_model_at_end needs checkpoints: set save_strategy to match eval_strategy")
            elif self.save_strategy not in ("best", self.eval_strategy):
                e.append(f"load_best_model_at_end needs save_strategy == eval_strategy "
                         f"(got save_strategy={self.save_strategy!r}, eval_strategy={self.eval_strategy!r}): "
                         f"set save_strategy: {self.eval_strategy}")
            elif self.save_strategy == "steps":
                eval_steps = self.eval_steps or self.logging_steps
                if eval_steps and self.save_steps % eval_steps:
                    e.append(f"load_best_model_at_end needs save_steps ({self.save_steps}) to be a multiple "
                             f"of eval_steps ({eval_steps}): change one of them")
        if self.save_strategy == "best":
            if self.eval_strategy == "no":
                e.append("save_strategy 'best' needs evaluation: set eval_strategy to 'steps' or 'epoch'")
            if self.metric_for_best_model is None and not self.load_best_model_at_end:
                e.append("save_strategy 'best' needs metric_for_best_model (e.g. 'loss')")
        if self.strategy == "zero3" and not self.deepspeed:
            e.append("strategy 'zero3' needs a DeepSpeed config: set deepspeed to a JSON path or a dict")
        if self.deepspeed and self.strategy != "zero3":
            e.append(f"deepspeed is set but strategy is {self.strategy!r}: set strategy: zero3 or remove deepspeed")
        if self.fsdp_config and self.strategy != "fsdp":
            e.append(f"fsdp_config is set but strategy is {self.strategy!r}: set strategy: fsdp or remove fsdp_config")
        if isinstance(self.deepspeed, str) and self.strategy == "zero3" and not Path(self.deepspeed).is_file():
            e.append(f"deepspeed config file {self.deepspeed!r} does not exist")
        if self.dataloader_num_workers < 0:
            e.append("dataloader_num_workers must be >= 0")
        # Without workers HF refuses a prefetch factor when its arguments are made, and torch's DataLoader persistent
        # workers when HF makes the loader (exit 1 after the model loaded; here exit 82 before it).
        unused = {"dataloader_prefetch_factor": self.dataloader_prefetch_factor is not None,
                  "dataloader_persistent_workers": self.dataloader_persistent_workers}
        e += [f"{name} needs worker processes: set dataloader_num_workers > 0 (or leave {name} out)"
              for name, given in unused.items() if given and self.dataloader_num_workers == 0]
        if self.dataloader_prefetch_factor is not None and self.dataloader_prefetch_factor < 1:
            e.append(f"dataloader_prefetch_factor must be >= 1, got {self.dataloader_prefetch_factor}")
        if self.group_by_length and self.train_sampling_strategy == "sequential":
            e.append("group_by_length and train_sampling_strategy 'sequential' are both set: pick one")
        if self.neftune_noise_alpha is not None and self.neftune_noise_alpha <= 0:
            e.append("neftune_noise_alpha must be > 0 (or null to disable NEFTune)")
        tokens = self.include_num_input_tokens_seen
        e += unknown_choices("include_num_input_tokens_seen", [tokens] if isinstance(tokens, str) else [],
                             ("all", "non_padding", "no"))
        return e + unknown_choices("include_for_metrics", self.include_for_metrics, ("inputs", "loss"))

    # ------------------------------------------------------------ derived values
    def resolve_steps(self, value: float | None, max_steps: int) -> int:
        """A step argument as a step count: below 1 it is a fraction of `max_steps` (rounded up)."""
        if not value:
            return 0
        if value < 1:
            return max(1, math.ceil(value * max_steps))
        return int(value)

    def warmup_for(self, max_steps: int) -> int:
        if self.warmup_steps:
            return self.resolve_steps(self.warmup_steps, max_steps)
        return math.ceil(self.warmup_ratio * max_steps)

    # -------------------------------------------------------------- (de)serialise
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, extra_keys: Sequence[str] = ()) -> "TrainingArguments":
        """Build from a mapping; unknown keys fail with the nearest valid name suggested.

        `extra_keys` are other names the caller accepts (a built-in task's own
        keys): they are left out here and only count when suggesting names.
        """
        args, _ = cls.split_dict(data, extra_keys=extra_keys)
        return args

    @classmethod
    def split_dict(cls, data: Mapping[str, Any], *, extra_keys: Sequence[str] = ()
                   ) -> tuple["TrainingArguments", dict[str, Any]]:
        """Build from a mapping; return the arguments and the entries named in `extra_keys`."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"training arguments must be a mapping, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in data if k not in names and k not in extra_keys]
        if unknown:
            raise ConfigError("; ".join(unknown_name_message(k, [*names, *extra_keys]) for k in unknown))
        own = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k in extra_keys}
        return cls(**own), extra

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, extra_keys: Sequence[str] = ()) -> "TrainingArguments":
        """Build from a YAML or JSON file holding one mapping."""
        return cls.from_dict(load_mapping_file(path), extra_keys=extra_keys)

    @classmethod
    def from_cli(cls, argv: Sequence[str]) -> "TrainingArguments":
        """Build from command-line flags: `--max_steps 10`, `--bf16`, `--config args.yaml` (flags win); `--help`."""
        if wants_help(argv):
            print_help_and_exit(cls)
        return cls.from_dict(parse_cli(argv))


TrainingArguments.__init__ = _refusing_unknown_names(TrainingArguments.__init__)  # type: ignore[method-assign]


# ----------------------------------------------------------------------- coercion
@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """The field types of `TrainingArguments` or a user's dataclass subclass of it (its own fields checked too).
    A subclass whose annotations do not resolve here (a name imported under TYPE_CHECKING) keeps its own fields
    unchecked (Any), as before."""
    try:
        return typing.get_type_hints(cls)
    except (NameError, TypeError):
        return {f.name: Any for f in dataclasses.fields(cls)} | typing.get_type_hints(TrainingArguments)
