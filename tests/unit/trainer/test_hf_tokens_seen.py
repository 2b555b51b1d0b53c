"""HF 5's `include_num_input_tokens_seen`, run next to the installed transformers Trainer on the same tiny GPT-2:
the count in the state and in every log, the step logs' token speed, a resume that continues the count, and
the sum over ranks (two gloo processes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import Trainer as HFTrainer
from transformers import TrainingArguments as HFTrainingArguments

from kubetrain_trainer import Trainer, TrainingArguments

from hf_tiny import SEQ, tiny_gpt2 as _gpt2
KINDS = {"hf": (HFTrainingArguments, HFTrainer), "kt": (TrainingArguments, Trainer)}


def _rows(n=12, padded=False):
    g = torch.Generator().manual_seed(1)
    rows = []
    for i, ids in enumerate(torch.randint(0, 50, (n, SEQ), generator=g)):
        row = {"input_ids": ids, "labels": ids}
        if padded:  # row i keeps SEQ - i % 4 tokens
            row["attention_mask"] = (torch.arange(SEQ) < SEQ - i % 4).long()
        rows.append(row)
    return rows


def _trainer(kind, out, *, padded=False, **kw):
    args_class, trainer_class = KINDS[kind]
    args = args_class(**{**dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                report_to="none", disable_tqdm=True, use_cpu=True, logging_steps=1, save_steps=2,
                                max_steps=3, include_num_input_tokens_seen=True), **kw})
    return trainer_class(model=_gpt2(), args=args, train_dataset=_rows(padded=padded))


def _counts(trainer):
    return [(e["step"], e.get("num_input_tokens_seen")) for e in trainer.state.log_history]


@pytest.mark.parametrize("mode", [True, "all", "non_padding"])
def test_the_count_and_its_logs_are_the_transformers_trainers(tmp_path, mode):
    got = {}
    for kind in KINDS:
        trainer = _trainer(kind, tmp_path / kind, padded=True, include_num_input_tokens_seen=mode)
        trainer.train()
        got[kind] = trainer
    hf, kt = got["hf"], got["kt"]
    assert kt.args.include_num_input_tokens_seen == hf.args.include_num_input_tokens_seen
    assert _counts(kt) == _counts(hf)  # each step log and the final train metrics log carry it
    assert kt.state.num_input_tokens_seen == hf.state.num_input_tokens_seen
    every = 3 * 4 * SEQ  # 3 steps x 2 micro-batches x 2 rows x SEQ
    assert kt.state.num_input_tokens_seen == every if mode != "non_padding" else 0 < kt.state.num_input_tokens_seen < every
    step_logs = [e for e in kt.state.log_history if "loss" in e]
    hf_step_logs = [e for e in hf.state.log_history if "loss" in e]
    assert set(step_logs[0]) == set(hf_step_logs[0])  # train_runtime and train_tokens_per_second, as HF
    assert all(e["train_tokens_per_second"] > 0 for e in step_logs)
    saved = json.loads((tmp_path / "kt" / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved["num_input_tokens_seen"] == dict(_counts(kt))[2]


def test_a_resume_continues_the_count_as_hf(tmp_path):
    got = {}
    for kind in KINDS:
        straight = _trainer(kind, tmp_path / kind / "straight", max_steps=4)
        straight.train()
        _trainer(kind, tmp_path / kind / "stopped", max_steps=2).train()
        resumed = _trainer(kind, tmp_path / kind / "stopped", max_steps=4)
        resumed.train(resume_from_checkpoint=str(tmp_path / kind / "stopped" / "checkpoint-2"))
        got[kind] = (straight.state.num_input_tokens_seen, resumed.state.num_input_tokens_seen)
    assert got["kt"] == got["hf"] == (4 * 4 * SEQ, 4 * 4 * SEQ)


def test_off_nothing_is_counted_or_logged(tmp_path):
    trainer = _trainer("kt", tmp_path, include_num_input_tokens_seen=False)
    trainer.train()
    assert trainer.args.include_num_input_tokens_seen == "no" and trainer.state.num_input_tokens_seen == 0
    assert not any("num_input_tokens_seen" in e or "train_tokens_per_second" in e for e in trainer.state.log_history)


def test_a_command_line_flag_is_hfs_mapping_and_an_unknown_value_is_refused():
    from transformers import HfArgumentParser

    from kubetrain_trainer import ConfigError

    assert TrainingArguments.from_cli(["--include_num_input_tokens_seen", "true"]).include_num_input_tokens_seen \
        == "all"
    assert TrainingArguments.from_cli(["--include_num_input_tokens_seen", "non_padding"]) \
        .include_num_input_tokens_seen == "non_padding"
    # HF's parser takes the field as HF types it (a bool flag there: HF's own refuses "non_padding" too)
    (parsed,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "o", "--include_num_input_tokens_seen", "true"])
    assert parsed.include_num_input_tokens_seen == "all"
    with pytest.raises(ConfigError, match="'nonpadding' is not one of all, non_padding, no"):
        TrainingArguments(include_num_input_tokens_seen="nonpadding")


def test_every_rank_holds_the_count_of_all_ranks(tmp_path, master_port):
    """Two gloo processes, each training its half of the rows: both states count the tokens of both (HF gathers)."""
    script = tmp_path / "count.py"
    script.write_text(
        "import json, os, torch\n"
        "from kubetrain_trainer import Trainer, TrainingArguments\n"
        "from kubetrain_trainer.models import TinyGPT, TinyGPTConfig\n"
        "rank = int(os.environ['RANK'])\n"
        "rows = [{'input_ids': torch.arange(8) % 32, 'labels': torch.arange(8) % 32} for _ in range(16)]\n"
        f"args = TrainingArguments(output_dir={str(tmp_path / 'out')!r}, use_cpu=True, max_steps=3, "
        "per_device_train_batch_size=2, gradient_accumulation_steps=2, save_strategy='no', report_to='none', "
        "disable_tqdm=True, logging_steps=1, include_num_input_tokens_seen='all')\n"
        "model = TinyGPT(TinyGPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2))\n"
        "trainer = Trainer(model=model, args=args, train_dataset=rows)\n"
        "trainer.train()\n"
        f"open({str(tmp_path)!r} + f'/rank{{rank}}.json', 'w').write(json.dumps(\n"
        "    [trainer.state.num_input_tokens_seen, [e.get('num_input_tokens_seen') for e in trainer.state.log_history]]))\n")
    env = {**__import__("os").environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port, "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in (0, 1)]
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    per_step = 2 * 2 * 8 * 2  # 2 micro-batches of 2 rows of 8 tokens, on each of 2 ranks
    for rank in (0, 1):
        total, logged = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert total == 3 * per_step
        assert logged == [per_step, 2 * per_step, 3 * per_step, 3 * per_step]
