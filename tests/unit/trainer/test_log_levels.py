"""log_level, log_level_replica, log_on_each_node and get_process_log_level(), as the HF Trainer defines them.

The several-process, several-node version with real gloo process groups is in
tests/slow/trainer/test_log_levels_processes.py.
"""

from __future__ import annotations

import logging

import pytest

from kubetrain_trainer import Trainer, TrainingArguments
from kubetrain_trainer.models import SyntheticRegression, TinyMLP

D, I, W, E = logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR  # noqa: E741 - one letter per column


@pytest.fixture
def trainer_logger():
    """The trainer's logger, its level restored after the test (the app's setting is global state)."""
    logger = logging.getLogger("kubetrain_trainer")
    level = logger.level
    yield logger
    logger.setLevel(level)


# (RANK, LOCAL_RANK, log_on_each_node, expected level) with log_level=debug, log_level_replica=error.
CASES = [
    ("0", "0", True, D),    # node 0's main process
    ("1", "0", True, D),    # node 1's main process logs like a main process on every node
    ("1", "0", False, E),   # ... but not when only node 0 logs
    ("1", "1", True, E),    # a second process on node 0 is a replica either way
    ("1", "1", False, E),
    ("0", "0", False, D),
]


@pytest.mark.parametrize("rank,local_rank,each_node,expected", CASES)
def test_process_log_level_by_rank_node_and_log_on_each_node(monkeypatch, rank, local_rank, each_node, expected):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    args = TrainingArguments(log_level="debug", log_level_replica="error", log_on_each_node=each_node)
    assert args.get_process_log_level() == expected
    assert args.should_log == (expected == D)


def test_passive_answers_the_level_in_effect(monkeypatch, trainer_logger):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    trainer_logger.setLevel(E)
    assert TrainingArguments(log_level_replica="passive").get_process_log_level() == E
    assert TrainingArguments().get_process_log_level() == W  # the replica default is warning, as in HF


def test_passive_leaves_the_applications_level_alone(make_args, trainer_logger):
    trainer_logger.setLevel(E)
    Trainer(model=TinyMLP(), args=make_args(), train_dataset=SyntheticRegression(8))
    assert trainer_logger.level == E
    trainer_logger.setLevel(D)
    Trainer(model=TinyMLP(), args=make_args(log_level="passive"), train_dataset=SyntheticRegression(8))
    assert trainer_logger.level == D


def test_an_explicit_log_level_is_applied_to_the_main_process(make_args, trainer_logger):
    trainer_logger.setLevel(E)
    Trainer(model=TinyMLP(), args=make_args(log_level="info"), train_dataset=SyntheticRegression(8))
    assert trainer_logger.level == I


def test_log_level_names_are_checked():
    with pytest.raises(ValueError, match=r"log_level: 'verbose' is not one of .*'passive'"):
        TrainingArguments(log_level="verbose")
