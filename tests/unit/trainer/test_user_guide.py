"""The HF Trainer user guide, run as written on kubetrain's Trainer with a tiny GPT-2 (Hub pushing left out).

Each test is one of the guide's examples, with a comment naming the behaviour it pins down. The model,
tokenizer and data are built locally (no downloads): a 1-layer GPT-2, a word-level tokenizer wrapped as
a fast tokenizer (the `processing_class`), and the guide's language-modelling data collator.
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from kubetrain_trainer import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from kubetrain_trainer.checkpoint import list_checkpoints  # noqa: E402

WORDS = "[PAD] [UNK] [EOS] the a cat dog bird sat ran flew on under over mat rug tree".split()
SUBJECTS, VERBS, PLACES = ["cat", "dog", "bird"], ["sat", "ran", "flew"], ["mat", "rug", "tree"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                                eos_token="[EOS]")


def sentences(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"the {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(['on', 'under', 'over'])} "
            f"{rng.choice(['the', 'a'])} {rng.choice(PLACES)} [EOS]" for _ in range(n)]


@pytest.fixture(scope="module")
def datasets(tokenizer):
    """(train, eval): lists of tokenized examples, as `dataset.map(tokenize)` would give."""
    return ([tokenizer(s) for s in sentences(48, seed=0)], [tokenizer(s) for s in sentences(8, seed=1)])


@pytest.fixture
def model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(WORDS), n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     pad_token_id=0, eos_token_id=2, bos_token_id=2)
    return transformers.GPT2LMHeadModel(config)


@pytest.fixture
def collator(tokenizer):
    # Fixed-length batches (pad_to_multiple_of): predictions of different batches stack for compute_metrics.
    return transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False, pad_to_multiple_of=16)


def compute_metrics(eval_pred):
    """The guide's compute_metrics shape: EvalPrediction(predictions, label_ids) -> {name: value}."""
    logits, labels = eval_pred.predictions, eval_pred.label_ids
    predicted, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    mask = target != -100
    return {"accuracy": float((predicted[mask] == target[mask]).mean())}


def guide_args(tmp_path, **overrides) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path / "my_model"), learning_rate=2e-3, per_device_train_batch_size=8,
                per_device_eval_batch_size=8, num_train_epochs=2, weight_decay=0.01, eval_strategy="epoch",
                save_strategy="epoch", load_best_model_at_end=True, report_to=["none"], disable_tqdm=True)
    return TrainingArguments(**{**base, **overrides})


def test_the_guides_basic_usage_end_to_end(model, tokenizer, collator, datasets, tmp_path):
    # The guide's whole flow: TrainingArguments -> Trainer(model, args, datasets, processing_class,
    # data_collator, compute_metrics) -> train() -> checkpoints per epoch, the best model loaded at the
    # end, save_model() writing what from_pretrained (model and tokenizer) loads back.
    train, evals = datasets
    trainer = Trainer(model=model, args=guide_args(tmp_path), train_dataset=train, eval_dataset=evals,
                      processing_class=tokenizer, data_collator=collator, compute_metrics=compute_metrics)
    out = trainer.train()
    assert out.global_step == 12 and np.isfinite(out.training_loss)
    evals_logged = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["epoch"] for e in evals_logged] == [1.0, 2.0]
    assert all(0.0 <= e["eval_accuracy"] <= 1.0 for e in evals_logged)
    assert [s for s, _ in list_checkpoints(tmp_path / "my_model")] == [6, 12]
    best = min(evals_logged, key=lambda e: e["eval_loss"])
    assert trainer.state.best_metric == best["eval_loss"]
    trainer.save_model(str(tmp_path / "final"))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "final")("the cat sat")["input_ids"] == [3, 5, 8]


def test_resume_from_the_newest_checkpoint_or_a_named_one(tokenizer, collator, datasets, tmp_path):
    # train(resume_from_checkpoint=True) continues from the newest checkpoint in output_dir;
    # train(resume_from_checkpoint="<output_dir>/checkpoint-N") from that one.
    train, evals = datasets

    def trainer(**overrides):
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=len(WORDS), n_positions=16, n_embd=16, n_layer=1, n_head=2)
        return Trainer(model=transformers.GPT2LMHeadModel(config),
                       args=guide_args(tmp_path, load_best_model_at_end=False, eval_strategy="no", logging_steps=1,
                                       **overrides),
                       train_dataset=train, processing_class=tokenizer, data_collator=collator)

    trainer(num_train_epochs=1).train()
    resumed = trainer(num_train_epochs=2)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 12 and resumed.state.log_history[0]["step"] == 1  # history came along
    named = trainer(num_train_epochs=2, output_dir=str(tmp_path / "named"))
    named.train(resume_from_checkpoint=str(tmp_path / "my_model" / "checkpoint-6"))
    losses = [e["loss"] for e in named.state.log_history if "loss" in e]
    assert len(losses) == 12 and losses == [e["loss"] for e in resumed.state.log_history if "loss" in e]


WEIGHTS = torch.ones(len(WORDS))
WEIGHTS[WORDS.index("[EOS]")] = 3.0


class WeightedLossTrainer(Trainer):
    """The guide's compute_loss example, word for word in shape: pop the labels, weighted cross-entropy."""

    def compute_loss(self, model, inputs, return_outputs=False):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.get("logits")
        loss_fct = nn.CrossEntropyLoss(weight=WEIGHTS.to(logits.device))
        loss = loss_fct(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return (loss, outputs) if return_outputs else loss


def test_a_compute_loss_subclass_is_the_training_and_the_eval_loss(model, collator, datasets, tmp_path):
    # A subclass overriding compute_loss (the guide's signature, without num_items_in_batch) trains on its
    # loss and evaluate() reports that loss as eval_loss (so metric_for_best_model="loss" ranks by it).
    train, evals = datasets
    trainer = WeightedLossTrainer(model=model, args=guide_args(tmp_path, num_train_epochs=1), train_dataset=train,
                                  eval_dataset=evals, data_collator=collator)
    trainer.train()
    batch = collator(evals)  # the whole eval set is one batch
    model.eval()
    with torch.no_grad():
        expected = WeightedLossTrainer.compute_loss(trainer, model, dict(batch))
    assert trainer.evaluate()["eval_loss"] == pytest.approx(expected.item(), rel=1e-6)
    with torch.no_grad():
        plain = model(**batch).loss.item()
    assert abs(expected.item() - plain) > 1e-3  # the weights matter: this is not the model's own loss


class StopAtStep(TrainerCallback):
    """The guide's custom callback: stop training after `num_steps` steps."""

    def __init__(self, num_steps=10):
        self.num_steps = num_steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.num_steps:
            control.should_training_stop = True
        return control


def test_a_stopping_callback_ends_training(model, collator, datasets, tmp_path):
    # callbacks=[...] at construction (and add_callback) hook into the loop; setting
    # control.should_training_stop ends training after that step.
    train, _ = datasets
    trainer = Trainer(model=model, args=guide_args(tmp_path, eval_strategy="no", load_best_model_at_end=False),
                      train_dataset=train, data_collator=collator, callbacks=[StopAtStep(num_steps=4)])
    assert trainer.train().global_step == 4


@pytest.fixture
def restore_logging():
    loggers = [logging.getLogger(), logging.getLogger("kubetrain_trainer"), logging.getLogger(__name__)]
    levels, handlers = [lg.level for lg in loggers], list(logging.getLogger().handlers)
    yield
    for lg, level in zip(loggers, levels):
        lg.setLevel(level)
    logging.getLogger().handlers[:] = handlers


@pytest.mark.parametrize("log_level,expected", [("info", logging.INFO), ("error", logging.ERROR),
                                                ("passive", logging.DEBUG)])
def test_the_guides_logging_recipe(model, collator, datasets, tmp_path, restore_logging, log_level, expected):
    # The guide's logging recipe: basicConfig, then get_process_log_level() (before the Trainer exists)
    # for the script's own logger and the libraries'. The Trainer then logs at that level; "passive"
    # keeps whatever the application had set (here: debug).
    logging.getLogger("kubetrain_trainer").setLevel(logging.DEBUG)
    logger = logging.getLogger(__name__)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    training_args = guide_args(tmp_path, log_level=log_level, eval_strategy="no", load_best_model_at_end=False)
    log_level_now = training_args.get_process_log_level()
    logger.setLevel(log_level_now)
    transformers.utils.logging.set_verbosity(log_level_now)
    Trainer(model=model, args=training_args, train_dataset=datasets[0], data_collator=collator)
    assert log_level_now == expected
    assert logging.getLogger("kubetrain_trainer").getEffectiveLevel() == expected


def test_neftune_noise_while_training_only(collator, datasets, tmp_path):
    # neftune_noise_alpha adds noise to the input embeddings during training (the same seed trains to
    # other weights); the hook is gone afterwards and evaluation sees clean embeddings.
    train, evals = datasets

    def run(alpha):
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=len(WORDS), n_positions=16, n_embd=16, n_layer=1, n_head=2)
        model = transformers.GPT2LMHeadModel(config)
        args = guide_args(tmp_path / str(alpha), neftune_noise_alpha=alpha, num_train_epochs=1, eval_strategy="no",
                          load_best_model_at_end=False, save_strategy="no")
        trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evals, data_collator=collator)
        trainer.train()
        return trainer

    clean, noisy = run(None), run(5.0)
    assert not noisy.model.get_input_embeddings()._forward_hooks  # NEFTune's hook removed after training
    assert not torch.equal(clean.model.transformer.h[0].mlp.c_fc.weight, noisy.model.transformer.h[0].mlp.c_fc.weight)
    assert noisy.evaluate()["eval_loss"] == noisy.evaluate()["eval_loss"]  # no noise at evaluation


def test_without_a_processing_class_the_collators_tokenizer_is_saved_as_hf_does(tokenizer, collator, datasets,
                                                                                    tmp_path):
    """A script that gives the tokenizer only to its collator (DataCollatorWithPadding(tok)): HF saves the collator's
    tokenizer; kubetrain saved none, and AutoTokenizer built a useless one from the config (all [UNK])."""
    train, _ = datasets
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(WORDS), n_positions=16, n_embd=16, n_layer=1, n_head=2)
    trainer = Trainer(model=transformers.GPT2LMHeadModel(config), train_dataset=train, data_collator=collator,
                      args=guide_args(tmp_path, load_best_model_at_end=False, eval_strategy="no", max_steps=2,
                                      save_steps=2))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    for folder in (tmp_path / "my_model" / "checkpoint-2", tmp_path / "final"):
        assert transformers.AutoTokenizer.from_pretrained(folder)("the cat sat")["input_ids"] == [3, 5, 8], folder
