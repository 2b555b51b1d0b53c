"""How a step's loss is normalised over accumulated micro-batches: a transformers causal LM's by the step's label
tokens (HF 5.x's `num_items_in_batch`), every other model's as the mean of its micro-batch means, which for
equal micro-batches is the mean of the whole batch. The update of one batch of 4 equals that of 4 micro-batches
of 1 in every case (HF 5.17 scales a classifier's by the accumulation steps)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kubetrain_trainer import Trainer, TrainingArguments


def _args(tmp_path, **kw) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path / "out"), report_to=["none"], disable_tqdm=True,
                             save_strategy="no", max_steps=1, optim="sgd", learning_rate=1.0, max_grad_norm=0.0,
                             lr_scheduler_type="constant", logging_steps=1, **kw)
def test_accumulated_micro_batches_of_a_transformers_lm_weigh_each_label_token_alike(tmp_path):
    """As HF 5.x: a model that takes `num_items_in_batch` normalises its loss by the label tokens of the whole
    step, so two micro-batches of 1 and 24 tokens train as the 25 tokens would together (a mean of the two
    micro-batch means, before, gave the single token the weight of 24)."""
    transformers = pytest.importorskip("transformers")
    rows = [[3, 4], list(range(5, 30))]  # 1 and 24 label tokens after the causal shift

    def model():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))

    reference = model()  # by hand: every token of the step in one sum, over the step's token count
    total = sum(reference(input_ids=torch.tensor([r]), labels=torch.tensor([r]), num_items_in_batch=25).loss
                for r in rows)
    total.backward()
    expected = reference.lm_head.weight.detach() - reference.lm_head.weight.grad

    trained = model()
    collate = lambda feats: {"input_ids": torch.tensor(feats), "labels": torch.tensor(feats)}  # noqa: E731
    trainer = Trainer(model=trained, args=_args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=2),
                      train_dataset=rows, data_collator=collate)
    trainer.train()
    assert torch.allclose(trained.lm_head.weight.detach(), expected, atol=1e-6)
    assert trainer.state.log_history[0]["loss"] == pytest.approx(total.item(), rel=1e-6)



class KwargsRegressor(nn.Module):
    """A plain module whose forward takes **kwargs (as transformers models do) and returns its own mean."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)

    def forward(self, x, labels=None, **kwargs):
        out = self.lin(x).squeeze(-1)
        return {"logits": out, "loss": nn.functional.mse_loss(out, labels)}


def _bert_classifier():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


class OwnLoss(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False):  # the HF guide's signature: no count
        outputs = model(**inputs)
        return (outputs["loss"], outputs) if return_outputs else outputs["loss"]


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                                                n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                                                attn_pdrop=0.0))


CASES = {
    "a module taking **kwargs": (KwargsRegressor, Trainer,
                                 [{"x": torch.randn(4, generator=torch.Generator().manual_seed(i)),
                                   "labels": torch.tensor(float(i))} for i in range(4)]),
    "a transformers classifier": (_bert_classifier, Trainer,
                                  [{"input_ids": torch.tensor([1 + i, 2, 3 + i]), "labels": torch.tensor(i % 3)}
                                   for i in range(4)]),
    "a compute_loss override without the count": (_gpt2, OwnLoss,
                                                  [{"input_ids": torch.arange(i, i + 6), "labels": torch.arange(i, i + 6)}
                                                   for i in range(4)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_model_that_averages_its_own_loss_trains_one_batch_and_its_micro_batches_alike(tmp_path, case):
    build, trainer_class, rows = CASES[case]
    updates, losses = [], []
    for batch, steps in ((4, 1), (1, 4)):
        model = build()
        before = [p.detach().clone() for p in model.parameters()]
        trainer = trainer_class(model=model, args=_args(tmp_path / f"{batch}", per_device_train_batch_size=batch,
                                                        gradient_accumulation_steps=steps), train_dataset=rows)
        trainer.train()
        updates.append(torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]))
        losses.append(trainer.state.log_history[0]["loss"])
    assert torch.allclose(updates[0], updates[1], atol=1e-6) and updates[0].abs().sum() > 0
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_model_accepts_loss_kwargs_false_keeps_the_mean_of_micro_batch_means(tmp_path):
    """HF's documented way out: the flag set on the Trainer decides, whatever the model."""
    rows = [[3, 4], list(range(5, 30))]
    collate = lambda feats: {"input_ids": torch.tensor(feats), "labels": torch.tensor(feats)}  # noqa: E731
    trainer = Trainer(model=_gpt2(), args=_args(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=2),
                      train_dataset=rows, data_collator=collate)
    trainer.model_accepts_loss_kwargs = False
    trainer.train()
    means = [_gpt2()(input_ids=torch.tensor([r]), labels=torch.tensor([r])).loss.item() for r in rows]
    assert trainer.state.log_history[0]["loss"] == pytest.approx(sum(means) / 2, rel=1e-5)
