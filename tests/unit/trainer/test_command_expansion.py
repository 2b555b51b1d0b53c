"""The launcher expands `$(NAME)` in the user's command for the variables only it sets (command.py)."""

import pytest

from kubetrain_trainer.command import LAUNCHER_SET, expand_command
from kubetrain_trainer.launch import worker_env
from kubetrain_trainer.launch_config import LaunchConfig

# As in a pod: the image's ENV names the local folder too, and Kubernetes left the reference alone.
POD = {"KUBETRAIN_LOCAL_CHECKPOINT_DIR": "/tmp/kubetrain/checkpoints", "HOME": "/tmp/home", "MASTER_PORT": "29500"}
WORKER = {**POD, "RANK": "3"}


@pytest.mark.parametrize("arg, expected", [
    ("$(KUBETRAIN_LOCAL_CHECKPOINT_DIR)", "/tmp/kubetrain/checkpoints"),
    ("--output_dir=$(KUBETRAIN_LOCAL_CHECKPOINT_DIR)/run", "--output_dir=/tmp/kubetrain/checkpoints/run"),
    ("rank$(RANK)-of-$(RANK)", "rank3-of-3"),
    # Names in the pod spec were Kubernetes' to expand: what is left is the user's escaped literal.
    ("$(HOME)", "$(HOME)"),
    ("$(MASTER_PORT)", "$(MASTER_PORT)"),
    ("$(KUBETRAIN_RESUME_FROM)", "$(KUBETRAIN_RESUME_FROM)"),  # nothing restored: left as written
    ("$(NOT_SET_ANYWHERE)", "$(NOT_SET_ANYWHERE)"),
    ("$KUBETRAIN_LOCAL_CHECKPOINT_DIR", "$KUBETRAIN_LOCAL_CHECKPOINT_DIR"),  # shell syntax: no shell here
    ("plain", "plain"),
])
def test_launcher_expands_only_its_own_variables(arg, expected):
    assert expand_command(["python", arg], WORKER) == ["python", expected]


def test_every_expanded_name_is_one_the_launcher_sets_for_its_workers(tmp_path):
    cfg = LaunchConfig.from_env({"NNODES": "1", "NODE_RANK": "0", "NPROC_PER_NODE": "2", "MASTER_ADDR": "x",
                                 "MASTER_PORT": "29500", "KUBETRAIN_LOCAL_CHECKPOINT_DIR": str(tmp_path)},
                                ["--", "python", "train.py"])
    env = worker_env(cfg, 1, {}, tmp_path / "checkpoint-5")
    assert LAUNCHER_SET <= set(env), LAUNCHER_SET - set(env)
    assert expand_command(["$(LOCAL_RANK)", "$(KUBETRAIN_RESUME_FROM)"], env) == ["1", str(tmp_path / "checkpoint-5")]


SECRET, TOKEN = "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY", "hf_SuperSecretValue123"


def test_the_launchers_log_line_masks_secret_values_the_kubelet_put_into_the_command(tmp_path):
    """The kubelet expands `$(HF_TOKEN)` from a secretKeyRef before the launcher starts; the launcher logged the
    whole command at INFO (and a crash's log tail can become the pod's termination message)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": SECRET, "HF_TOKEN": TOKEN, "KUBETRAIN_METRICS_PORT": "0",
           "KUBETRAIN_LOCAL_CHECKPOINT_DIR": str(tmp_path / "ck"), "KUBETRAIN_TERMINATION_LOG": str(tmp_path / "t")}
    env.pop("KUBETRAIN_CHECKPOINT_URI", None)
    done = subprocess.run([sys.executable, "-m", "kubetrain_trainer.launch", "--", sys.executable, "-c",
                           "import sys; sys.exit(3)", "--s3_secret", SECRET, "--hub_token", TOKEN,
                           f"--creds=s3://me:{SECRET}@host"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert "started 1 worker(s)" in done.stderr and "--hub_token ***" in done.stderr, done.stderr
    assert SECRET not in done.stderr and TOKEN not in done.stderr, done.stderr


@pytest.mark.parametrize("command, expected", [
    (["train.py", "--hub_token", TOKEN], "train.py --hub_token ***"),
    (["train.py", "--password=hunter22"], "train.py --password=***"),
    (["train.py", f"--uri=s3://x:{SECRET}@h"], "train.py --uri=s3://***@h"),  # by value, then the URL rule
    (["train.py", "--lr", "0.1", "--output_dir", "/out"], "train.py --lr 0.1 --output_dir /out"),
    (["bash", "-c", "python train.py --hub_token hf_other1234 --bf16 true"],
     "bash -c python train.py --hub_token *** --bf16 true"),  # a flag inside one argument
    (["train.py", "--data", "s3://user:hunter2pass@minio:9000/d"], "train.py --data s3://***@minio:9000/d"),
    (["train.py", "--bf16", "true", "--auth_type", "basic"], "train.py --bf16 true --auth_type basic"),
    (["train.py", "--tokenizer_name", "gpt2", "--max_new_tokens", "5"],  # not a secret's flags
     "train.py --tokenizer_name gpt2 --max_new_tokens 5"),
])
def test_shown_command(command, expected):
    from kubetrain_trainer.command import shown_command

    env = {"AWS_SECRET_ACCESS_KEY": SECRET, "HOME": "/root", "KEYBOARD": "us", "AUTH_MODE": "true"}
    assert shown_command(command, env) == expected
