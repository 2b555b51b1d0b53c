"""A 2-rank script that never destroys its process group (as HF scripts do not) has it destroyed at exit while the
interpreter is whole: gloo's worker threads otherwise could abort the process in finalization (SIGABRT,
"terminate called without an active exception"), which the launcher counts as a failed run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

EVAL_ONLY = textwrap.dedent("""
    import atexit
    import torch
    import torch.distributed as dist
    from kubetrain_trainer import Trainer, TrainingArguments

    # Registered first, so it runs last: what a finalizing interpreter would find.
    atexit.register(lambda: print("group left at exit:", dist.is_initialized(), flush=True))

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 16
        def __getitem__(self, i):
            x = torch.full((4,), float(i))
            return {"x": x, "labels": x.sum(0, keepdim=True)}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)
        def forward(self, x, labels=None):
            y = self.lin(x)
            return {"loss": torch.nn.functional.mse_loss(y, labels), "logits": y}

    args = TrainingArguments(output_dir=%r, report_to=["none"], disable_tqdm=True, use_cpu=True)
    metrics = Trainer(model=Model(), args=args, eval_dataset=Rows()).evaluate()
    print("evaluated", dist.is_initialized(), flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_eval_only_two_rank_script_leaves_no_process_group_to_finalization(tmp_path):
    script = tmp_path / "eval_only.py"
    script.write_text(EVAL_ONLY % str(tmp_path / "out"))
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "LOCAL_RANK": str(r),
                                   "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": port})
             for r in range(2)]
    outputs = [p.communicate(timeout=240) for p in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err
        assert "evaluated True" in out, out  # the Trainer joined the group itself
        assert "group left at exit: False" in out, out


TRAIN = textwrap.dedent("""
    import torch
    from kubetrain_trainer import Trainer, TrainingArguments
    from kubetrain_trainer.models import TinyGPT, TinyGPTConfig

    rows = [{"input_ids": torch.arange(8) % 32, "labels": torch.arange(8) % 32} for _ in range(16)]
    args = TrainingArguments(output_dir=OUT, use_cpu=True, max_steps=2, per_device_train_batch_size=2,
                             save_strategy="no", report_to="none", disable_tqdm=True)
    model = TinyGPT(TinyGPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2))
    Trainer(model=model, args=args, train_dataset=rows).train()
""")


def test_two_rank_training_scripts_exit_0_run_after_run(tmp_path):
    """torch 2.13's gloo aborted about one finished 2-rank run in three as it exited (8 of 30 here), with or without
    destroy_process_group: the pause after it (`distributed.settle_gloo_at_exit`) made it 0 of 30. Twelve runs:
    without the pause, all twelve pass about once in fifty."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN.replace("OUT", repr(str(tmp_path / "out"))))
    aborted = []
    for run in range(12):
        port = str(_free_port())
        procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r),
                                                  "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
                 for r in range(2)]
        for proc in procs:
            err = proc.communicate(timeout=120)[1]
            if proc.returncode != 0:
                aborted.append((run, proc.returncode, err[-300:]))
    assert aborted == []
