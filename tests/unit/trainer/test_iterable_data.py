"""Iterable training and eval data on several ranks and over several epochs, as the HF Trainer feeds it.

- every rank gets its own batches of the stream (HF: accelerate's `IterableDatasetShard`, or rank 0 reading
  and sending each rank its batch, which gives each rank the same samples), never the whole stream each,
  and as many batches as every other rank, so no rank waits at a collective for one whose data ran out;
- an iterable eval set's batches are dealt to the ranks, so `evaluate` and `predict` see each row once;
- a stream with `set_epoch` (a shuffling buffer, `datasets.IterableDataset`) is told each epoch, on a
  resume too, as HF's loader tells it;
- data workers are seeded per rank, as HF seeds them.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import IterableDataset

from kubetrain_trainer import Trainer
from kubetrain_trainer import distributed as dist_util
from kubetrain_trainer.data import IterableShard
from kubetrain_recorder import Recorder


class Stream(IterableDataset):
    """Rows {"x": i} (plus 1000 x the epoch set, when one was)."""

    def __init__(self, n):
        self.n, self.epochs = n, []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        offset = 1000 * self.epochs[-1] if self.epochs else 0
        return iter([{"x": torch.tensor(float(offset + i))} for i in range(self.n)])


def _rank_rows(trainer, monkeypatch, world):
    """Each rank's training rows, the ranks run one after the other: what rank 0 scatters is kept and handed to
    the others as they ask for it (`torch.distributed.scatter_object_list` faked; a 2-process run in
    tests/slow/trainer/test_trainer_processes.py)."""
    sent, received = [], {}

    def scatter(box, scattered, src=0):
        rank = dist_util.rank()
        if rank == 0:
            sent.append(scattered)
        else:
            box[0] = sent[received.setdefault(rank, 0)][rank]
            received[rank] += 1

    monkeypatch.setattr(torch.distributed, "scatter_object_list", scatter)
    parts = []
    for rank in range(world):
        monkeypatch.setattr(dist_util, "world_size", lambda: world)
        monkeypatch.setattr(dist_util, "rank", lambda r=rank: r)
        parts.append([int(v) for batch in trainer.get_train_dataloader() for v in batch["x"].tolist()])
    return parts


class Counted(Stream):
    def __init__(self, n):
        super().__init__(n)
        self.reads = 0

    def __iter__(self):
        self.reads += 1
        return super().__iter__()


def test_only_rank_0_reads_a_stream_and_deals_the_batches(make_args, monkeypatch):
    """Before, every rank read the whole stream and kept its own batches: a streaming set was downloaded and
    decoded on each of N ranks. Now rank 0 reads it and sends each rank its batch (HF's default,
    `dispatch_batches`), the same batches every rank kept before; the other ranks start no data workers."""
    args = make_args(per_device_train_batch_size=2, save_strategy="no")
    stream = Counted(10)
    trainer = Trainer(model=Recorder(), args=args, train_dataset=stream)
    rank0, rank1 = _rank_rows(trainer, monkeypatch, 2)
    assert stream.reads == 1
    split = [list(IterableShard(range(10), batch_size=2, num_replicas=2, rank=r, drop_last=False)) for r in (0, 1)]
    assert [rank0, rank1] == split == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 0, 1]]


@pytest.mark.parametrize("n, drop_last", [(16, False), (11, False), (11, True), (3, False)])
def test_each_rank_trains_its_own_batches_of_a_stream(make_args, monkeypatch, n, drop_last):
    """Before, every rank iterated the whole stream: a 2-rank run trained each sample twice per epoch, and
    ranks whose streams ended at different batches hung at the step's collective."""
    args = make_args(per_device_train_batch_size=2, dataloader_drop_last=drop_last, save_strategy="no")
    trainer = Trainer(model=Recorder(), args=args, train_dataset=Stream(n))
    rank0, rank1 = _rank_rows(trainer, monkeypatch, 2)
    assert rank0[:4] == [0, 1, 4, 5] if n >= 8 else rank0[:2] == [0, 1]
    assert len(rank0) == len(rank1) and len(rank0) % 2 == 0  # as many full batches on each rank
    if n == 16:
        assert sorted(rank0 + rank1) == list(range(16))
    else:  # completed from the first rows, as HF does; with dataloader_drop_last too, which HF ignores here
        assert set(rank0 + rank1) == set(range(n))


@pytest.mark.parametrize("n, drop_last, world", [(16, False, 2), (11, False, 2), (11, True, 2), (3, False, 2),
                                                 (10, False, 3), (1, False, 4)])
def test_the_split_is_accelerates(n, drop_last, world):
    shard = pytest.importorskip("accelerate.data_loader").IterableDatasetShard
    for rank in range(world):
        theirs = shard(list(range(n)), batch_size=2, drop_last=drop_last, num_processes=world, process_index=rank)
        ours = IterableShard(list(range(n)), batch_size=2, num_replicas=world, rank=rank, drop_last=drop_last)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_a_stream_is_told_each_epoch_also_on_a_resume(make_args, tmp_path):
    """Before, `set_epoch` was never called: a shuffling stream replayed epoch 0's order every epoch."""
    def run(**kw):
        model, stream = Recorder(), Stream(6)
        args = make_args(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, max_steps=7, save_steps=4)
        Trainer(model=model, args=args, train_dataset=stream).train(**kw)
        return model.seen, stream.epochs

    seen, epochs = run()
    assert epochs == [0, 1, 2] and seen == [0, 1, 2, 3, 4, 5, 1000, 1001, 1002, 1003, 1004, 1005, 2000, 2001]
    seen, epochs = run(resume_from_checkpoint=str(tmp_path / "o" / "checkpoint-4"))  # 1 batch into epoch 1
    assert epochs == [1, 2] and seen == [1002, 1003, 1004, 1005, 2000, 2001]


EVAL_SCRIPT = """
import json, os, sys, torch
from torch import nn
from torch.utils.data import IterableDataset
from kubetrain_trainer import Trainer, TrainingArguments

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(1, 1)
        torch.nn.init.constant_(self.w.weight, 0.5)
        torch.nn.init.constant_(self.w.bias, 0.25)

    def forward(self, x, labels=None):
        out = self.w(x.view(-1, 1)).view(-1)
        return {"loss": ((out - labels) ** 2).mean(), "logits": x}

class Rows(IterableDataset):
    def __iter__(self):
        return iter([{"x": torch.tensor(float(i)), "labels": torch.tensor(float(i % 3))} for i in range(5)])

args = TrainingArguments(output_dir=sys.argv[1], use_cpu=True, report_to="none", disable_tqdm=True,
                         save_strategy="no", per_device_eval_batch_size=2, ddp_timeout=60)
trainer = Trainer(model=Model(), args=args, compute_metrics=lambda p: {"n": len(p.label_ids)})
metrics, predicted = trainer.evaluate(Rows()), trainer.predict(Rows())
print(json.dumps([metrics["eval_loss"], metrics["eval_n"], predicted.predictions.tolist(),
                  predicted.label_ids.tolist()]), flush=True)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
"""


def test_an_iterable_eval_set_is_dealt_to_the_ranks_each_row_once(tmp_path, master_port):
    """Before, every rank evaluated the whole stream and the gather interleaved the copies: on 2 ranks
    `predict` returned each row twice (10 predictions of 5 rows), and compute_metrics saw them so."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "evaluate.py"
    script.write_text(EVAL_SCRIPT)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port}
    alone = subprocess.run([sys.executable, str(script), str(tmp_path / "one")], env=env, capture_output=True,
                           text=True, timeout=120, check=True).stdout.splitlines()[-1]
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "two")], stdout=subprocess.PIPE, text=True,
                              env={**env, "WORLD_SIZE": "2", "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0].splitlines()[-1] for p in procs]
    loss, n, predictions, labels = json.loads(alone)
    assert n == 5 and predictions == [0, 1, 2, 3, 4] and labels == [0, 1, 2, 0, 1]
    for out in outs:  # the last round has no batch for rank 1: its copy is neither counted nor gathered
        assert json.loads(out)[1:] == [5, predictions, labels] and json.loads(out)[0] == pytest.approx(loss)


class Augmented(torch.utils.data.Dataset):
    """Rows whose `aug` is drawn in `__getitem__` (a random crop's offsets) from torch's and python's generators."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import random
        return {"x": torch.tensor(float(i)), "aug": torch.tensor([torch.rand(()).item(), random.random()])}


def test_data_workers_draw_differently_on_each_rank(make_args, monkeypatch):
    """Before, the workers' seeds came from the loader's generator alone, seeded alike on every rank: with
    `dataloader_num_workers` > 0 each rank's k-th sample got the same augmentation as every other rank's.
    HF offsets the worker seed by `num_workers * rank`; rank 0's draws stay what they were."""
    args = make_args(per_device_train_batch_size=2, dataloader_num_workers=1, save_strategy="no",
                     remove_unused_columns=False)
    trainer = Trainer(model=Recorder(), args=args, train_dataset=Augmented())

    def draws(rank):
        monkeypatch.setattr(dist_util, "world_size", lambda: 2)
        monkeypatch.setattr(dist_util, "rank", lambda: rank)
        return torch.cat([batch["aug"] for batch in trainer.get_train_dataloader()]).tolist()

    assert draws(0) != draws(1) and draws(1) == draws(1)  # still a function of the seed, the epoch and the rank


class ShuffledStream(IterableDataset):
    """Rows 0..15 in an order drawn from python's generator when read (a shard list shuffled per worker)."""

    def __iter__(self):
        import random
        rows = list(range(16))
        random.shuffle(rows)
        return iter([{"x": torch.tensor(float(i))} for i in rows])


def test_a_stream_every_rank_reads_draws_alike_on_every_rank(make_args, monkeypatch):
    """Every rank reads the whole stream and keeps its own batches of it: the ranks' data workers must draw
    the same order, or rank 0 keeps batches of one order and rank 1 of another (rows trained twice, others
    never). Before, the per-rank worker seed (HF's, for a dataset a sampler shards) reached them too."""
    args = make_args(per_device_train_batch_size=2, dataloader_num_workers=1, save_strategy="no")
    trainer = Trainer(model=Recorder(), args=args, train_dataset=ShuffledStream())
    rank0, rank1 = _rank_rows(trainer, monkeypatch, 2)
    assert sorted(rank0 + rank1) == list(range(16))


def test_dataloader_drop_last_is_ignored_for_a_stream_as_the_transformers_trainer_ignores_it(make_args, caplog):
    """Before, the short last batch of each pass over a stream was dropped: HF's loader for an IterableDataset
    gets no drop_last, so an HF user's run trained rows that kubetrain's skipped."""
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments as HFTrainingArguments

    seen = {}
    for name, (args_class, trainer_class) in {"hf": (HFTrainingArguments, HFTrainer),
                                              "kt": (make_args, Trainer)}.items():
        model = Recorder()
        args = args_class(output_dir=make_args().output_dir, per_device_train_batch_size=4, max_steps=6,
                          dataloader_drop_last=True, save_strategy="no", report_to="none", disable_tqdm=True,
                          use_cpu=True, logging_steps=100)
        trainer_class(model=model, args=args, train_dataset=Stream(10)).train()
        seen[name] = model.seen
    assert seen["kt"] == seen["hf"] == [*range(10), *range(1000, 1010)]  # batches of 4, 4 and 2 in each pass
    assert "dataloader_drop_last is ignored for an IterableDataset" in caplog.text
