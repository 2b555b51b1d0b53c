"""Two real gloo processes train on an iterable set: rank 0 alone reads it and deals each rank its batches."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from kubetrain_recorder import env_with_tests

pytestmark = pytest.mark.slow

SCRIPT = """
import json, sys, torch
from torch.utils.data import IterableDataset
from kubetrain_trainer import Trainer, TrainingArguments
from kubetrain_recorder import Recorder

class Stream(IterableDataset):
    def __init__(self):
        self.epoch, self.reads = 0, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        self.reads += 1
        return iter([{"x": torch.tensor(float(1000 * self.epoch + i))} for i in range(10)])

model, stream = Recorder(), Stream()
args = TrainingArguments(output_dir=sys.argv[1], use_cpu=True, report_to="none", disable_tqdm=True, max_steps=5,
                         save_strategy="no", per_device_train_batch_size=2, ddp_timeout=60,
                         dataloader_num_workers=int(sys.argv[2]))
Trainer(model=model, args=args, train_dataset=stream).train()
print(json.dumps([model.seen, stream.reads]), flush=True)
torch.distributed.destroy_process_group()
"""


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.parametrize("workers", [0, 1])
def test_rank_0_reads_the_stream_and_each_rank_trains_its_batches(tmp_path, workers):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = env_with_tests({**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _free_port(), "WORLD_SIZE": "2"})
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "out"), str(workers)],
                              stdout=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)]
    (seen0, reads0), (seen1, reads1) = [json.loads(p.communicate(timeout=60)[0].splitlines()[-1]) for p in procs]
    # groups of 2 x 2 rows, rank r the r-th pair; the last group completed from the first rows; 3 steps an epoch
    assert seen0 == [0, 1, 4, 5, 8, 9, 1000, 1001, 1004, 1005]
    assert seen1 == [2, 3, 6, 7, 0, 1, 1002, 1003, 1006, 1007]
    assert reads1 == 0 and reads0 == (0 if workers else 2)  # with a worker, rank 0's worker reads it
