"""A user's own script whose TrainingArguments can never work: under the launcher the pod exits 82 (invalid
configuration: the job fails at once), not 1 (an application failure, retried until backoffLimit)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = "from kubetrain_trainer import TrainingArguments\nTrainingArguments(output_dir='out', save_steps=0)\n"


def test_a_users_script_with_invalid_arguments_makes_the_pod_exit_82(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "KUBETRAIN_METRICS_PORT": "0", "KUBETRAIN_LOCAL_CHECKPOINT_DIR": str(tmp_path / "ck"),
           "KUBETRAIN_TERMINATION_LOG": str(tmp_path / "termination")}
    env.pop("KUBETRAIN_CHECKPOINT_URI", None)
    launched = subprocess.run([sys.executable, "-m", "kubetrain_trainer.launch", "--", sys.executable, str(script)],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert launched.returncode == 82, launched.stderr
    assert "kubetrain: invalid configuration: invalid training arguments" in launched.stderr
    assert "save_steps > 0" in launched.stderr and "Traceback" in launched.stderr, "the usual traceback too"


def test_outside_the_launcher_python_exits_as_usual(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KUBETRAIN_SYNC_BY_LAUNCHER"}
    plain = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
    assert plain.returncode == 1 and "ConfigError" in plain.stderr


def test_an_unknown_metric_for_best_model_is_a_key_error_as_in_hf_and_a_config_error(tiny_gpt, tokens, make_args):
    """It shows at the first evaluation, and every retry would evaluate the same metrics: exit 82 in a pod
    (a ConfigError), while code that catches HF's KeyError still does."""
    import pytest

    from kubetrain_trainer import ConfigError, Trainer

    args = make_args(eval_strategy="steps", eval_steps=2, save_steps=2, metric_for_best_model="accuracy",
                     load_best_model_at_end=True, max_steps=4)
    trainer = Trainer(model=tiny_gpt(0), args=args, train_dataset=tokens(), eval_dataset=tokens(8, seed=1))
    with pytest.raises(ConfigError, match=r"^metric_for_best_model 'accuracy' not in the eval metrics") as err:
        trainer.train()
    assert isinstance(err.value, KeyError)


def test_under_the_launcher_with_storage_output_dir_must_be_the_uploaded_folder(tiny_gpt, tokens, make_args,
                                                                               tmp_path, monkeypatch):
    """An HF script's output_dir="my_model" in a pod: the launcher uploads only KUBETRAIN_LOCAL_CHECKPOINT_DIR, so
    its checkpoints were never stored and a preempted attempt started over, silently."""
    import pytest

    from kubetrain_trainer import ConfigError, Trainer

    local = tmp_path / "ck"
    monkeypatch.setenv("KUBETRAIN_SYNC_BY_LAUNCHER", "1")
    monkeypatch.setenv("KUBETRAIN_LOCAL_CHECKPOINT_DIR", str(local))
    monkeypatch.setenv("KUBETRAIN_CHECKPOINT_URI", "s3://b/p")
    with pytest.raises(ConfigError, match=r"output_dir '.*my_model' is not the folder the launcher uploads"):
        Trainer(model=tiny_gpt(0), args=make_args(output_dir=str(tmp_path / "my_model")), train_dataset=tokens())
    with pytest.raises(ConfigError, match="itself"):  # the watcher looks at local's children only: not uploaded
        Trainer(model=tiny_gpt(0), args=make_args(output_dir=str(local / "run")), train_dataset=tokens())
    Trainer(model=tiny_gpt(0), args=make_args(output_dir=str(local)), train_dataset=tokens())
    Trainer(model=tiny_gpt(0), args=make_args(output_dir=str(tmp_path / "eval"), save_strategy="no"),
            train_dataset=tokens())  # an evaluation-only Trainer saves no checkpoint
    monkeypatch.delenv("KUBETRAIN_CHECKPOINT_URI")  # no storage: nothing to upload, any folder will do
    Trainer(model=tiny_gpt(0), args=make_args(output_dir=str(tmp_path / "my_model")), train_dataset=tokens())
