"""The launcher expands `$(NAME)` in the user's command for the variables only it sets (command.py)."""

import pytest

from kubetrain_trainer.command import expand_command

WORKER = {"KUBETRAIN_LOCAL_CHECKPOINT_DIR": "/tmp/kubetrain/checkpoints", "RANK": "3", "HOME": "/tmp/home"}
POD = {"HOME": "/tmp/home"}


@pytest.mark.parametrize("arg, expected", [
    ("$(KUBETRAIN_LOCAL_CHECKPOINT_DIR)", "/tmp/kubetrain/checkpoints"),
    ("--output_dir=$(KUBETRAIN_LOCAL_CHECKPOINT_DIR)/run", "--output_dir=/tmp/kubetrain/checkpoints/run"),
    ("rank$(RANK)-of-$(RANK)", "rank3-of-3"),
    # The pod's env was Kubernetes' to expand: what is left is the user's escaped literal.
    ("$(HOME)", "$(HOME)"),
    ("$(NOT_SET_ANYWHERE)", "$(NOT_SET_ANYWHERE)"),
    ("$KUBETRAIN_LOCAL_CHECKPOINT_DIR", "$KUBETRAIN_LOCAL_CHECKPOINT_DIR"),  # shell syntax: no shell here
    ("$(1BAD)", "$(1BAD)"),
    ("plain", "plain"),
])
def test_launcher_expands_only_its_own_variables(arg, expected):
    assert expand_command(["python", arg], WORKER, POD) == ["python", expected]
