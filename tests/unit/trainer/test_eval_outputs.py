"""What `evaluate`/`predict` collect from models whose outputs are not one `logits` of one shape, as the HF
Trainer does: several outputs (a QA model's start and end logits) and several label arguments as tuples,
predictions whose length differs from batch to batch padded with -100, and no `compute_metrics` call for a
set without the labels the model takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from kubetrain_trainer import Trainer, TrainingArguments
from kubetrain_trainer.evaluation import PAD_INDEX, _concat, _interleave


def _args(tmp_path, **kw) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path / "out"), report_to=["none"], disable_tqdm=True,
                             save_strategy="no", per_device_eval_batch_size=2, **kw)


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 3)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.embed(input_ids))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits.reshape(-1, 3), labels.reshape(-1), ignore_index=-100)
        return out


ROWS = [{"input_ids": [1 + (i + j) % 9 for j in range(3 + i)], "labels": [(i + j) % 3 for j in range(3 + i)]}
        for i in range(6)]


def _pad_per_batch(rows: list[dict]) -> dict:  # as DataCollatorForTokenClassification: to the batch's longest
    n = max(len(r["input_ids"]) for r in rows)
    batch = {"input_ids": torch.tensor([r["input_ids"] + [0] * (n - len(r["input_ids"])) for r in rows])}
    if "labels" in rows[0]:
        batch["labels"] = torch.tensor([r["labels"] + [-100] * (n - len(r["labels"])) for r in rows])
    return batch


def test_predictions_of_different_lengths_per_batch_are_padded_with_minus_100(tmp_path):
    seen = []

    def accuracy(p):
        seen.append(p)
        mask = p.label_ids != -100
        return {"accuracy": float((p.predictions.argmax(-1)[mask] == p.label_ids[mask]).mean())}

    model = Tagger()
    trainer = Trainer(model=model, args=_args(tmp_path), eval_dataset=ROWS, data_collator=_pad_per_batch,
                      compute_metrics=accuracy)
    metrics = trainer.evaluate()
    p = seen[0]
    assert p.predictions.shape == (6, 8, 3) and p.label_ids.shape == (6, 8)  # rows of 3..8 tokens, 2 per batch
    right = total = 0
    with torch.no_grad():
        for i, row in enumerate(ROWS):  # each row alone, unpadded: the same predictions where it has tokens
            logits = model.head(model.embed(torch.tensor([row["input_ids"]])))[0].numpy()
            n = len(row["input_ids"])
            np.testing.assert_allclose(p.predictions[i, :n], logits, rtol=1e-5, atol=1e-6)
            assert (p.label_ids[i, n:] == PAD_INDEX).all() and (p.label_ids[i, :n] == row["labels"]).all()
            right += int((logits.argmax(-1) == np.array(row["labels"])).sum())
            total += n
    assert metrics["eval_accuracy"] == right / total


class TinyForQuestionAnswering(nn.Module):
    """QA-shaped (HF finds the labels of a *QuestionAnswering class by name): two label arguments, two outputs
    of logits, none called `logits`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 2)

    def forward(self, input_ids, start_positions=None, end_positions=None):
        start, end = self.head(self.embed(input_ids)).unbind(-1)
        out = {"start_logits": start, "end_logits": end}
        if start_positions is not None:
            out["loss"] = (nn.functional.cross_entropy(start, start_positions)
                           + nn.functional.cross_entropy(end, end_positions)) / 2
        return out


QA = [{"input_ids": torch.tensor([(i + j) % 10 for j in range(5)]), "start_positions": torch.tensor(i % 5),
       "end_positions": torch.tensor((i + 1) % 5)} for i in range(6)]


def test_several_outputs_and_label_arguments_come_as_tuples(tmp_path):
    def exact(p):
        (start, end), (first, last) = p.predictions, p.label_ids
        return {"exact": float(((start.argmax(-1) == first) & (end.argmax(-1) == last)).mean())}

    trainer = Trainer(model=TinyForQuestionAnswering(), args=_args(tmp_path), eval_dataset=QA, compute_metrics=exact)
    assert "eval_exact" in trainer.evaluate()
    out = trainer.predict(QA)
    (start, end), (first, last) = out.predictions, out.label_ids
    assert start.shape == end.shape == (6, 5) and first.tolist() == [i % 5 for i in range(6)]
    assert last.tolist() == [(i + 1) % 5 for i in range(6)] and "test_exact" in out.metrics


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)

    def forward(self, x, labels=None):
        scores = self.lin(x)
        return {"scores": scores, **({"loss": nn.functional.cross_entropy(scores, labels)} if labels is not None
                                     else {})}


def test_the_outputs_but_the_loss_are_the_predictions_of_a_model_without_logits(tmp_path):
    rows = [{"x": torch.randn(4, generator=torch.Generator().manual_seed(i)), "labels": torch.tensor(i % 2)}
            for i in range(8)]
    calls = []
    trainer = Trainer(model=Scorer(), args=_args(tmp_path), eval_dataset=rows,
                      compute_metrics=lambda p: calls.append(p) or {"accuracy": float((p.predictions.argmax(-1)
                                                                                        == p.label_ids).mean())})
    assert "eval_accuracy" in trainer.evaluate() and calls[0].predictions.shape == (8, 2)


def test_predict_on_a_set_without_the_model_s_labels_computes_no_metrics(tmp_path):
    calls = []
    trainer = Trainer(model=Scorer(), args=_args(tmp_path),
                      compute_metrics=lambda p: calls.append(p) or {"n": len(p.label_ids)})
    out = trainer.predict([{"x": torch.randn(4)} for _ in range(4)])
    assert out.predictions.shape == (4, 2) and out.label_ids is None
    assert calls == [] and not any(k.startswith("test_n") for k in out.metrics)


def test_ranks_predictions_of_different_lengths_are_padded_and_interleaved():
    # Rank 0 held samples 0 and 2 (3 tokens), rank 1 samples 1 and 3 (5 tokens; sample 3 is the sampler's padding).
    rank0 = _concat([torch.ones(1, 3), torch.full((1, 2), 2.0)])
    assert rank0.tolist() == [[1, 1, 1], [2, 2, PAD_INDEX]]
    rank1 = torch.full((2, 5), 7.0)
    both = _interleave([(rank0, rank0[:, 0]), (rank1, rank1[:, 0])], total=3)
    assert both[0].tolist() == [[1, 1, 1, PAD_INDEX, PAD_INDEX], [7] * 5, [2, 2, PAD_INDEX, PAD_INDEX, PAD_INDEX]]
    assert both[1].tolist() == [1, 7, 2]


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)

    def forward(self, x, target=None):
        scores = self.lin(x)
        return {"logits": scores, **({"loss": nn.functional.cross_entropy(scores, target)} if target is not None
                                     else {})}


def _rows(n: int = 8) -> list[dict]:  # GLUE-style rows carry an `idx` the model does not take
    return [{"x": torch.randn(4, generator=torch.Generator().manual_seed(i)), "target": torch.tensor(i % 2),
             "idx": i} for i in range(n)]


def test_columns_the_model_does_not_take_are_dropped_as_hf_does(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="kubetrain_trainer")
    trainer = Trainer(model=Classifier(), args=_args(tmp_path, max_steps=2, per_device_train_batch_size=4,
                                                     label_names=["target"]),
                      train_dataset=_rows(), eval_dataset=_rows(), compute_metrics=lambda p: {"n": len(p.label_ids)})
    trainer.train()  # forward() got an unexpected keyword argument 'idx', before
    assert trainer.evaluate()["eval_n"] == 8  # label_names: `target` holds the labels
    assert any("idx" in r.getMessage() and "remove_unused_columns" in r.getMessage() for r in caplog.records)
    keep = Trainer(model=Classifier(), args=_args(tmp_path, max_steps=1, remove_unused_columns=False),
                   train_dataset=_rows())
    try:
        keep.train()
    except TypeError as e:  # kept, as asked: the model refuses it
        assert "idx" in str(e)
    else:
        raise AssertionError("remove_unused_columns: false passed idx on")


def test_a_transformers_model_s_unused_columns_are_dropped_too(tmp_path):
    """transformers 5 gives every model's forward `**kwargs` (its attention and cache options): the columns it
    does not name were all kept, so a tokenised GLUE set's `sentence` and `idx` reached the collator and the
    model. With HF's `DataCollatorWithPadding` training failed ("Unable to create tensor"), where HF drops
    them. A PEFT model is read through its base model, as HF reads it."""
    transformers = pytest.importorskip("transformers")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c"]) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(vocab))
    config = transformers.BertConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=8, num_labels=2)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    rows = [{**tokenizer(s), "sentence": s, "label": i % 2, "idx": i} for i, s in enumerate(["a b", "b", "a c b", "c"])]
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=2, per_device_train_batch_size=2),
                      train_dataset=rows, data_collator=transformers.DataCollatorWithPadding(tokenizer))
    batch = next(iter(trainer.get_train_dataloader()))
    assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels"}
    assert trainer.train().global_step == 2

    class PeftModel(nn.Module):  # peft's wrapper: forward(*args, **kwargs) around the model it adapts
        __module__ = "peft.peft_model"

        def __init__(self, base):
            super().__init__()
            self.base = base

        def get_base_model(self):
            return self.base

        def forward(self, *args, **kwargs):
            return self.base(*args, **kwargs)

    trainer = Trainer(model=PeftModel(model), args=_args(tmp_path, max_steps=1, per_device_train_batch_size=2),
                      train_dataset=rows, data_collator=transformers.DataCollatorWithPadding(tokenizer))
    assert set(next(iter(trainer.get_train_dataloader()))) == {"input_ids", "token_type_ids", "attention_mask",
                                                               "labels"}

class TwoTowers(nn.Module):
    """CLIP-shaped: no `logits`, two tensors of scores, a tower's own nested output and a cache-like object."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)
        self.config = type("Config", (), {"keys_to_ignore_at_inference": ["embeds"]})()

    def forward(self, x, labels=None):
        scores = self.lin(x)
        out = {"scores_a": scores, "scores_b": -scores, "embeds": x, "tower": {"hidden": x}, "cache": object()}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(scores, labels)
        return out


def test_nested_outputs_caches_and_the_config_s_ignored_keys_are_no_predictions(tmp_path):
    rows = [{"x": torch.randn(4, generator=torch.Generator().manual_seed(i)), "labels": torch.tensor(i % 2)}
            for i in range(6)]
    out = Trainer(model=TwoTowers(), args=_args(tmp_path)).predict(rows)
    a, b = out.predictions  # the two tensors; `embeds` ignored as the config says, the rest no tensor
    assert a.shape == b.shape == (6, 2) and np.allclose(a, -b)


def test_an_iterable_set_s_tuple_predictions_keep_every_row_when_ranks_are_interleaved():
    from kubetrain_trainer.evaluation import _rows

    per_rank = [(torch.zeros(8, 3), torch.zeros(8)), (torch.ones(8, 3), torch.ones(8))]  # 16 samples, no length
    both = _interleave(per_rank, sum(_rows(t) for t in per_rank))
    assert both[0].shape == (16, 3) and both[1].tolist() == [0, 1] * 8

