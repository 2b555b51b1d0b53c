"""What HF's example scripts call besides train(): the process properties of TrainingArguments, main_process_first,
log_metrics / save_metrics and preprocess_logits_for_metrics (an HF user's port found them missing)."""

from __future__ import annotations

import json

import torch

from kubetrain_trainer import Trainer, TrainingArguments


def test_the_process_properties_hf_scripts_read(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, use_cpu=True)
    assert (args.world_size, args.process_index, args.local_process_index) == (1, 0, 0)
    assert args.should_save and args.should_log and args.n_gpu == 0 and args.device == torch.device("cpu")
    assert args.train_batch_size == 4 and args.eval_batch_size == 8
    ran = []
    with args.main_process_first(desc="tokenize"):
        ran.append(1)
    assert ran == [1]
    assert "world_size" not in json.loads(args.to_json_string())  # properties, not saved arguments


def test_log_metrics_and_save_metrics_as_hf(tiny_gpt, tokens, make_args, tmp_path, capsys):
    trainer = Trainer(model=tiny_gpt(0), args=make_args(max_steps=2), train_dataset=tokens())
    metrics = trainer.train().metrics
    trainer.log_metrics("train", metrics)
    out = capsys.readouterr().out
    assert "***** train metrics *****" in out and "train_loss" in out
    trainer.save_metrics("train", metrics)
    trainer.save_metrics("eval", {"eval_loss": 1.5})
    folder = tmp_path / "out"
    assert json.loads((folder / "train_results.json").read_text())["train_loss"] == metrics["train_loss"]
    assert json.loads((folder / "all_results.json").read_text()) == {**metrics, "eval_loss": 1.5}


def test_preprocess_logits_for_metrics_shapes_what_compute_metrics_gets(tiny_gpt, tokens, make_args):
    """HF's causal LM examples keep only the argmax of the logits (memory): the Trainer refused the argument."""
    seen = {}

    def argmax(logits, labels):
        seen["labels"] = labels is not None
        return logits.argmax(dim=-1)

    def compute_metrics(pred):
        seen["shape"] = tuple(pred.predictions.shape)
        return {"n": float(pred.predictions.size)}

    trainer = Trainer(model=tiny_gpt(0), args=make_args(max_steps=1, eval_strategy="no"), train_dataset=tokens(),
                      compute_metrics=compute_metrics, preprocess_logits_for_metrics=argmax)
    metrics = trainer.evaluate(tokens(8, seed=1))
    assert seen["labels"] and seen["shape"] == (8, 8) and metrics["eval_n"] == 64


def test_evaluate_returns_the_epoch_and_the_step_rate_as_hf(tiny_gpt, tokens, make_args):
    """HF's evaluate() metrics (and on_evaluate's) carry `epoch` and `eval_steps_per_second`: an HF callback reading
    metrics["epoch"] raised KeyError."""
    from kubetrain_trainer import TrainerCallback

    seen = {}

    class Watch(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            seen.update(metrics)

    trainer = Trainer(model=tiny_gpt(0), args=make_args(max_steps=2, eval_strategy="no"), train_dataset=tokens(),
                      callbacks=[Watch()])
    trainer.train()
    metrics = trainer.evaluate(tokens(8, seed=1))
    assert metrics["epoch"] == trainer.state.epoch and metrics["eval_steps_per_second"] > 0
    assert seen["epoch"] == trainer.state.epoch


def test_main_process_first_joins_the_process_group_before_the_trainer_exists(tmp_path, master_port):
    """HF scripts call it before Trainer(...): without a process group it did nothing, and every rank ran the
    block (a dataset's map) at once. Two gloo processes: rank 1 enters only after rank 0 left."""
    import subprocess
    import sys

    script = tmp_path / "first.py"
    script.write_text(
        "import os, time\n"
        "from kubetrain_trainer import TrainingArguments\n"
        "args = TrainingArguments(output_dir='o', use_cpu=True, ddp_timeout=60)\n"
        "with args.main_process_first(desc='map'):\n"
        "    if args.process_index == 0:\n"
        "        time.sleep(1.0)\n"
        f"    open({str(tmp_path)!r} + '/order', 'a').write(str(args.process_index) + '\\n')\n")
    env = {**__import__("os").environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port, "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in (1, 0)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert (tmp_path / "order").read_text().split() == ["0", "1"]
