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
