"""Callbacks written for the HF Trainer, and callback state across a resume, as in transformers 5.x.

A plain `transformers.TrainerCallback` subclass has no `state()` / `load_state()`:
it must run through saves and resumes. HF's stateful callbacks
(`ExportableState`: `state()` returns {"args": ..., "attributes": ...}) are
saved under their class name and, on resume, rebuilt from the saved args and
given the saved attributes, as HF's `Trainer._load_callback_state` does.
kubetrain's own `EarlyStoppingCallback` saves HF's layout under the same name,
so a run may resume with either one.
"""

from __future__ import annotations

import json
import logging

import torch
from transformers import EarlyStoppingCallback as HFEarlyStopping
from transformers import TrainerCallback as HFTrainerCallback

from kubetrain_trainer import EarlyStoppingCallback, Trainer, TrainerCallback, TrainerState
from kubetrain_trainer.callbacks import CallbackHandler
from kubetrain_trainer.models import SyntheticRegression, TinyMLP


class Scripted:
    """compute_metrics returning a scripted `score` per evaluation."""

    def __init__(self, values):
        self.values = list(values)

    def __call__(self, prediction):
        return {"score": self.values.pop(0)}


class SaveSteps(HFTrainerCallback):
    """An HF callback as users write them: no state of its own."""

    def __init__(self):
        self.saved = []

    def on_save(self, args, state, control, **kwargs):
        self.saved.append(state.global_step)


def _trainer(make_args, callbacks, scores, **kw):
    args = make_args(**{**dict(max_steps=4, eval_strategy="steps", eval_steps=2, save_steps=2,
                                metric_for_best_model="score", greater_is_better=False), **kw})
    torch.manual_seed(0)
    return Trainer(model=TinyMLP(), args=args, train_dataset=SyntheticRegression(32),
                   eval_dataset=SyntheticRegression(8, seed=1), compute_metrics=Scripted(scores), callbacks=callbacks)


def _saved_callbacks(tmp_path, step):
    return json.loads((tmp_path / "out" / f"checkpoint-{step}" / "trainer_state.json").read_text())["stateful_callbacks"]


def test_a_plain_hf_callback_runs_through_saves_and_a_resume(make_args, tmp_path):
    first = SaveSteps()
    _trainer(make_args, [first], [3, 2]).train()
    assert first.saved == [2, 4]
    assert _saved_callbacks(tmp_path, 2).keys() == {"TrainerControl"}  # only the loop's control, as HF saves it
    again = SaveSteps()
    out = _trainer(make_args, [again], [1, 0], max_steps=6).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    assert out.global_step == 6 and again.saved == [6]


def test_hf_early_stopping_is_saved_and_rebuilt_as_hf_does(make_args, tmp_path):
    # Scores 1 then 2: at step 4 the metric has not improved once; saved there with patience 2.
    hf = HFEarlyStopping(early_stopping_patience=2)
    _trainer(make_args, [hf], [1, 2]).train()
    saved = _saved_callbacks(tmp_path, 4)["EarlyStoppingCallback"]
    assert saved == hf.state() == {"args": {"early_stopping_patience": 2, "early_stopping_threshold": 0.0},
                                   "attributes": {"early_stopping_patience_counter": 1}}
    # Resumed with another instance (patience 10): HF rebuilds it from the saved args and attributes, so the
    # next evaluation without improvement (step 6) is the second in a row and stops training.
    passed = HFEarlyStopping(early_stopping_patience=10)
    trainer = _trainer(make_args, [passed], [3, 3, 3], max_steps=10)
    out = trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    assert out.global_step == 6
    restored = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, HFEarlyStopping)]
    assert len(restored) == 1 and restored[0] is not passed
    assert (restored[0].early_stopping_patience, restored[0].early_stopping_patience_counter) == (2, 2)


def test_a_run_resumes_with_either_early_stopping_callback(make_args, tmp_path):
    checkpoint = str(tmp_path / "out" / "checkpoint-4")
    ours = EarlyStoppingCallback(early_stopping_patience=2)
    _trainer(make_args, [ours], [1, 2]).train()
    saved = _saved_callbacks(tmp_path, 4)["EarlyStoppingCallback"]
    assert saved["attributes"]["early_stopping_patience_counter"] == 1 and saved["args"]["early_stopping_patience"] == 2
    # kubetrain's -> HF's: rebuilt with the saved patience (2) and counter (1), it stops at the next evaluation.
    trainer = _trainer(make_args, [HFEarlyStopping(early_stopping_patience=5)], [3, 3], max_steps=10)
    assert trainer.train(resume_from_checkpoint=checkpoint).global_step == 6
    # HF's -> kubetrain's (checkpoint-6 saved by HF's callback: counter 2, no best value of its own, so it
    # compares with state.best_metric as HF's does; the patience is this run's, 3): one more evaluation stops it.
    ours = EarlyStoppingCallback(early_stopping_patience=3)
    trainer = _trainer(make_args, [ours], [3], max_steps=10)
    assert trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-6")).global_step == 8
    assert ours.early_stopping_patience_counter == ours.patience_counter == 3


def test_early_stopping_state_layouts_load_without_breaking_the_resume(caplog):
    # kubetrain's layout before it used HF's: its own callback still reads it ...
    legacy = {"EarlyStoppingCallback": {"patience_counter": 2, "best": 0.5}}
    ours = EarlyStoppingCallback(4)
    CallbackHandler([ours]).load_states(TrainerState(stateful_callbacks=legacy))
    assert (ours.early_stopping_patience_counter, ours.best) == (2, 0.5)
    # ... HF's cannot: it starts afresh, with a warning, and the resume goes on.
    hf = HFEarlyStopping(4)
    handler = CallbackHandler([hf])
    with caplog.at_level(logging.WARNING, logger="kubetrain_trainer"):
        handler.load_states(TrainerState(stateful_callbacks=legacy))
    assert handler.callbacks == [hf] and hf.early_stopping_patience_counter == 0
    assert "not in HF's {args, attributes} layout" in caplog.text


class Counter(TrainerCallback):
    def __init__(self, start=0):
        self.count = start

    def state(self):
        return {"count": self.count}

    def load_state(self, state):
        self.count = state["count"]


def test_callbacks_of_one_class_are_saved_as_a_list_and_restored_in_order(caplog):
    state = TrainerState()
    CallbackHandler([Counter(1), SaveSteps(), Counter(2)]).save_states(state)
    assert state.stateful_callbacks == {"Counter": [{"count": 1}, {"count": 2}]}
    a, b = Counter(), Counter()
    state.stateful_callbacks["Gone"] = {"args": {}, "attributes": {}}
    with caplog.at_level(logging.WARNING, logger="kubetrain_trainer"):
        CallbackHandler([a, b]).load_states(state)
    assert (a.count, b.count) == (1, 2)
    assert "Gone" in caplog.text


def test_early_stopping_state_is_readable_by_an_older_image_and_by_hf():
    """A job whose image is rolled back must still resume: the state keeps the earlier kubetrain keys beside
    HF's layout (an older image's load_state read state["patience_counter"] and state["best"])."""
    cb = EarlyStoppingCallback(early_stopping_patience=3)
    cb.early_stopping_patience_counter, cb.best = 2, 0.5
    saved = json.loads(json.dumps(cb.state()))

    def older_load_state(state):  # kubetrain_trainer/callbacks.py before 2026-12-05
        return state["patience_counter"], state["best"]

    assert older_load_state(saved) == (2, 0.5)
    handler = CallbackHandler([HFEarlyStopping(early_stopping_patience=5)])
    handler.load_states(TrainerState(stateful_callbacks={"EarlyStoppingCallback": saved}))
    restored = handler.callbacks[0]
    assert isinstance(restored, HFEarlyStopping) and restored.early_stopping_patience_counter == 2
    again = EarlyStoppingCallback(early_stopping_patience=3)
    again.load_state(saved)
    assert (again.early_stopping_patience_counter, again.best) == (2, 0.5)
