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
