"""`accelerator_config`, HF's settings for accelerate: taken in HF's forms, each key done or refused by name.

Before, `TrainingArguments(accelerator_config=...)` was refused as an unknown argument (an HF script failed at
start), and an iterable training set on several ranks was always read by rank 0 alone, which dealt the batches:
with `dispatch_batches: false` every rank now reads the stream itself and keeps its own batches, as
accelerate's `IterableDatasetShard` gives them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kubetrain_trainer import ConfigError, Trainer, TrainingArguments
from kubetrain_trainer import distributed as dist_util
from kubetrain_trainer.args_accelerator import AcceleratorConfig
from kubetrain_trainer.data import DispatchedLoader
from kubetrain_recorder import Recorder, env_with_tests
from torch.utils.data import IterableDataset


class Counted(IterableDataset):
    """Rows {"x": i}, i < n; counts the passes over it."""

    def __init__(self, n):
        self.n, self.reads = n, 0

    def __iter__(self):
        self.reads += 1
        return iter([{"x": torch.tensor(float(i))} for i in range(self.n)])


def test_a_dict_a_json_string_a_file_and_hf_s_object_are_taken(tmp_path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "acc.json").write_text(json.dumps({"dispatch_batches": False, "non_blocking": True}))
    given = [{"dispatch_batches": False}, '{"dispatch_batches": false}', str(tmp_path / "acc.json"),
             transformers.trainer_pt_utils.AcceleratorConfig(dispatch_batches=False),
             AcceleratorConfig(dispatch_batches=False)]
    for value in given:
        assert TrainingArguments(accelerator_config=value).accelerator_config.dispatch_batches is False, value
    assert TrainingArguments().accelerator_config == AcceleratorConfig()  # HF's defaults: dispatch_batches None
    assert TrainingArguments.from_cli(["--accelerator_config", '{"dispatch_batches": "false"}']) \
        .accelerator_config.dispatch_batches is False
    parser = transformers.HfArgumentParser((TrainingArguments,))
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", "x", "--accelerator_config",
                                                  str(tmp_path / "acc.json")])
    assert (args.accelerator_config.dispatch_batches, args.accelerator_config.non_blocking) == (False, True)
    hf = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), accelerator_config={"dispatch_batches": False})
    assert TrainingArguments(accelerator_config=hf.to_dict()["accelerator_config"]).accelerator_config == \
        AcceleratorConfig(dispatch_batches=False)  # HF's training_args.json holds it so


def test_help_lists_it():
    from kubetrain_trainer.args_help import usage

    text = usage(TrainingArguments, prog="train.py")  # its type as written, unless HfArgumentParser rewrote it
    assert "--accelerator_config " in text and "(default: None)\n      HF's settings for accelerate" in text


def test_the_arguments_round_trip_through_training_args_json():
    args = TrainingArguments(accelerator_config={"dispatch_batches": False,
                                                 "gradient_accumulation_kwargs": {"num_steps": 4}})
    saved = json.loads(args.to_json_string())
    assert saved["accelerator_config"]["dispatch_batches"] is False and saved["gradient_accumulation_steps"] == 4
    assert TrainingArguments.from_dict(saved) == args


@pytest.mark.parametrize("value, message", [
    ({"dispatch_batchez": False}, r"accelerator_config: unknown key 'dispatch_batchez'; did you mean "
                                  r"'dispatch_batches'\? \(the keys are split_batches, dispatch_batches, even_batches"),
    ('{"dispatch_batches": false', r"accelerator_config: not valid JSON"),
    ("no/such/file.json", r"accelerator_config: cannot read the file 'no/such/file.json'"),
    (7, r"accelerator_config: expected a mapping, a JSON object, the path of a JSON file"),
    (AcceleratorConfig, r"accelerator_config: got the class AcceleratorConfig; pass an instance"),
    ({"dispatch_batches": "sometimes"}, r"accelerator_config.dispatch_batches: expected true or false, got"),
    ({"split_batches": True}, r"accelerator_config.split_batches: only false: .*per_device_train_batch_size"),
    ({"even_batches": False}, r"accelerator_config.even_batches: only true"),
    ({"use_seedable_sampler": "false"}, r"accelerator_config.use_seedable_sampler: only true: .*data_seed"),
    ({"use_configured_state": True}, r"accelerator_config.use_configured_state: only false"),
    ({"gradient_accumulation_kwargs": {"adjust_scheduler": False}},
     r"accelerator_config.gradient_accumulation_kwargs.adjust_scheduler: only true: .*once per optimizer step"),
    ({"gradient_accumulation_kwargs": {"adjust_sheduler": True}},
     r"accelerator_config.gradient_accumulation_kwargs: unknown key 'adjust_sheduler'"),
    ({"gradient_accumulation_kwargs": {"num_steps": 0}},
     r"accelerator_config.gradient_accumulation_kwargs.num_steps must be >= 1, got 0"),
    ({"gradient_accumulation_kwargs": {"num_steps": 3}, "split_batches": True},
     r"accelerator_config.split_batches: only false"),
])
def test_a_bad_key_or_a_value_kubetrain_does_not_implement_is_refused_by_name(value, message):
    with pytest.raises(ConfigError, match=r"invalid training arguments:\n  - " + message):
        TrainingArguments(accelerator_config=value)
    with pytest.raises(ConfigError, match=message):
        TrainingArguments.from_dict({"accelerator_config": value})


def test_num_steps_is_the_accumulation_as_in_hf():
    accumulate = {"gradient_accumulation_kwargs": {"num_steps": 4, "sync_each_batch": "true"}}
    args = TrainingArguments(accelerator_config=accumulate)
    assert args.gradient_accumulation_steps == 4 and args.accelerator_config.sync_each_batch is True
    with pytest.raises(ConfigError, match=r"num_steps \(4\) and gradient_accumulation_steps \(2\) are both set"):
        TrainingArguments(gradient_accumulation_steps=2, accelerator_config=accumulate)


def _loaders(trainer, monkeypatch, world):
    """Each rank's training loader, the ranks made one after the other in this process."""
    loaders = []
    for rank in range(world):
        monkeypatch.setattr(dist_util, "world_size", lambda: world)
        monkeypatch.setattr(dist_util, "rank", lambda r=rank: r)
        loaders.append(trainer.get_train_dataloader())
    return loaders


def test_dispatch_batches_false_has_every_rank_read_the_stream_and_keep_accelerate_s_part(make_args, monkeypatch):
    shard = pytest.importorskip("accelerate.data_loader").IterableDatasetShard
    stream = Counted(11)
    args = make_args(per_device_train_batch_size=2, accelerator_config={"dispatch_batches": False})
    loaders = _loaders(Trainer(model=Recorder(), args=args, train_dataset=stream), monkeypatch, 2)
    assert not any(isinstance(loader, DispatchedLoader) for loader in loaders)  # no collective in them
    rows = [[int(v) for batch in loader for v in batch["x"].tolist()] for loader in loaders]
    theirs = [[int(row["x"]) for row in shard(Counted(11), batch_size=2, num_processes=2, process_index=r)]
              for r in (0, 1)]
    assert rows == theirs == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 0]] and stream.reads == 2


@pytest.mark.parametrize("value", [None, True])
def test_dispatch_batches_null_or_true_deals_a_stream_from_rank_0_as_before(make_args, monkeypatch, value):
    args = make_args(accelerator_config={"dispatch_batches": value})
    loaders = _loaders(Trainer(model=Recorder(), args=args, train_dataset=Counted(8)), monkeypatch, 2)
    assert all(isinstance(loader, DispatchedLoader) for loader in loaders)


def test_dispatch_batches_true_for_a_map_style_set_on_several_ranks_is_refused(make_args, monkeypatch):
    """HF would read it on rank 0 and send the batches; kubetrain's sampler gives each rank its rows by index.
    Refused rather than ignored; on one process there is nothing to dispatch."""
    rows = [{"x": torch.tensor(float(i))} for i in range(8)]
    trainer = Trainer(model=Recorder(), args=make_args(accelerator_config={"dispatch_batches": True}),
                      train_dataset=rows)
    assert len(_loaders(trainer, monkeypatch, 1)[0]) == 2
    with pytest.raises(ConfigError, match=r"accelerator_config.dispatch_batches: true applies to an IterableDataset "
                                          r"only.*leave dispatch_batches out or set it false"):
        _loaders(trainer, monkeypatch, 2)


SCRIPT = """
import json, sys, torch
from torch.utils.data import IterableDataset
from kubetrain_trainer import Trainer, TrainingArguments
from kubetrain_recorder import Recorder

class Stream(IterableDataset):
    reads = 0

    def __iter__(self):
        Stream.reads += 1
        return iter([{"x": torch.tensor(float(i))} for i in range(11)])

args = TrainingArguments(output_dir=sys.argv[1], use_cpu=True, report_to="none", disable_tqdm=True,
                         save_strategy="no", per_device_train_batch_size=2, max_steps=3, ddp_timeout=30,
                         accelerator_config='{"dispatch_batches": false}')
model = Recorder()
trainer = Trainer(model=model, args=args, train_dataset=Stream())
trainer.train()
alone = []
if trainer.is_world_process_zero():  # a script's look at the data on one rank: no other rank takes part
    alone = [int(v) for batch in trainer.get_train_dataloader() for v in batch["x"].tolist()]
print(json.dumps({"trained": model.seen, "alone": alone, "reads": Stream.reads}), flush=True)
torch.distributed.destroy_process_group()
"""


def test_two_ranks_each_read_the_stream_and_rank_0_may_iterate_it_alone(tmp_path, master_port):
    """Two gloo processes: each trains accelerate's part of the stream for it, reading the stream itself; rank 0
    then iterates the training loader alone and gets its part (with the dealing loader it waited for rank 1)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = env_with_tests({**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port, "WORLD_SIZE": "2"})
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "out")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    rank0, rank1 = (json.loads(out.splitlines()[-1]) for out, _ in outs)
    assert rank0["trained"] == [0, 1, 4, 5, 8, 9] and rank1["trained"] == [2, 3, 6, 7, 10, 0]  # accelerate's
    assert rank0["alone"] == [0, 1, 4, 5, 8, 9] and rank1["alone"] == []
    assert rank0["reads"] == 2 and rank1["reads"] == 1  # rank 1 read the stream itself


@pytest.mark.parametrize("sync_each_batch, asked", [(False, [True, True]), (True, [False, False])])
def test_sync_each_batch_synchronises_the_gradients_of_every_micro_batch(make_args, monkeypatch, sync_each_batch,
                                                                        asked):
    """HF's `gradient_accumulation_kwargs.sync_each_batch` (less memory under FSDP): no micro-batch skips the
    synchronisation. Before, the setting was not there."""
    from kubetrain_trainer.strategies.ddp import DDPStrategy

    calls = []
    no_sync = DDPStrategy.no_sync
    monkeypatch.setattr(DDPStrategy, "no_sync", lambda self, enabled: calls.append(enabled) or no_sync(self, enabled))
    accumulate = {"gradient_accumulation_kwargs": {"num_steps": 2, "sync_each_batch": sync_each_batch}}
    args = make_args(per_device_train_batch_size=2, max_steps=2, save_strategy="no", accelerator_config=accumulate)
    Trainer(model=Recorder(), args=args, train_dataset=[{"x": torch.tensor(float(i))} for i in range(8)]).train()
    assert calls == asked  # the first of each step's 2 micro-batches


def test_adjust_scheduler_true_is_what_the_trainer_does_and_is_taken():
    """accelerate's default (the schedule follows the optimizer steps, not the micro-batches): nothing to change."""
    from kubetrain_trainer.args_accelerator import AcceleratorConfig

    config = AcceleratorConfig.parse({"gradient_accumulation_kwargs": {"adjust_scheduler": True, "num_steps": 2}})
    assert config.gradient_accumulation_kwargs == {"num_steps": 2}
