"""What a user compares between kubetrain's Trainer and the installed transformers Trainer on the same tiny run:
`trainer_state.json`'s fields and the train() metrics."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Trainer as HFTrainer
from transformers import TrainingArguments as HFTrainingArguments

from kubetrain_trainer import Trainer, TrainingArguments

from hf_tiny import tiny_gpt2 as _gpt2, token_rows as _rows


def _run(args_class, trainer_class, out, **kw):
    args = args_class(**{**dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                report_to="none", disable_tqdm=True, use_cpu=True, logging_steps=2, save_steps=2,
                                max_steps=2), **kw})
    trainer = trainer_class(model=_gpt2(), args=args, train_dataset=_rows())
    return trainer, trainer.train()


def test_trainer_state_train_batch_size_is_the_transformers_trainers(tmp_path):
    _run(HFTrainingArguments, HFTrainer, tmp_path / "hf")
    _run(TrainingArguments, Trainer, tmp_path / "kt")
    saved = {name: json.loads((tmp_path / name / "checkpoint-2" / "trainer_state.json").read_text())
             for name in ("hf", "kt")}
    assert saved["kt"]["train_batch_size"] == saved["hf"]["train_batch_size"] == 2  # one process's micro-batch
    assert set(saved["kt"]) == set(saved["hf"])  # every field HF writes (num_input_tokens_seen, trial_name, ...)
    for name in ("num_input_tokens_seen", "is_hyper_param_search", "trial_name", "trial_params"):
        assert saved["kt"][name] == saved["hf"][name]


def test_train_samples_per_second_counts_the_global_batch(tmp_path):
    _, out = _run(TrainingArguments, Trainer, tmp_path / "kt")
    metrics = out.metrics
    # 2 samples x 2 accumulation x 1 process per step (HF: num_train_samples = max_steps x the total batch)
    assert metrics["train_samples_per_second"] / metrics["train_steps_per_second"] == pytest.approx(4, rel=1e-2)


def test_the_progress_report_counts_the_global_batch(make_args):
    from kubetrain_trainer.callbacks import TrainerControl
    from kubetrain_trainer.progress import TrainProgressCallback
    from kubetrain_trainer.state import TrainerState

    class Recorder:
        def step_end(self, **kw):
            self.samples_per_step = kw["samples_per_step"]

    recorder = Recorder()
    state = TrainerState(global_step=1, max_steps=4, train_batch_size=2, world_size=3)
    TrainProgressCallback(recorder).on_step_end(make_args(gradient_accumulation_steps=5), state, TrainerControl())
    assert recorder.samples_per_step == 2 * 5 * 3


def _event_dirs(root):
    return sorted({p.parent for p in root.rglob("events.out.tfevents*")})


def test_tensorboard_writes_where_the_transformers_trainer_does(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    for name, (args_class, trainer_class) in {"hf": (HFTrainingArguments, HFTrainer),
                                              "kt": (TrainingArguments, Trainer)}.items():
        _run(args_class, trainer_class, tmp_path / name, report_to=["tensorboard"], save_strategy="no")
    hf, kt = _event_dirs(tmp_path / "hf"), _event_dirs(tmp_path / "kt")
    # One folder per run, <output_dir>/runs/<Mon DD_HH-MM-SS>_<hostname> (HF's default_logdir)
    assert [p.relative_to(tmp_path / "hf").parent for p in hf] == [p.relative_to(tmp_path / "kt").parent for p in kt]
    assert [p.name.rsplit("_", 1)[1] for p in kt] == [p.name.rsplit("_", 1)[1] for p in hf]
    assert len(kt) == 1 and kt[0].parent == tmp_path / "kt" / "runs"


def test_tensorboard_logging_dir_is_honoured_as_by_the_transformers_trainer(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    trainer, _ = _run(TrainingArguments, Trainer, tmp_path / "kt", report_to=["tensorboard"], save_strategy="no")
    trainer.evaluate(_rows(4))  # after training: the same folder
    assert _event_dirs(tmp_path) == [tmp_path / "tb"]


def _ragged_eval_rows():
    g = torch.Generator().manual_seed(2)
    return [{"input_ids": torch.randint(0, 50, (3 + i % 3,), generator=g),
             "labels": torch.randint(0, 50, (3 + i % 3,), generator=g)} for i in range(5)]


def _pad_collate(rows):
    width = max(len(r["input_ids"]) for r in rows)
    return {key: torch.stack([torch.nn.functional.pad(r[key], (0, width - len(r[key])), value=fill) for r in rows])
            for key, fill in (("input_ids", 0), ("labels", -100))}


def test_include_for_metrics_gives_compute_metrics_the_inputs_and_losses_as_the_transformers_trainer(tmp_path):
    """Before, `include_for_metrics` was refused as an unknown argument, and `EvalPrediction` had no `inputs` or
    `losses`: an HF script computing a metric from the inputs (e.g. a source-aware score) could not run."""
    got = {}

    def compute_metrics(eval_pred):
        got[len(got)] = eval_pred
        return {}

    for args_class, trainer_class in ((HFTrainingArguments, HFTrainer), (TrainingArguments, Trainer)):
        args = args_class(output_dir=str(tmp_path / "out"), per_device_eval_batch_size=2, report_to="none",
                          use_cpu=True, include_for_metrics=["inputs", "loss"])
        trainer = trainer_class(model=_gpt2(), args=args, eval_dataset=_ragged_eval_rows(),
                                compute_metrics=compute_metrics, data_collator=_pad_collate)
        metrics = trainer.evaluate()
    hf, kt = got[0], got[1]
    assert kt.inputs.tolist() == hf.inputs.tolist()  # the rows' input_ids, batches padded to one width with -100
    assert -100 in kt.inputs.tolist()[0]
    assert kt.losses.shape == hf.losses.shape == (5,)  # each sample's batch loss
    assert kt.losses[0] == kt.losses[1] and kt.losses[2] == kt.losses[3] != kt.losses[4]
    assert kt.losses.mean() == pytest.approx(metrics["eval_loss"], rel=1e-5)
    assert len(tuple(kt)) == len(tuple(hf)) == 4 and kt[2] is kt.inputs and kt[3] is kt.losses
    predictions, labels = got[1].__class__(kt.predictions, kt.label_ids)  # without them: the pair, as before
    assert predictions is kt.predictions and labels is kt.label_ids


def test_include_for_metrics_parses_as_hf_parses_it_and_refuses_an_unknown_value():
    from transformers import HfArgumentParser

    from kubetrain_trainer import ConfigError

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "x", "--include_for_metrics", "inputs", "loss"])
    assert args.include_for_metrics == ["inputs", "loss"]
    assert TrainingArguments.from_cli(["--include_for_metrics", "loss"]).include_for_metrics == ["loss"]
    with pytest.raises(ConfigError, match="include_for_metrics: 'input' is not one of inputs, loss"):
        TrainingArguments(include_for_metrics=["input"])


def test_log_metrics_prints_what_the_transformers_trainer_prints(tmp_path, capsys):
    """Before, the runtime showed as seconds, total_flos as a raw float and the values left-aligned: the summary
    every HF example script prints at its end read differently."""
    metrics = {"epoch": 3.0, "total_flos": 123456789012.0, "train_loss": 6.0857123, "train_runtime": 3725.123,
               "train_samples_per_second": 12.345678, "train_samples": 100, "eval_peak_mem_gpu": 3 << 20}
    printed = []
    for args_class, trainer_class in ((HFTrainingArguments, HFTrainer), (TrainingArguments, Trainer)):
        trainer = trainer_class(model=_gpt2(), args=args_class(output_dir=str(tmp_path), report_to="none",
                                                              use_cpu=True))
        capsys.readouterr()
        trainer.log_metrics("train", dict(metrics))
        printed.append(capsys.readouterr().out)
    assert printed[1] == printed[0]
    assert "train_runtime            = 1:02:05.12" in printed[1] and "=      114GF" in printed[1]


def test_evaluate_and_predict_on_an_iterable_set_report_samples_per_second_as_the_transformers_trainer():
    """Before, an eval or test set without a length (an IterableDataset) had no `*_samples_per_second`."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(_rows(10))

    trainer = Trainer(model=_gpt2(), args=TrainingArguments(output_dir="unused", report_to="none",
                                                            per_device_eval_batch_size=4, use_cpu=True))
    for metrics, prefix in ((trainer.evaluate(Stream()), "eval"), (trainer.predict(Stream()).metrics, "test")):
        per_step = metrics[f"{prefix}_samples_per_second"] / metrics[f"{prefix}_steps_per_second"]
        assert per_step == pytest.approx(10 / 3, rel=1e-2)  # 10 rows in 3 batches


def test_the_optimizer_and_prediction_step_events_fire_as_in_the_transformers_trainer(tmp_path):
    """Before, a callback's on_pre_optimizer_step, on_optimizer_step and on_prediction_step never ran: an HF
    callback watching the gradients around the update (or an eval progress bar) silently did nothing."""
    from transformers import TrainerCallback as HFTrainerCallback

    class Watch(HFTrainerCallback):
        def __init__(self):
            self.events = []

        def _grads(self, model):
            return all(p.grad is not None for p in model.parameters() if p.requires_grad)

        def on_step_begin(self, args, state, control, **kw):
            self.events.append(("step_begin", state.global_step))

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            self.events.append(("pre_optimizer", state.global_step, self._grads(model)))

        def on_optimizer_step(self, args, state, control, model=None, **kw):
            self.events.append(("optimizer", state.global_step, self._grads(model)))

        def on_step_end(self, args, state, control, **kw):
            self.events.append(("step_end", state.global_step))

        def on_prediction_step(self, args, state, control, **kw):
            self.events.append(("prediction", state.global_step))

    seen = []
    for args_class, trainer_class in ((HFTrainingArguments, HFTrainer), (TrainingArguments, Trainer)):
        watch = Watch()
        args = args_class(output_dir=str(tmp_path / trainer_class.__module__), per_device_train_batch_size=4,
                          gradient_accumulation_steps=2, per_device_eval_batch_size=2, max_steps=2,
                          eval_strategy="steps", eval_steps=2, save_strategy="no", report_to="none",
                          disable_tqdm=True, use_cpu=True)
        trainer = trainer_class(model=_gpt2(), args=args, train_dataset=_rows(16), eval_dataset=_rows(3),
                                callbacks=[watch])
        trainer.train()
        seen.append(watch.events)
    assert seen[1] == seen[0]
    assert seen[1][:4] == [("step_begin", 0), ("pre_optimizer", 0, True), ("optimizer", 0, True), ("step_end", 1)]
    assert seen[1].count(("prediction", 2)) == 2  # 3 eval rows in batches of 2


def test_callbacks_get_the_eval_dataloader_as_from_the_transformers_trainer(tmp_path):
    """Before, on_prediction_step (and on_evaluate) had no `eval_dataloader` kwarg: HF's own ProgressCallback
    (and any HF callback sizing an eval progress bar by it) silently showed nothing, and one reading
    kwargs["eval_dataloader"] raised KeyError in the middle of an evaluation."""
    from transformers import TrainerCallback as HFTrainerCallback

    class Sizes(HFTrainerCallback):
        def __init__(self):
            self.sizes = []

        def on_prediction_step(self, args, state, control, **kw):
            self.sizes.append(("prediction", len(kw["eval_dataloader"])))

        def on_evaluate(self, args, state, control, **kw):
            self.sizes.append(("evaluate", len(kw["eval_dataloader"])))

    seen = []
    for args_class, trainer_class in ((HFTrainingArguments, HFTrainer), (TrainingArguments, Trainer)):
        sizes = Sizes()
        args = args_class(output_dir=str(tmp_path / trainer_class.__module__), per_device_eval_batch_size=2,
                          report_to="none", disable_tqdm=True, use_cpu=True)
        trainer_class(model=_gpt2(), args=args, eval_dataset=_rows(3), callbacks=[sizes]).evaluate()
        seen.append(sizes.sizes)
    assert seen[1] == seen[0] == [("prediction", 2), ("prediction", 2), ("evaluate", 2)]
