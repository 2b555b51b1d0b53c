"""Every method the HF guide names as overridable: a subclass overrides it and training, evaluation or
prediction uses the override, called with the HF signature where the HF Trainer calls it."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader

from kubetrain_trainer import Trainer
from kubetrain_trainer.checkpoint import list_checkpoints


@pytest.fixture
def gpt_trainer(tiny_gpt, tokens, make_args):
    """Factory: Trainer subclass `cls` on a TinyGPT with 24 training and 6 eval sequences."""

    def make(cls=Trainer, **args):
        return cls(model=tiny_gpt(dropout=0.0), args=make_args(**{"save_strategy": "no", **args}),
                   train_dataset=tokens(24), eval_dataset=tokens(6, seed=1))

    return make


def test_get_train_dataloader_override_feeds_training(gpt_trainer):
    seen = []

    class Custom(Trainer):
        def get_train_dataloader(self) -> DataLoader:
            loader = super().get_train_dataloader()
            collate = loader.collate_fn
            loader.collate_fn = lambda items: seen.append(len(items)) or collate(items)
            return loader

    gpt_trainer(Custom, max_steps=3).train()
    assert seen == [4, 4, 4]


def test_get_eval_dataloader_override_feeds_evaluate(gpt_trainer):
    calls = []

    class Custom(Trainer):
        def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
            calls.append(eval_dataset)
            return super().get_eval_dataloader(eval_dataset)

    trainer = gpt_trainer(Custom, max_steps=2, eval_strategy="steps", eval_steps=1)
    trainer.train()
    assert calls == [None, None]


def test_get_test_dataloader_override_feeds_predict(gpt_trainer, tokens):
    calls = []

    class Custom(Trainer):
        def get_test_dataloader(self, test_dataset) -> DataLoader:
            calls.append(len(test_dataset))
            return super().get_test_dataloader(test_dataset)

    result = gpt_trainer(Custom).predict(tokens(5, seed=2))
    assert calls == [5] and result.predictions.shape == (5, 8, 32)


def test_log_override_receives_training_and_eval_logs(gpt_trainer):
    class Custom(Trainer):
        def log(self, logs, start_time=None):
            super().log({**logs, "custom": 1.0}, start_time)

    trainer = gpt_trainer(Custom, max_steps=2, eval_strategy="steps", eval_steps=2)
    trainer.train()
    history = trainer.state.log_history
    assert all(e["custom"] == 1.0 for e in history)
    assert {"loss", "eval_loss", "train_runtime"} <= {k for e in history for k in e}


def test_create_optimizer_and_scheduler_override_builds_what_training_uses(gpt_trainer):
    class Custom(Trainer):
        def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 0.1)
            self.steps_asked = num_training_steps

    trainer = gpt_trainer(Custom, max_steps=3)
    trainer.train()
    assert trainer.steps_asked == 3 and isinstance(trainer.optimizer, torch.optim.SGD)
    assert [e["learning_rate"] for e in trainer.state.log_history if "loss" in e] == pytest.approx([0.05] * 3)


def test_create_optimizer_override_is_the_training_optimizer(gpt_trainer):
    class Custom(Trainer):
        def create_optimizer(self, model=None):
            if self.optimizer is None:
                self.optimizer = torch.optim.SGD((model or self.model).parameters(), lr=0.3)
            return self.optimizer

    trainer = gpt_trainer(Custom, max_steps=2, lr_scheduler_type="constant")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    assert [e["learning_rate"] for e in trainer.state.log_history if "loss" in e] == [0.3, 0.3]
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_create_scheduler_override_sets_the_learning_rates(gpt_trainer):
    class Custom(Trainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer or self.optimizer, 1, gamma=0.5)
            return self.lr_scheduler

    trainer = gpt_trainer(Custom, max_steps=3, learning_rate=0.04)
    trainer.train()
    # The rate each step used (as HF logs it), not the one the scheduler set after it.
    assert [e["learning_rate"] for e in trainer.state.log_history if "loss" in e] == pytest.approx([0.04, 0.02, 0.01])


class ScaledLoss(Trainer):
    """The guide's compute_loss signature, (model, inputs, return_outputs=False): 3 x the model's loss."""

    def compute_loss(self, model, inputs, return_outputs=False):
        outputs = model(**inputs)
        loss = 3 * outputs["loss"]
        return (loss, outputs) if return_outputs else loss


def test_compute_loss_with_the_guides_signature_drives_training_and_evaluation(gpt_trainer):
    plain, scaled = gpt_trainer(max_steps=2), gpt_trainer(ScaledLoss, max_steps=2)
    plain_loss, scaled_loss = plain.evaluate()["eval_loss"], scaled.evaluate()["eval_loss"]
    assert scaled_loss == pytest.approx(3 * plain_loss)  # same weights: the eval loss is the subclass's
    out = scaled.train()
    assert out.training_loss == pytest.approx(3 * plain.train().training_loss, rel=0.2)


def test_compute_loss_with_num_items_in_batch_gets_the_label_count(gpt_trainer):
    counts = []

    class Counting(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            counts.append(("train" if model.training else "eval", int(num_items_in_batch)))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    gpt_trainer(Counting, max_steps=1, per_device_eval_batch_size=6, eval_strategy="steps", eval_steps=1).train()
    assert counts == [("train", 4 * 8), ("eval", 6 * 8)]


def test_training_step_override_gets_the_hf_signature(gpt_trainer):
    calls = []

    class Custom(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            calls.append((inputs["input_ids"].shape[0], int(num_items_in_batch),
                          self.current_gradient_accumulation_steps))
            return super().training_step(model, inputs, num_items_in_batch)

    trainer = gpt_trainer(Custom, max_steps=2, gradient_accumulation_steps=2, per_device_train_batch_size=2)
    trainer.train()
    assert calls == [(2, 16, 2)] * 4


def test_prediction_step_override_serves_evaluate_and_predict(gpt_trainer, tokens):
    calls = []

    class Custom(Trainer):
        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            calls.append(prediction_loss_only)
            loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            return loss * 0 + 7, logits, labels

    trainer = gpt_trainer(Custom, per_device_eval_batch_size=6)
    assert trainer.evaluate()["eval_loss"] == 7
    assert trainer.predict(tokens(6, seed=1)).metrics["test_loss"] == 7
    assert calls == [True, False]


def test_evaluate_override_is_what_the_loop_calls(gpt_trainer):
    class Custom(Trainer):
        def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
            metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
            return {**metrics, "eval_loss": 100.0 - self.state.global_step}

    trainer = gpt_trainer(Custom, max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                          save_steps=2, load_best_model_at_end=True)
    trainer.train()
    assert trainer.state.best_metric == 96.0  # the override's numbers ranked the checkpoints


def test_predict_override_post_processes_predictions(gpt_trainer, tokens):
    class Custom(Trainer):
        def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="test"):
            out = super().predict(test_dataset, ignore_keys, metric_key_prefix)
            return out._replace(predictions=out.predictions.argmax(-1))

    result = gpt_trainer(Custom).predict(tokens(5, seed=2), metric_key_prefix="holdout")
    assert result.predictions.shape == (5, 8) and "holdout_loss" in result.metrics


def test_save_state_writes_trainer_state_json(gpt_trainer, tmp_path):
    trainer = gpt_trainer(max_steps=2)
    trainer.train()
    trainer.save_state()
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and [e["step"] for e in state["log_history"]][:2] == [1, 2]


def test_process_zero_methods_and_an_override_that_silences_saving(gpt_trainer, tmp_path):
    trainer = gpt_trainer(max_steps=1)
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()

    class Silent(Trainer):
        def is_world_process_zero(self) -> bool:
            return False

    silent = gpt_trainer(Silent, max_steps=1, output_dir=str(tmp_path / "silent"))
    silent.train()
    silent.save_state()
    silent.save_model()
    assert not (tmp_path / "silent" / "trainer_state.json").exists()
    assert not (tmp_path / "silent" / "model.safetensors").exists()


class ScriptedEvalLoss(Trainer):
    """A subclass whose eval loss is its own: best at step 4, worse before and after."""

    SCRIPT = {2: 3.0, 4: 1.0, 6: 2.0, 8: 4.0}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        if not model.training:
            loss = loss * 0 + self.SCRIPT[self.state.global_step]
        return (loss, outputs) if return_outputs else loss


def test_best_checkpoint_by_loss_follows_the_subclass_eval_loss(gpt_trainer, tmp_path):
    trainer = gpt_trainer(ScriptedEvalLoss, max_steps=8, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                          save_steps=2, save_total_limit=1, load_best_model_at_end=True)
    trainer.train()
    out = tmp_path / "out"
    assert [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e] == [3.0, 1.0, 2.0, 4.0]
    assert trainer.args.metric_for_best_model == "loss" and trainer.state.best_metric == 1.0
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-4")
    assert [s for s, _ in list_checkpoints(out)] == [4, 8]


def test_a_collator_returning_a_mapping_that_is_not_a_dict(tiny_gpt, tokens, make_args):
    # HF's data collators return a BatchEncoding (a UserDict): it must reach the model as keyword
    # arguments, and count its samples when eval losses are weighted (5 = a batch of 4 and one of 1).
    from collections import UserDict

    from torch.utils.data import default_collate

    def collate(items):
        return UserDict(default_collate(items))

    plain = Trainer(model=tiny_gpt(dropout=0.0), args=make_args(per_device_eval_batch_size=4),
                    eval_dataset=tokens(5, seed=1))
    wrapped = Trainer(model=tiny_gpt(dropout=0.0), args=make_args(max_steps=1, per_device_eval_batch_size=4),
                      train_dataset=tokens(8), eval_dataset=tokens(5, seed=1), data_collator=collate)
    assert wrapped.evaluate()["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-6)
    assert wrapped.train().global_step == 1
