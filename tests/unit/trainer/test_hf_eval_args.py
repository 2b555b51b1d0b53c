"""HF 5's evaluation arguments `eval_on_start` and `batch_eval_metrics`, run next to the installed transformers
Trainer on the same tiny GPT-2: what each logs and what `compute_metrics` is given."""

from __future__ import annotations

import pytest
from transformers import Trainer as HFTrainer
from transformers import TrainingArguments as HFTrainingArguments

from kubetrain_trainer import ConfigError, Trainer, TrainingArguments

from hf_tiny import tiny_gpt2 as _gpt2, token_rows as _rows
KINDS = {"hf": (HFTrainingArguments, HFTrainer), "kt": (TrainingArguments, Trainer)}


def _trainer(kind, out, *, compute_metrics=None, **kw):
    args_class, trainer_class = KINDS[kind]
    args = args_class(**{**dict(output_dir=str(out), per_device_train_batch_size=2, per_device_eval_batch_size=4,
                                report_to="none", disable_tqdm=True, use_cpu=True, logging_steps=2, save_steps=2,
                                max_steps=2), **kw})
    return trainer_class(model=_gpt2(), args=args, train_dataset=_rows(), eval_dataset=_rows(6, seed=2),
                         compute_metrics=compute_metrics)


def _evals(trainer):
    return [(e["step"], round(e["eval_loss"], 5)) for e in trainer.state.log_history if "eval_loss" in e]


def test_eval_on_start_evaluates_before_the_first_step_as_hf(tmp_path):
    got = {}
    for kind in KINDS:
        trainer = _trainer(kind, tmp_path / kind, eval_on_start=True)
        trainer.train()
        got[kind] = _evals(trainer)
    assert [step for step, _ in got["kt"]] == [step for step, _ in got["hf"]] == [0]
    # The untrained model's loss (HF's differs for a causal LM: it divides by a token per row too many).
    assert got["kt"][0][1] == round(_trainer("kt", tmp_path / "fresh").evaluate()["eval_loss"], 5)


def test_eval_on_start_evaluates_again_on_a_resume_as_hf(tmp_path):
    got = {}
    for kind in KINDS:
        _trainer(kind, tmp_path / kind, max_steps=4, save_steps=2).train()  # checkpoint-2 and checkpoint-4
        trainer = _trainer(kind, tmp_path / kind, max_steps=4, save_steps=2, eval_on_start=True)
        trainer.train(resume_from_checkpoint=str(tmp_path / kind / "checkpoint-2"))
        got[kind] = [step for step, _ in _evals(trainer)]
    assert got["kt"] == got["hf"] == [2]  # at the resumed step: no best metric, no checkpoint of its own


def test_eval_on_start_without_an_eval_dataset_is_refused_when_the_trainer_is_built(make_args, tiny_gpt, tokens):
    with pytest.raises(ConfigError, match="eval_on_start needs an eval_dataset"):
        Trainer(model=tiny_gpt(), args=make_args(eval_on_start=True), train_dataset=tokens())


class _Accuracy:
    """A `batch_eval_metrics` compute_metrics: token accuracy summed over batches, returned on the last one."""

    def __init__(self):
        self.calls, self.right, self.total = [], 0, 0

    def __call__(self, eval_pred, compute_result):
        preds, labels = eval_pred.predictions, eval_pred.label_ids
        self.calls.append((type(preds).__name__, tuple(preds.shape), tuple(labels.shape), compute_result,
                           None if eval_pred.losses is None else tuple(eval_pred.losses.shape)))
        self.right += (preds.argmax(-1)[:, :-1] == labels[:, 1:]).sum().item()
        self.total += labels[:, 1:].numel()
        if compute_result:
            return {"accuracy": self.right / self.total}


@pytest.mark.parametrize("include", [[], ["loss"]])
def test_batch_eval_metrics_calls_compute_metrics_per_batch_as_hf(tmp_path, include):
    got = {}
    for kind in KINDS:
        metric = _Accuracy()
        trainer = _trainer(kind, tmp_path / kind, compute_metrics=metric, batch_eval_metrics=True,
                           include_for_metrics=include)
        got[kind] = (metric.calls, trainer.evaluate()["eval_accuracy"])
    assert got["kt"] == got["hf"]
    assert [call[3] for call in got["kt"][0]] == [False, True]  # 6 rows in batches of 4: compute_result last


def test_batch_eval_metrics_predict_calls_it_per_batch_and_returns_every_prediction(tmp_path):
    got = {}
    for kind in KINDS:
        metric = _Accuracy()
        trainer = _trainer(kind, tmp_path / kind, compute_metrics=metric, batch_eval_metrics=True)
        out = trainer.predict(_rows(6, seed=2))
        got[kind] = (metric.calls, out.predictions.shape, out.metrics["test_accuracy"])
    assert got["kt"] == got["hf"]


def test_batch_eval_metrics_evaluate_keeps_no_predictions(tmp_path):
    trainer = _trainer("kt", tmp_path, compute_metrics=_Accuracy(), batch_eval_metrics=True)
    preds, labels, metrics = trainer.evaluation_loop(trainer.get_eval_dataloader(), prefix="eval")
    assert preds is None and labels is None and "eval_accuracy" in metrics


def test_batch_eval_metrics_needs_a_compute_metrics_taking_compute_result(tmp_path):
    for kind in KINDS:
        with pytest.raises(ValueError, match="compute_result"):
            _trainer(kind, tmp_path / kind, compute_metrics=lambda eval_pred: {}, batch_eval_metrics=True)


def test_batch_eval_metrics_on_two_ranks_sees_each_sample_once_in_order(tmp_path, master_port):
    """Two gloo processes, 5 rows (one padding row on rank 1), batches of 2 per rank: each call gets the batch of
    both ranks in the set's order, without the padding row, and both ranks get the same metrics."""
    import json
    import subprocess
    import sys

    script = tmp_path / "batches.py"
    script.write_text(
        "import json, os, torch\n"
        "from kubetrain_trainer import Trainer, TrainingArguments\n"
        "class Echo(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.w = torch.nn.Parameter(torch.zeros(()))\n"
        "    def forward(self, x, labels=None):\n"
        "        return {'loss': self.w * 0 + x.float().mean(), 'logits': x.float()}\n"
        "seen = []\n"
        "def metrics(p, compute_result):\n"
        "    seen.append([p.label_ids.tolist(), compute_result])\n"
        "    return {'n': sum(len(s[0]) for s in seen)} if compute_result else None\n"
        "rows = [{'x': torch.tensor([i]), 'labels': torch.tensor(i)} for i in range(5)]\n"
        f"args = TrainingArguments(output_dir={str(tmp_path / 'out')!r}, use_cpu=True, per_device_eval_batch_size=2,"
        " report_to='none', disable_tqdm=True, batch_eval_metrics=True, save_strategy='no')\n"
        "trainer = Trainer(model=Echo(), args=args, train_dataset=rows, eval_dataset=rows, compute_metrics=metrics)\n"
        "out = trainer.evaluate()\n"
        f"open({str(tmp_path)!r} + '/rank' + os.environ['RANK'] + '.json', 'w').write(json.dumps([seen, out['eval_n']]))\n")
    env = {**__import__("os").environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port, "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in (0, 1)]
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    for rank in (0, 1):
        seen, n = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == [[[0, 1, 2, 3], False], [[4], True]] and n == 5


def test_the_output_dir_exists_once_the_trainer_is_built_as_hf(tmp_path):
    """A script that writes into output_dir right after building the Trainer (a tokenizer's files, notes) found no
    folder with kubetrain and a FileNotFoundError; HF makes it on the process that saves."""
    for kind in KINDS:
        out = tmp_path / kind / "nested"
        _trainer(kind, out, save_strategy="no")
        assert out.is_dir()


def test_batch_eval_metrics_a_last_batch_without_labels_keeps_the_last_calls_metrics(tmp_path):
    """As HF: a batch without labels gets no call, and does not wipe the metrics the last call returned."""
    rows = _rows(6, seed=2)
    for row in rows[4:]:
        del row["labels"]
    metric = _Accuracy()
    trainer = _trainer("kt", tmp_path, compute_metrics=lambda p, compute_result: metric(p, True),
                       batch_eval_metrics=True)
    assert "eval_accuracy" in trainer.evaluate(rows)
    assert len(metric.calls) == 1
