"""The built-in entrypoint: configuration errors exit 82 with a hint; runs train, save and resume."""

from __future__ import annotations

import json
import logging
import re

import pytest

from kubetrain_trainer.args import ConfigError
from kubetrain_trainer.builtin import EXIT_INVALID_CONFIG, load_config, run


def _env(**args):
    base = {"report_to": ["none"], "disable_tqdm": True, "logging_steps": 1}
    return {"KUBETRAIN_BUILTIN_TASK": "regression", "KUBETRAIN_TRAINER_ARGS": json.dumps({**base, **args})}


@pytest.mark.parametrize("env, message", [
    ({"KUBETRAIN_TRAINER_ARGS": '{"max_stpes": 3}'}, "unknown argument 'max_stpes'; did you mean 'max_steps'"),
    ({"KUBETRAIN_TRAINER_ARGS": '{"max_steps": '}, "KUBETRAIN_TRAINER_ARGS is not valid JSON"),
    ({"KUBETRAIN_TRAINER_ARGS": '[1]'}, "must be a JSON object"),
    ({"KUBETRAIN_BUILTIN_TASK": "regresion"}, "unknown task 'regresion'; did you mean 'regression'"),
    ({"KUBETRAIN_TRAINER_ARGS": '{"d_model": "big"}'}, "d_model: expected an integer"),
    ({"KUBETRAIN_TRAINER_ARGS": '{"strategy": "zero3"}'}, "needs a DeepSpeed config"),
    ({"KUBETRAIN_STRATEGY": "zero3"}, "needs a DeepSpeed config"),
    ({"KUBETRAIN_STRATEGY": "zero3", "KUBETRAIN_DEEPSPEED_CONFIG": "/nonexistent/ds.json"},
     "deepspeed config file '/nonexistent/ds.json' does not exist"),
    ({"KUBETRAIN_TRAINER_ARGS": '{"hiden": 3}', "KUBETRAIN_BUILTIN_TASK": "regression"}, "did you mean 'hidden'"),
])
def test_invalid_configuration_exits_82_with_a_hint(env, message, capsys):
    assert run(env, []) == EXIT_INVALID_CONFIG
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("env, message", [
    ({"KUBETRAIN_STRATEGY": "ddp", "KUBETRAIN_TRAINER_ARGS": '{"strategy": "fsdp"}'},
     "strategy: 'fsdp' differs from KUBETRAIN_STRATEGY='ddp'"),
    ({"KUBETRAIN_STRATEGY": "ddp", "KUBETRAIN_TRAINER_ARGS": '{"fsdp_config": {"cpu_offload": true}}'},
     "fsdp_config: only with spec.strategy.type fsdp"),
    ({"KUBETRAIN_STRATEGY": "ddp", "KUBETRAIN_TRAINER_ARGS": '{"deepspeed": {"a": 1}}'},
     "deepspeed: the DeepSpeed config is spec.strategy.deepspeed's"),
    ({"KUBETRAIN_STRATEGY": "zero3", "KUBETRAIN_DEEPSPEED_CONFIG": "/etc/kubetrain/deepspeed/ds_config.json",
      "KUBETRAIN_TRAINER_ARGS": '{"deepspeed": "/tmp/other.json"}'}, "remove deepspeed from the trainer arguments"),
    ({"KUBETRAIN_STRATEGY": "fsdp", "KUBETRAIN_FSDP_CONFIG": '{"cpuOffload": false}',
      "KUBETRAIN_TRAINER_ARGS": '{"fsdp_config": {"cpu_offload": true}}'},
     "fsdp_config.cpu_offload: True differs from spec.strategy.fsdp's False"),
])
def test_the_strategy_and_its_config_are_the_contracts(env, message):
    """spec.strategy.type (KUBETRAIN_STRATEGY) is what the pods and the checkpoints follow, and cannot change:
    trainer arguments that train another strategy or another config are refused, not obeyed."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config({"KUBETRAIN_BUILTIN_TASK": "regression", **env}, [])


def test_fsdp_options_the_crd_has_no_field_for_are_added_to_the_contracts():
    env = {"KUBETRAIN_STRATEGY": "fsdp", "KUBETRAIN_FSDP_CONFIG": '{"cpuOffload": false, "reshardAfterForward": true}',
           "KUBETRAIN_TRAINER_ARGS": '{"strategy": "fsdp", "fsdp_config": {"cpu_offload": false, "shard_modules": "L"}}'}
    _, args, _ = load_config({"KUBETRAIN_BUILTIN_TASK": "regression", **env}, [])
    assert args.strategy == "fsdp"
    assert args.fsdp_config == {"cpuOffload": False, "reshardAfterForward": True, "shard_modules": "L"}


def test_the_trainer_saves_where_the_launcher_watches_or_refuses_an_empty_output_dir():
    from kubetrain_trainer.launch_config import LaunchConfig

    for output_dir, expected in ((None, "/tmp/kt/ckpt"), ("/data/out", "/data/out")):
        env = {"KUBETRAIN_BUILTIN_TASK": "regression", "KUBETRAIN_LOCAL_CHECKPOINT_DIR": "/tmp/kt/ckpt",
               "KUBETRAIN_TRAINER_ARGS": json.dumps({"output_dir": output_dir})}
        assert str(LaunchConfig.from_env(env, []).local_dir) == load_config(env, [])[1].output_dir == expected
    env["KUBETRAIN_TRAINER_ARGS"] = '{"output_dir": ""}'
    with pytest.raises(ConfigError, match="output_dir must name a folder, got an empty string"):
        load_config(env, [])


@pytest.mark.parametrize("task, args, message", [
    ("causal-lm", {"d_model": 64, "n_heads": 5}, "d_model (64) must be a multiple of n_heads (5)"),
    ("causal-lm", {"seq_len": 0}, "seq_len must be >= 2"),
    ("causal-lm", {"seq_len": 1}, "seq_len must be >= 2"),
    ("causal-lm", {"n_layers": 0}, "n_layers must be >= 1, got 0"),
    ("causal-lm", {"vocab_size": -3}, "vocab_size must be >= 1"),
    ("causal-lm", {"n_heads": 0}, "n_heads must be >= 1"),
    ("causal-lm", {"dropout": 1.0}, "dropout must be within [0, 1), got 1.0"),
    ("regression", {"num_samples": 0}, "num_samples must be >= 1, got 0"),
    ("regression", {"in_features": 0}, "in_features must be >= 1"),
    ("regression", {"hidden": -1}, "hidden must be >= 1, got -1"),
    ("regression", {"dropout": 1.5}, "dropout must be within [0, 1), got 1.5"),
    ("regression", {"dropout": -0.1}, "dropout must be within [0, 1)"),
    ("regression", {"noise": -1}, "noise must be >= 0"),
    ("regression", {"eval_samples": 0, "eval_strategy": "steps", "eval_steps": 2},
     "eval_samples must be >= 1 with eval_strategy 'steps'"),
    ("regression", {"eval_strategy": "steps", "eval_steps": 2, "metric_for_best_model": "accuracy"},
     "metric_for_best_model 'accuracy': the built-in tasks' eval metrics are eval_loss, eval_runtime"),
])
def test_task_arguments_that_cannot_train_are_refused_naming_the_key(task, args, message):
    env = {"KUBETRAIN_BUILTIN_TASK": task, "KUBETRAIN_TRAINER_ARGS": json.dumps(args)}
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(env, [])


def test_task_arguments_at_their_bounds_are_accepted():
    for task, args in (("causal-lm", {"seq_len": 2, "d_model": 6, "n_heads": 3, "dropout": 0.99}),
                       ("regression", {"eval_samples": 0, "noise": 0}),
                       ("regression", {"eval_strategy": "epoch", "metric_for_best_model": "eval_loss"})):
        load_config({"KUBETRAIN_BUILTIN_TASK": task, "KUBETRAIN_TRAINER_ARGS": json.dumps(args)}, [])


def test_trains_saves_and_resumes_from_output_dir(tmp_path, capsys):
    out = tmp_path / "out"
    assert run(_env(output_dir=str(out), max_steps=4, save_steps=2), []) == 0
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "kubetrain-tiny-mlp"
    assert run(_env(output_dir=str(out), save_steps=2), ["--max_steps", "6"]) == 0
    history = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in history if "loss" in e] == [1, 2, 3, 4, 5, 6]
    # the second run trained only steps 5-6: its first-run steps came from checkpoint-4
    assert '"global_step": 6' in capsys.readouterr().out


def test_resume_from_env_points_at_a_restored_checkpoint(tmp_path):
    first = tmp_path / "first"
    assert run(_env(output_dir=str(first), max_steps=2, save_steps=2), []) == 0
    second = tmp_path / "second"
    env = {**_env(output_dir=str(second), max_steps=3, save_steps=1),
           "KUBETRAIN_RESUME_FROM": str(first / "checkpoint-2")}
    assert run(env, []) == 0
    state = json.loads((second / "checkpoint-3" / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3]
    assert not (second / "checkpoint-1").exists()  # steps 1-2 were not retrained


# The test hook KUBETRAIN_TEST_HOLD_AT_STEP (docs/contract.md, "Test hooks"): preemption tests choose the step.
def test_hold_at_step_waits_for_sigterm_then_takes_the_emergency_checkpoint(tmp_path, capsys):
    import os
    import signal
    import threading

    from kubetrain_trainer.builtin import EXIT_PREEMPTED

    out = tmp_path / "out"
    env = {**_env(output_dir=str(out), max_steps=50, save_steps=2), "KUBETRAIN_TEST_HOLD_AT_STEP": "4"}
    held = threading.Event()

    def preempt_once_held():
        # The hold is the only place the run can wait: checkpoint-4 exists and no later step was taken.
        while not (out / "checkpoint-4").is_dir():
            held.wait(0.05)
        held.wait(0.5)
        if not (out / "checkpoint-6").exists():
            held.set()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=preempt_once_held, daemon=True).start()
    assert run(env, []) == EXIT_PREEMPTED
    assert held.is_set(), "training went past the hold step before the SIGTERM"
    # Released by the SIGTERM: one more step, then the emergency checkpoint of step 5.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-5"]
    assert "preempted at step 5" in capsys.readouterr().err


def test_hold_at_step_ends_after_its_time_and_a_resumed_run_never_holds(tmp_path):
    out = tmp_path / "out"
    env = {**_env(output_dir=str(out), max_steps=4, save_steps=2),
           "KUBETRAIN_TEST_HOLD_AT_STEP": "2", "KUBETRAIN_TEST_HOLD_SECONDS": "0.3"}
    assert run(env, []) == 0
    assert (out / "checkpoint-4").is_dir()
    env["KUBETRAIN_TEST_HOLD_SECONDS"] = "600"  # resumed from step 4, past the hold: must not wait
    assert run(env, ["--max_steps", "6"]) == 0
    assert (out / "checkpoint-6").is_dir()


def test_hold_at_step_holds_an_async_save_run_once_its_checkpoint_is_committed(tmp_path, caplog):
    # With async_save, checkpoint-2's on_save fires when its background write is committed: at step 3 or
    # later, never at step 2. The hold must key on the checkpoint, not on the step on_save fires at.
    out = tmp_path / "out"
    env = {**_env(output_dir=str(out), max_steps=6, save_steps=2, async_save=True),
           "KUBETRAIN_TEST_HOLD_AT_STEP": "2", "KUBETRAIN_TEST_HOLD_SECONDS": "0.2"}
    with caplog.at_level("WARNING", logger="kubetrain_trainer"):
        assert run(env, []) == 0
    assert "test hook: holding after step 2" in caplog.text
    assert "test hook: released after step 2 (hold time over)" in caplog.text
    assert (out / "checkpoint-6").is_dir()


@pytest.mark.parametrize("hold, seconds", [("x", "1"), ("0", "1"), ("3", "0"), ("3", "soon")])
def test_hold_at_step_bad_values_are_config_errors(hold, seconds, capsys):
    env = {**_env(max_steps=1), "KUBETRAIN_TEST_HOLD_AT_STEP": hold, "KUBETRAIN_TEST_HOLD_SECONDS": seconds}
    assert run(env, []) == EXIT_INVALID_CONFIG
    assert "KUBETRAIN_TEST_HOLD_AT_STEP" in capsys.readouterr().err


# Started while the launcher restores (handoff.py): the restored folder comes through a pipe, before train().
def test_a_worker_started_before_the_restore_resumes_from_the_folder_handed_over(tmp_path, capsys):
    from kubetrain_trainer import handoff

    first = tmp_path / "first"
    assert run(_env(output_dir=str(first), max_steps=2, save_steps=2), []) == 0
    second = tmp_path / "second"
    read_fd, write_fd = handoff.open_pipe()
    assert handoff.send(write_fd, first / "checkpoint-2")
    env = {**_env(output_dir=str(second), max_steps=3, save_steps=1), "KUBETRAIN_RESTORE_OUTCOME_FD": str(read_fd)}
    assert run(env, []) == 0
    assert not (second / "checkpoint-1").exists() and (second / "checkpoint-3").is_dir()  # steps 1-2 came restored

    read_fd, write_fd = handoff.open_pipe()
    handoff.withhold(write_fd)  # the launcher's restore failed: never a fresh start
    env = {**_env(output_dir=str(tmp_path / "third"), max_steps=3), "KUBETRAIN_RESTORE_OUTCOME_FD": str(read_fd)}
    assert run(env, []) == 1
    assert "without an outcome" in capsys.readouterr().err
    assert not list((tmp_path / "third").glob("checkpoint-*"))


def test_storage_deciding_a_fresh_start_is_followed_even_with_old_checkpoints_in_output_dir(tmp_path, caplog):
    # The gang's node rank 0 found nothing complete in storage: every rank starts from step 0. A checkpoint
    # left in output_dir (a persistent volume, an earlier run) is stale, not a resume point of this node's own.
    from kubetrain_trainer import handoff

    out = tmp_path / "out"
    assert run(_env(output_dir=str(out), max_steps=2, save_steps=2), []) == 0
    assert (out / "checkpoint-2").is_dir()
    read_fd, write_fd = handoff.open_pipe()
    assert handoff.send(write_fd, None)  # decided: start fresh
    caplog.set_level(logging.INFO)
    env = {**_env(output_dir=str(out), max_steps=4, save_steps=1), "KUBETRAIN_RESTORE_OUTCOME_FD": str(read_fd)}
    assert run(env, []) == 0
    assert "resuming from" not in caplog.text
    assert (out / "checkpoint-1").is_dir()  # step 1 trained again, not restored


def test_a_stale_local_checkpoint_never_outranks_the_runs_own_in_the_rotation(tmp_path, caplog):
    # A persistent output_dir holds checkpoint-50 of an earlier pod; storage decided a fresh start. With
    # save_total_limit, the stale checkpoint-50 would be kept as "the newest" and this run's own deleted.
    from kubetrain_trainer import handoff

    out = tmp_path / "out"
    assert run(_env(output_dir=str(out), max_steps=2, save_steps=2), []) == 0
    (out / "checkpoint-2").rename(out / "checkpoint-50")
    read_fd, write_fd = handoff.open_pipe()
    assert handoff.send(write_fd, None)
    env = {**_env(output_dir=str(out), max_steps=4, save_steps=1, save_total_limit=2),
           "KUBETRAIN_RESTORE_OUTCOME_FD": str(read_fd)}
    assert run(env, []) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert "checkpoint-50" in caplog.text  # its removal is logged


EXITS = r"""
import atexit, pathlib, sys, threading, time
from kubetrain_trainer.builtin import exit_at_once
out = pathlib.Path(sys.argv[1])
def writer():  # a background writer still finishing a checkpoint's bytes
    time.sleep(0.3)
    (out / "written").write_text("bytes")
threading.Thread(target=writer).start()
import concurrent.futures  # an executor left alive (its idle worker threads are not daemons)
pool = concurrent.futures.ThreadPoolExecutor(2)
pool.submit(lambda: None).result()
atexit.register(lambda: (out / "atexit").write_text("ran"))
sys.stdout.write("preempted at step 7")  # no newline, piped: still in the buffer
exit_at_once(83)
"""


def test_the_preempted_exit_skips_the_teardown_but_not_writers_atexit_or_output(tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", EXITS, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 83, p.stderr  # a join of the idle executor's workers would hang to the timeout
    assert p.stdout == "preempted at step 7"
    assert (tmp_path / "written").read_text() == "bytes" and (tmp_path / "atexit").read_text() == "ran"


def test_the_best_checkpoint_the_restored_one_names_is_not_stale(tmp_path):
    """The launcher fetches the best checkpoint beside the restored one (load_best_model_at_end): the
    built-in trainer's clean-up of stale local checkpoints keeps it, and removes the rest."""
    import json

    from kubetrain_trainer.builtin import drop_stale_checkpoints
    from kubetrain_trainer.checkpoint import COMPLETE_MARKER

    out = tmp_path / "out"
    for step in (2, 4, 6, 8):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / COMPLETE_MARKER).write_text("")
    (out / "checkpoint-8" / "trainer_state.json").write_text(json.dumps(
        {"best_model_checkpoint": "/elsewhere/out/checkpoint-4"}))  # the path of the pod that wrote it
    drop_stale_checkpoints(str(out), keep=str(out / "checkpoint-8"))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    drop_stale_checkpoints(str(out), keep=None)  # a fresh start: nothing is kept
    assert list(out.glob("checkpoint-*")) == []


def test_the_regression_tasks_eval_set_samples_the_function_its_training_set_fits():
    """Its eval_loss measures the trained function on new samples: the eval set drew its own weights before, so a
    perfect fit of the training set scored like a random guess."""
    import torch

    from kubetrain_trainer.args import TrainingArguments
    from kubetrain_trainer.builtin import RegressionTask

    _, train, evaluation = RegressionTask(num_samples=256, eval_samples=64).build(
        TrainingArguments(output_dir="unused", data_seed=7))
    assert not torch.equal(train.x[:64], evaluation.x)  # other samples
    fit = torch.linalg.lstsq(train.x, train.y.unsqueeze(1)).solution.squeeze(1)
    error = ((evaluation.x @ fit - evaluation.y) ** 2).mean().item()
    assert error < 0.01, error  # the noise's variance is 1e-4; another function's would be ~2 x in_features
