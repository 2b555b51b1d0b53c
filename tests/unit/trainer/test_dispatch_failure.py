"""An iterable training set on several ranks is read by rank 0, which deals the batches (`DispatchedLoader`):
what the other ranks see when rank 0 cannot read it, or cannot send what it read (two gloo processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

SCRIPT = """
import sys, threading, torch
from torch import nn
from torch.utils.data import IterableDataset
from kubetrain_trainer import Trainer, TrainingArguments

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, x, **_):
        return {"loss": (self.w * x).mean()}

class Broken(IterableDataset):
    def __iter__(self):
        for i in range(100):
            if i == 5 and sys.argv[2] == "read":
                raise OSError("the shard server went away")
            yield {"x": torch.tensor(float(i)), **({"f": threading.Lock()} if i == 5 else {})}

def collate(rows):  # keeps what a row holds besides x (a lock rank 0 cannot send)
    return {"x": torch.stack([r["x"] for r in rows]), "f": [r.get("f") for r in rows]}

args = TrainingArguments(output_dir=sys.argv[1], use_cpu=True, report_to="none", disable_tqdm=True,
                         save_strategy="no", per_device_train_batch_size=2, max_steps=10, ddp_timeout=60,
                         remove_unused_columns=False)
Trainer(model=Model(), args=args, train_dataset=Broken(), data_collator=collate).train()
"""


@pytest.mark.parametrize("failure, error", [("read", "OSError: the shard server went away"),
                                            ("send", "TypeError: cannot pickle '_thread.lock' object")])
def test_the_other_ranks_fail_at_once_naming_rank_0s_error(tmp_path, master_port, failure, error):
    """Before, the other ranks waited for a batch rank 0 would never send: an error reading the stream on rank 0
    (or a batch it could not send) left them blocked in the scatter until the process group's timeout (NCCL:
    `ddp_timeout`, 30 minutes by default) or failing with the transport's "connection closed". Now rank 0 sends
    its error: every rank fails at once with it."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port, "WORLD_SIZE": "2"}
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "out"), failure], stderr=subprocess.PIPE,
                              text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] != [0, 0] and time.monotonic() - start < 50
    assert error in errs[0]
    assert f"rank 0 could not read or send the training data's next batches ({error})" in errs[1], errs[1][-2000:]
