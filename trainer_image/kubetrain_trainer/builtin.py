"""The built-in tasks the operator can run without a user image: `python -m kubetrain_trainer.builtin`.

Reads `KUBETRAIN_BUILTIN_TASK` (`causal-lm`: a tiny GPT on deterministic
synthetic tokens; `regression`: a tiny MLP) and `KUBETRAIN_TRAINER_ARGS` (a
JSON object of `TrainingArguments` names plus the task's own keys; command
line flags override it), trains with `resume_from_checkpoint` set to
`KUBETRAIN_RESUME_FROM` when the launcher restored a checkpoint, else to the
newest complete one in `output_dir`, and saves the final model there.

Exit codes follow docs/contract.md: 82 for an invalid configuration (never
retried), 83 when preempted by SIGTERM after the emergency checkpoint.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import sys
import typing
from dataclasses import dataclass
from typing import Sequence

from .callbacks import TrainerCallback
from .contract import (
    BUILTIN_TASK, DEEPSPEED_CONFIG, EXIT_INVALID_CONFIG, EXIT_PREEMPTED, FSDP_CONFIG, LOCAL_CHECKPOINT_DIR, RESUME_FROM,
    STRATEGY, TEST_HOLD_AT_STEP, TEST_HOLD_SECONDS, TRAINER_ARGS,
)
from .exiting import exit_at_once
from .workerenv import WorkerEnv, WorkerEnvError

logger = logging.getLogger("kubetrain_trainer")


@dataclass
class CausalLMTask:
    """A tiny GPT-like model on synthetic token sequences."""

    vocab_size: int = 256
    """Token ids 0..vocab_size-1."""
    seq_len: int = 64
    """Tokens per sequence (at least 2)."""
    d_model: int = 64
    """Width of the model (a multiple of n_heads)."""
    n_layers: int = 2
    """Transformer blocks."""
    n_heads: int = 4
    """Attention heads per block."""
    dropout: float = 0.0
    """Dropout probability, 0 to below 1."""
    num_samples: int = 4096
    """Training sequences."""
    eval_samples: int = 256
    """Evaluation sequences (drawn with another seed)."""

    def problems(self, args) -> list[str]:
        """What makes the task fail or train nothing, each naming its key (the task's keys are coerced only)."""
        e = [*_sizes(self, "vocab_size", "d_model", "n_layers", "n_heads", "num_samples"), *_eval_size(self, args),
             *_dropout(self)]
        if self.seq_len < 2:
            e.append(f"seq_len must be >= 2 (each token predicts the next one), got {self.seq_len}")
        if self.n_heads >= 1 and self.d_model % self.n_heads:
            e.append(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        return e

    def build(self, args):
        from .models import SyntheticTokens, TinyGPT, TinyGPTConfig

        model = TinyGPT(TinyGPTConfig(vocab_size=self.vocab_size, seq_len=self.seq_len, d_model=self.d_model,
                                      n_layers=self.n_layers, n_heads=self.n_heads, dropout=self.dropout))
        train = SyntheticTokens(self.num_samples, self.seq_len, self.vocab_size, seed=args.data_seed)
        evaluation = SyntheticTokens(self.eval_samples, self.seq_len, self.vocab_size, seed=args.data_seed + 1)
        return model, train, evaluation


@dataclass
class RegressionTask:
    """A tiny MLP fitting a noisy linear function."""

    in_features: int = 8
    """Inputs per sample."""
    hidden: int = 32
    """Width of the hidden layer."""
    dropout: float = 0.0
    """Dropout probability, 0 to below 1."""
    num_samples: int = 1024
    """Training samples."""
    eval_samples: int = 128
    """Evaluation samples (drawn with another seed, of the function the training samples fit)."""
    noise: float = 0.01
    """Standard deviation of the noise on the targets (>= 0)."""

    def problems(self, args) -> list[str]:
        return [*_sizes(self, "in_features", "hidden", "num_samples"), *_eval_size(self, args), *_dropout(self),
                *(["noise must be >= 0"] if self.noise < 0 else [])]

    def build(self, args):
        from .models import SyntheticRegression, TinyMLP

        model = TinyMLP(self.in_features, self.hidden, self.dropout)
        train = SyntheticRegression(self.num_samples, self.in_features, seed=args.data_seed, noise=self.noise)
        evaluation = SyntheticRegression(self.eval_samples, self.in_features, seed=args.data_seed + 1,
                                         noise=self.noise, weights=train.w)  # new samples of the same function
        return model, train, evaluation


TASKS = {"causal-lm": CausalLMTask, "regression": RegressionTask}


def _sizes(task, *names: str) -> list[str]:
    return [f"{n} must be >= 1, got {getattr(task, n)}" for n in names if getattr(task, n) < 1]


def _eval_size(task, args) -> list[str]:
    evaluating = args.eval_strategy != "no"
    return [f"eval_samples must be >= 1 with eval_strategy {args.eval_strategy!r}, got {task.eval_samples}"
            ] if evaluating and task.eval_samples < 1 else []


def _dropout(task) -> list[str]:
    return [] if 0 <= task.dropout < 1 else [f"dropout must be within [0, 1), got {task.dropout}"]


def check_best_metric(args) -> None:
    """The built-in tasks have no compute_metrics: their eval metrics are known before training, so a
    `metric_for_best_model` that is none of them is refused now (HF finds out at the first evaluation)."""
    from .args import ConfigError
    from .evaluation import PLAIN_EVAL_METRICS
    from .layout import metric_key

    name = args.metric_for_best_model
    if name and args.eval_strategy != "no" and metric_key(name) not in PLAIN_EVAL_METRICS:
        raise ConfigError(f"metric_for_best_model {name!r}: the built-in tasks' eval metrics are "
                          f"{', '.join(PLAIN_EVAL_METRICS)}")

HOLD_AT_STEP_ENV = TEST_HOLD_AT_STEP
HOLD_SECONDS_ENV = TEST_HOLD_SECONDS


class HoldAtStep(TrainerCallback):
    """TEST HOOK (off unless `KUBETRAIN_TEST_HOLD_AT_STEP` is set): once checkpoint-N is saved, wait for a SIGTERM.

    Tests that preempt a job "midway" need midway to be a step they choose,
    not a moment they hope for: a fast machine trains the demo model in a
    second. With the hook, every rank stops after `checkpoint-N` is written and
    polls, collectively, until any rank of the gang got SIGTERM (then training
    goes on to the usual emergency checkpoint) or `KUBETRAIN_TEST_HOLD_SECONDS`
    (default 600) pass (then training simply goes on). A run resumed past N
    never holds. Documented in docs/contract.md under "Test hooks".
    """

    def __init__(self, trainer, step: int, max_seconds: float, poll_s: float = 0.2):
        self.trainer, self.step, self.max_seconds, self.poll_s = trainer, step, max_seconds, poll_s

    def on_save(self, args, state, control, **kwargs):
        import os
        import time

        import torch

        from . import distributed as dist_util
        from .layout import parse_checkpoint_dirname

        # The checkpoint's own step: with async_save, on_save fires when checkpoint-N is committed, a step or
        # more after N (at the same step on every rank, so every rank takes the same branch).
        folder = kwargs.get("checkpoint_dir")
        saved = parse_checkpoint_dirname(os.path.basename(folder)) if folder else None
        if (state.global_step if saved is None else saved) != self.step:
            return control
        logger.warning("test hook: holding after step %d until SIGTERM (at most %.0f s)", self.step, self.max_seconds)
        deadline = time.monotonic() + self.max_seconds
        while True:
            # All ranks take the same branch: the flags are reduced with MAX on every poll.
            flags = torch.tensor([float(self.trainer.stop_requested), float(time.monotonic() >= deadline)])
            if dist_util.world_size() > 1:
                torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            if flags.any():
                logger.warning("test hook: released after step %d (%s)", self.step,
                               "SIGTERM" if flags[0] else "hold time over")
                return control
            time.sleep(self.poll_s)


def test_hooks(env: dict[str, str], trainer) -> list:
    """The test-only callbacks the environment asks for (none by default); ConfigError on a bad value."""
    from .args import ConfigError

    raw = env.get(HOLD_AT_STEP_ENV)
    if not raw:
        return []
    try:
        step, seconds = int(raw), float(env.get(HOLD_SECONDS_ENV) or 600)
    except ValueError as exc:
        raise ConfigError(f"{HOLD_AT_STEP_ENV} / {HOLD_SECONDS_ENV}: not a number ({exc})") from exc
    if step < 1 or seconds <= 0:
        raise ConfigError(f"{HOLD_AT_STEP_ENV} must be a step >= 1 and {HOLD_SECONDS_ENV} > 0 "
                          f"(got {raw!r}, {seconds})")
    return [HoldAtStep(trainer, step, seconds)]


def contract_strategy(raw: dict, env: dict[str, str]) -> None:
    """Put the pod contract's strategy and its config (docs/contract.md) into the arguments `raw`.

    Under the launcher, `KUBETRAIN_STRATEGY` is the TrainingJob's spec.strategy.type, which the pods' layout
    and the checkpoints follow and which cannot change: an argument that says otherwise is refused (it would
    have trained another strategy than the one the launcher and the checkpoints' manifests name). So is a
    `deepspeed` other than the config the operator mounts, and an `fsdp_config` option that
    spec.strategy.fsdp sets to another value; the options it has no field for (`shard_modules`) are added."""
    from .args import ConfigError, _coerce

    strategy = env.get(STRATEGY)
    if not strategy:  # not under the launcher: the arguments say
        raw.setdefault("strategy", "ddp")
        return
    if raw.setdefault("strategy", strategy) != strategy:
        raise ConfigError(f"strategy: {raw['strategy']!r} differs from {STRATEGY}={strategy!r} (the TrainingJob's "
                          "spec.strategy.type, which cannot change): remove strategy from the trainer arguments "
                          "and set spec.strategy.type")
    mounted = env.get(DEEPSPEED_CONFIG) if strategy == "zero3" else None
    if raw.get("deepspeed") and raw["deepspeed"] != mounted:
        raise ConfigError("deepspeed: the DeepSpeed config is spec.strategy.deepspeed's (with spec.strategy.type "
                          f"zero3, mounted at {DEEPSPEED_CONFIG}): remove deepspeed from the trainer arguments")
    if mounted:
        raw["deepspeed"] = mounted
    if raw.get("fsdp_config") and strategy != "fsdp":
        raise ConfigError(f"fsdp_config: only with spec.strategy.type fsdp (it is {strategy!r}): remove "
                          "fsdp_config from the trainer arguments")
    if strategy != "fsdp" or not env.get(FSDP_CONFIG):
        return
    from .strategies.fsdp import option_name

    spec_options = _coerce(env[FSDP_CONFIG], dict, FSDP_CONFIG)
    if "fsdp_config" not in raw or raw["fsdp_config"] is None:
        raw["fsdp_config"] = spec_options
        return
    own = _coerce(raw["fsdp_config"], dict, "fsdp_config")
    by_name = {option_name(k): v for k, v in spec_options.items()}
    for key, value in own.items():
        if option_name(key) in by_name and by_name[option_name(key)] != value:
            raise ConfigError(f"fsdp_config.{key}: {value!r} differs from spec.strategy.fsdp's "
                              f"{by_name[option_name(key)]!r} ({FSDP_CONFIG}): set it in spec.strategy.fsdp")
    raw["fsdp_config"] = {**spec_options, **{k: v for k, v in own.items() if option_name(k) not in by_name}}


def load_config(env: dict[str, str], argv: Sequence[str]):
    """(task name, TrainingArguments, task) from the environment and flags; ConfigError when invalid."""
    from .args import ConfigError, TrainingArguments, _coerce, parse_cli

    name = env.get(BUILTIN_TASK, "causal-lm")
    if name not in TASKS:
        near = difflib.get_close_matches(name, list(TASKS), n=1)
        raise ConfigError(f"{BUILTIN_TASK}: unknown task {name!r}"
                          + (f"; did you mean {near[0]!r}?" if near else f"; known: {', '.join(TASKS)}"))
    try:
        raw = json.loads(env.get(TRAINER_ARGS) or "{}")
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{TRAINER_ARGS} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{TRAINER_ARGS} must be a JSON object of argument names to values")
    raw = {**raw, **parse_cli(argv)}
    # Where the launcher watches and uploads (launch_config.py): output_dir when set, else this folder.
    if raw.get("output_dir") is None and env.get(LOCAL_CHECKPOINT_DIR):
        raw["output_dir"] = env[LOCAL_CHECKPOINT_DIR]
    contract_strategy(raw, env)
    task_cls = TASKS[name]
    task_fields = [f.name for f in dataclasses.fields(task_cls)]
    args, extra = TrainingArguments.split_dict(raw, extra_keys=task_fields)
    hints = typing.get_type_hints(task_cls)
    task = task_cls(**{k: _coerce(v, hints[k], k) for k, v in extra.items()})
    if problems := task.problems(args):
        raise ConfigError(f"invalid {name} task arguments:\n  - " + "\n  - ".join(problems))
    check_best_metric(args)
    return name, args, task


def restored_folder(env: dict[str, str]) -> str | None:
    """The checkpoint the launcher restored for this worker (None: none). A worker started while the
    launcher restores waits here for the outcome (handoff.py): its imports, model and process group are
    ready by then. HandoffError when the launcher gave up (it reports why) or is gone."""
    import time

    from .handoff import receive

    fd = WorkerEnv.from_environ(env).restore_outcome_fd
    if fd is None:
        return env.get(RESUME_FROM) or None
    started = time.monotonic()
    folder = receive(fd)
    logger.info("restore outcome after %.2fs waiting: %s", time.monotonic() - started, folder or "start fresh")
    return str(folder) if folder is not None else None


def drop_stale_checkpoints(output_dir: str, *, keep: str | None) -> None:
    """Storage decided this gang's restore (`keep`, or a fresh start): every other checkpoint folder in
    `output_dir` is stale (an earlier pod's, on a persistent volume). Removed before training: the
    trainer's rotation (`save_total_limit`) would otherwise keep a stale one as the newest and delete
    this run's own new checkpoints. The best checkpoint `keep` names (its trainer_state.json's
    `best_model_checkpoint`, which the launcher fetched for `load_best_model_at_end`) stays too.
    Call on one process per node."""
    import json
    from pathlib import Path

    from .checkpoint import list_local_checkpoints, remove_checkpoint

    kept = {Path(keep).resolve()} if keep else set()
    try:
        best = json.loads((Path(keep) / "trainer_state.json").read_text()).get("best_model_checkpoint") if keep else None
    except (OSError, ValueError, AttributeError):
        best = None
    if isinstance(best, str) and best.strip("/"):
        kept.add((Path(output_dir) / Path(best.rstrip("/")).name).resolve())
    for _step, path in list_local_checkpoints(output_dir):  # a node's share too (nodes sharing no disk)
        if path.resolve() not in kept:
            logger.warning("removing %s: a local checkpoint storage did not decide to restore (stale)", path)
            remove_checkpoint(path)


def run(env: dict[str, str], argv: Sequence[str]) -> int:
    import torch

    from .args import ConfigError
    from .handoff import HandoffError
    from .progress import declare_tokens_per_sample
    from .rng import set_seed
    from .state import TrainingPreempted
    from .trainer import Trainer

    # This entrypoint is the application: its step and resume logs are at info. The Trainer
    # leaves that alone under log_level "passive" (the default) and applies any other level.
    logger.setLevel(logging.INFO)
    try:
        name, args, task = load_config(env, argv)
        set_seed(args.seed)  # identical initial weights on every rank and attempt
        model, train_ds, eval_ds = task.build(args)
        trainer = Trainer(model=model, args=args, train_dataset=train_ds,
                          eval_dataset=eval_ds if args.eval_strategy != "no" else None)
        for hook in test_hooks(env, trainer):
            trainer.add_callback(hook)
        declare_tokens_per_sample(trainer.callback_handler.callbacks, getattr(task, "seq_len", None))
        folder = restored_folder(env)
        # With checkpoint storage the launcher decided for the whole gang (handoff.py): its "start fresh" is
        # final, and a folder left in output_dir (a persistent volume's) is stale. Without storage, the
        # newest complete local checkpoint is the one to resume from.
        worker = WorkerEnv.from_environ(env)
        decided = worker.restore_outcome_fd is not None
        resume = folder if folder is not None or decided else True
        if decided and worker.local_rank == 0:
            drop_stale_checkpoints(args.output_dir, keep=folder)
        output = trainer.train(resume_from_checkpoint=resume)
        trainer.save_model()
        if torch.distributed.is_initialized():
            # Every rank is done before any tears down: gloo can abort (SIGABRT) a process whose peer
            # leaves mid-teardown, and the launcher would count a finished run as failed.
            torch.distributed.barrier()
    except ConfigError as exc:
        print(f"kubetrain: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
    except TrainingPreempted as exc:
        print(f"kubetrain: {exc}", file=sys.stderr)
        return EXIT_PREEMPTED
    except HandoffError as exc:
        print(f"kubetrain: {exc}", file=sys.stderr)
        return 1
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    # One write per line: every rank prints its result to a stdout the workers of a pod share.
    sys.stdout.write(json.dumps({"task": name, "global_step": output.global_step,
                                 "training_loss": output.training_loss}) + "\n")
    sys.stdout.flush()
    return 0


def task_help() -> str:
    """The built-in tasks' own keys, for `--help` (the text docs/trainer.md's table follows)."""
    from .args_help import field_docs

    lines = ["", "The built-in tasks' own keys (the task: KUBETRAIN_BUILTIN_TASK, spec.trainer.builtin.task):"]
    for name, cls in TASKS.items():
        docs = field_docs(cls)
        lines.append(f"  {name}: {cls.__doc__}")
        lines += [f"    --{f.name} (default: {f.default!r}) {docs.get(f.name, '')}" for f in dataclasses.fields(cls)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from .args_help import print_help_and_exit, wants_help

    if wants_help(argv):
        from .args import TrainingArguments

        print_help_and_exit(TrainingArguments, prog="python -m kubetrain_trainer.builtin", extra=task_help())
    try:
        env = WorkerEnv.from_environ()
    except WorkerEnvError as exc:
        print(f"kubetrain: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_INVALID_CONFIG
    return run(dict(env.environ), argv)


if __name__ == "__main__":
    # `main`'s code is returned only once its work is on disk: after `TrainingPreempted`, which the Trainer
    # raises once the emergency checkpoint is committed (after any save still in flight, which it waits for
    # first), after `save_model`, or before anything was written.
    # Every returned code leaves without the interpreter's teardown: after a preemption the launcher waits
    # for this exit (the emergency checkpoint is complete on disk), and after a finished run or a refused
    # configuration, gloo's threads can abort the process while they are torn down ("terminate called
    # without an active exception", SIGABRT, seen after all of a rank's output): the exit status the
    # launcher reads would then say a failure, not the code returned here.
    exit_at_once(main())
