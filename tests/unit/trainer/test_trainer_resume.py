"""Exact resume, in one process: stop and resume must equal training straight through, bitwise.

Dropout (global RNG), gradient accumulation, warmup + cosine schedule, weight
decay and a stop in the middle of an epoch are all in play, so a forgotten
piece of resume state (RNG, data position, scheduler, optimizer moments,
logging accumulators) breaks `torch.equal`.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from kubetrain_trainer import Trainer, TrainerCallback, TrainingPreempted
from kubetrain_trainer.checkpoint import list_checkpoints

STEPS = 12


def _args(make_args, **kw):
    # 30 samples / batch 4 = 8 micro-batches per epoch = 4 steps of 2: step 6 is mid-epoch 1.
    return make_args(max_steps=STEPS, gradient_accumulation_steps=2, warmup_steps=2, lr_scheduler_type="cosine",
                     weight_decay=0.1, save_steps=3, **kw)


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class SigtermAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-step; the step must still complete


def _losses(state):
    return [(e["step"], e["loss"], e["grad_norm"], e["learning_rate"]) for e in state.log_history if "loss" in e]


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"parameter {k} differs"


def test_stop_and_resume_is_bitwise_equal_to_straight_run(tiny_gpt, tokens, make_args, tmp_path):
    straight = Trainer(model=tiny_gpt(0), args=_args(make_args, output_dir=str(tmp_path / "a")),
                       train_dataset=tokens())
    straight.train()

    first = Trainer(model=tiny_gpt(0), args=_args(make_args, output_dir=str(tmp_path / "b")),
                    train_dataset=tokens(), callbacks=[StopAt(6)])
    first.train()
    assert first.state.global_step == 6
    # A different initialisation proves the weights come from the checkpoint.
    resumed = Trainer(model=tiny_gpt(123), args=_args(make_args, output_dir=str(tmp_path / "b")),
                      train_dataset=tokens())
    out = resumed.train(resume_from_checkpoint=True)

    assert out.global_step == STEPS
    _assert_same(_params(straight.model), _params(resumed.model))
    assert _losses(straight.state) == _losses(resumed.state)
    assert len(_losses(resumed.state)) == STEPS


def test_sigterm_finishes_the_step_saves_and_resumes_exactly(tiny_gpt, tokens, make_args, tmp_path):
    straight = Trainer(model=tiny_gpt(0), args=_args(make_args, output_dir=str(tmp_path / "a")),
                       train_dataset=tokens())
    straight.train()

    out_dir = tmp_path / "b"
    preempted = Trainer(model=tiny_gpt(0), args=_args(make_args, output_dir=str(out_dir)), train_dataset=tokens(),
                        callbacks=[SigtermAt(5)])
    with pytest.raises(TrainingPreempted) as info:
        preempted.train()
    assert info.value.step == 5
    assert info.value.checkpoint_dir == str(out_dir / "checkpoint-5")
    assert [s for s, _ in list_checkpoints(out_dir)] == [3, 5]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored

    resumed = Trainer(model=tiny_gpt(7), args=_args(make_args, output_dir=str(out_dir)), train_dataset=tokens())
    resumed.train(resume_from_checkpoint=str(out_dir / "checkpoint-5"))
    _assert_same(_params(straight.model), _params(resumed.model))
    assert _losses(straight.state) == _losses(resumed.state)


def test_resume_true_without_checkpoint_starts_fresh(tiny_gpt, tokens, make_args):
    trainer = Trainer(model=tiny_gpt(0), args=make_args(max_steps=2), train_dataset=tokens())
    assert trainer.train(resume_from_checkpoint=True).global_step == 2


def test_resume_skips_no_batch_and_repeats_none(tiny_gpt, tokens, make_args, tmp_path):
    """The data seen across stop+resume is exactly the straight run's sequence of batches."""
    seen = {}

    def run(key, out, stop=None, resume=None, seed=0):
        dataset = tokens()
        calls = seen.setdefault(key, [])
        original = dataset.__getitem__

        class Spy(type(dataset)):
            def __getitem__(self, i):
                calls.append(i)
                return original(i)
        dataset.__class__ = Spy
        trainer = Trainer(model=tiny_gpt(seed), args=_args(make_args, output_dir=str(out)), train_dataset=dataset,
                          callbacks=[StopAt(stop)] if stop else [])
        trainer.train(resume_from_checkpoint=resume)

    run("straight", tmp_path / "a")
    run("split", tmp_path / "b", stop=6)
    run("split", tmp_path / "b", resume=True)
    assert seen["straight"] == seen["split"]


class EpochEvents(TrainerCallback):
    def __init__(self):
        self.ends = []

    def on_epoch_end(self, args, state, control, **kwargs):
        self.ends.append(state.global_step)


@pytest.mark.parametrize("saves", [{"save_strategy": "epoch"}, {"save_strategy": "epoch", "ignore_data_skip": True},
                                   {"save_strategy": "steps", "save_steps": 2}],  # step 4 saved before the SIGTERM
                         ids=["epoch saves", "ignore_data_skip", "a step save at the epoch's end"])
def test_sigterm_at_an_epoch_s_last_step_runs_that_epoch_s_end_on_resume(tiny_gpt, tokens, make_args, tmp_path,
                                                                        saves):
    """Preempted at the last step of an epoch, the run saved the next batch as the next epoch's first, and the
    epoch's end (its evaluation, save and log with the "epoch" strategies, on_epoch_end) never ran: the best
    checkpoint, early stopping and log_history then differed from a straight run. The resumed run runs it."""
    def args(out):  # 30 samples / batch 4 = 8 micro-batches = 4 steps of 2 per epoch
        return make_args(output_dir=str(out), max_steps=-1, num_train_epochs=3, gradient_accumulation_steps=2,
                         eval_strategy="epoch", logging_strategy="epoch", **saves)

    def evals(state):
        return [(e["step"], e["eval_loss"]) for e in state.log_history if "eval_loss" in e]

    straight, ends = Trainer(model=tiny_gpt(0), args=args(tmp_path / "a"), train_dataset=tokens(),
                             eval_dataset=tokens(8, seed=1), callbacks=[EpochEvents()]), []
    straight.train()
    first = Trainer(model=tiny_gpt(0), args=args(tmp_path / "b"), train_dataset=tokens(),
                    eval_dataset=tokens(8, seed=1), callbacks=[SigtermAt(4)])
    with pytest.raises(TrainingPreempted) as info:
        first.train()
    assert info.value.step == 4 and evals(first.state) == []  # its epoch end had not run
    # The emergency checkpoint (saved again after a step save at 4) says so; its data position is as it always
    # was, the next epoch's start: a trainer without the deferral resumes there.
    emergency = json.loads((tmp_path / "b" / "checkpoint-4" / "kubetrain_state.json").read_text())
    assert emergency["data_position"] == {"epoch": 1, "samples": 0} and emergency["epoch_end_pending"] is not None
    resumed = Trainer(model=tiny_gpt(7), args=args(tmp_path / "b"), train_dataset=tokens(),
                      eval_dataset=tokens(8, seed=1), callbacks=[EpochEvents()])
    resumed.train(resume_from_checkpoint=True)
    ends = [c for c in resumed.callback_handler.callbacks if isinstance(c, EpochEvents)][0].ends
    assert ends == [4, 8, 12]
    assert evals(resumed.state) == evals(straight.state) and len(evals(straight.state)) == 3
    def logs(state):  # every log but the run's timings
        return [{k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k} for e in state.log_history]

    assert logs(resumed.state)[:-1] == logs(straight.state)[:-1]  # the last: the train summary of this process
    _assert_same(_params(straight.model), _params(resumed.model))
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(p.name for p in (tmp_path / "a").iterdir())


def _digest(root):
    import hashlib

    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode() + (p.read_bytes() if p.is_file() else b"/"))
    return h.hexdigest()


def _break_state(text):
    return lambda folder: (folder / "trainer_state.json").write_text(text)


def _string_step(folder):
    state = json.loads((folder / "trainer_state.json").read_text())
    (folder / "trainer_state.json").write_text(json.dumps({**state, "global_step": str(state["global_step"])}))


def _truncate(name):
    return lambda folder: (folder / name).write_bytes((folder / name).read_bytes()[:100])


@pytest.mark.parametrize("damage, what", [
    (_break_state("not json"), "trainer_state.json cannot be loaded (JSONDecodeError"),
    (_break_state("[]"), "trainer_state.json cannot be loaded (ValueError: expected a JSON object, got list"),
    (_string_step, "trainer_state.json cannot be loaded (ValueError: global_step: '3' is not of type"),
    (lambda folder: (folder / "kubetrain_state.json").write_text("[]"),
     "trainer_state.json cannot be loaded (ValueError: expected a JSON object, got list; while reading"),
    (_truncate("optimizer.pt"), "the model+optimizer in it cannot be loaded (RuntimeError: PytorchStreamReader"),
    (_truncate("model.safetensors"), "model+optimizer in it cannot be loaded (SafetensorError"),
    (lambda folder: (folder / "model.safetensors").unlink(), "(FileNotFoundError"),
    (_truncate("scheduler.pt"), "the scheduler in it cannot be loaded"),
])
def test_a_broken_checkpoint_is_a_config_error_naming_the_folder_and_what_and_stays_untouched(
        tiny_gpt, tokens, make_args, tmp_path, damage, what):
    import shutil

    from kubetrain_trainer import ConfigError

    Trainer(model=tiny_gpt(0), args=make_args(max_steps=3), train_dataset=tokens()).train()
    folder = tmp_path / "broken"
    shutil.copytree(tmp_path / "out" / "checkpoint-3", folder)
    damage(folder)
    before = _digest(folder)
    trainer = Trainer(model=tiny_gpt(0), args=make_args(output_dir=str(tmp_path / "again")), train_dataset=tokens())
    with pytest.raises(ConfigError) as err:
        trainer.train(resume_from_checkpoint=str(folder))
    assert str(err.value).startswith(f"resume_from_checkpoint {str(folder)!r}: ") and what in str(err.value)
    assert _digest(folder) == before


def test_a_checkpoint_of_another_model_says_the_models_arguments_changed(tokens, make_args, tmp_path):
    from kubetrain_trainer import ConfigError
    from kubetrain_trainer.models import TinyGPT, TinyGPTConfig

    def model(d_model):
        return TinyGPT(TinyGPTConfig(vocab_size=32, seq_len=8, d_model=d_model, n_layers=1, n_heads=2))

    Trainer(model=model(16), args=make_args(max_steps=3), train_dataset=tokens()).train()
    out = tmp_path / "out"
    before = _digest(out)
    with pytest.raises(ConfigError, match=r"checkpoint-3': the model\+optimizer in it cannot be loaded "
                                          r"\(StateDictMismatch: .*size mismatch.*model's arguments .* changed"):
        Trainer(model=model(32), args=make_args(), train_dataset=tokens()).train(resume_from_checkpoint=True)
    assert _digest(out) == before


class NoisyStream(torch.utils.data.IterableDataset):
    """A stream without a length or a seek that draws from the global generators (python's and torch's), as
    a streaming dataset with on-the-fly augmentation does."""

    def __init__(self, base):
        self.base = base

    def __iter__(self):
        import random
        for i in range(len(self.base)):
            item = dict(self.base[i])
            ids = item["input_ids"].clone()
            mask = torch.rand(ids.shape) < 0.3
            ids[mask] = torch.randint(0, 32, ids.shape)[mask] if random.random() < 0.5 else 0
            item["input_ids"] = ids
            yield item


def test_an_iterable_dataset_drawing_the_global_rng_resumes_bitwise(tiny_gpt, tokens, make_args, tmp_path):
    """The resumed run skips the trained batches by iterating them, which draws random numbers: the RNG state
    is restored after the skip (as HF does), else every later draw (the data's and dropout's) is shifted."""
    def run(out, **kw):
        return Trainer(model=tiny_gpt(kw.pop("seed", 0)), args=_args(make_args, output_dir=str(out)),
                       train_dataset=NoisyStream(tokens(60)), **kw)

    straight = run(tmp_path / "a")
    straight.train()
    with pytest.raises(TrainingPreempted):  # 15 batches an epoch: step 10 is 4 batches into epoch 1
        run(tmp_path / "b", callbacks=[SigtermAt(10)]).train()
    resumed = run(tmp_path / "b", seed=7)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-10"))
    assert _losses(straight.state) == _losses(resumed.state) and len(_losses(resumed.state)) == STEPS
    _assert_same(_params(straight.model), _params(resumed.model))


@pytest.mark.parametrize("failure", [RuntimeError("PytorchStreamReader failed reading file data/0: file read failed"),
                                     torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")])
def test_a_read_that_may_pass_is_not_a_config_error(tiny_gpt, tokens, make_args, tmp_path, monkeypatch, failure):
    """A network filesystem's failed read or an out-of-memory while loading is the attempt's trouble, not the
    folder's: it stays the error it was (exit 1, the attempt retried), never exit 82 that fails the job for good;
    the same folder loads the next time."""
    from kubetrain_trainer import ConfigError

    Trainer(model=tiny_gpt(0), args=make_args(max_steps=3), train_dataset=tokens()).train()
    folder = str(tmp_path / "out" / "checkpoint-3")
    real, fired = torch.load, []

    def flaky(path, *args, **kwargs):
        if str(path).endswith("optimizer.pt") and not fired:
            fired.append(path)
            raise failure
        return real(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", flaky)
    again = Trainer(model=tiny_gpt(0), args=make_args(output_dir=str(tmp_path / "b")), train_dataset=tokens())
    with pytest.raises(type(failure)) as err:
        again.train(resume_from_checkpoint=folder)
    assert not isinstance(err.value, ConfigError) and fired
    later = Trainer(model=tiny_gpt(0), args=make_args(output_dir=str(tmp_path / "c"), max_steps=4),
                    train_dataset=tokens()).train(resume_from_checkpoint=folder)
    assert later.global_step == 4


def test_a_checkpoint_the_hf_trainer_wrote_with_float_schedule_fields_resumes(tiny_gpt, tokens, make_args, tmp_path):
    """HF's command-line parser gives `--logging_steps 1` as 1.0, and its trainer_state.json keeps it: the
    type check refused the checkpoint (exit 82). A resume takes those fields from its own arguments anyway."""
    Trainer(model=tiny_gpt(0), args=make_args(max_steps=3), train_dataset=tokens()).train()
    folder = tmp_path / "out" / "checkpoint-3"
    state = json.loads((folder / "trainer_state.json").read_text())
    (folder / "trainer_state.json").write_text(json.dumps({**state, "logging_steps": 1.0, "eval_steps": 0.5}))
    resumed = Trainer(model=tiny_gpt(0), args=make_args(output_dir=str(tmp_path / "b"), max_steps=4),
                      train_dataset=tokens())
    assert resumed.train(resume_from_checkpoint=str(folder)).global_step == 4


def test_a_kubetrain_state_of_another_step_is_not_mixed_in(tiny_gpt, tokens, make_args, tmp_path, caplog):
    """The HF Trainer re-saves checkpoint-N in place and leaves kubetrain_state.json of an older step there:
    its data position was taken, and samples were trained again silently."""
    from kubetrain_trainer.state import read_saved

    Trainer(model=tiny_gpt(0), args=make_args(max_steps=6, save_steps=3), train_dataset=tokens()).train()
    out = tmp_path / "out"
    old = json.loads((out / "checkpoint-3" / "kubetrain_state.json").read_text())
    assert old["global_step"] == 3
    (out / "checkpoint-6" / "kubetrain_state.json").write_text(json.dumps(old))
    with caplog.at_level("WARNING", logger="kubetrain_trainer"):
        merged = read_saved(out / "checkpoint-6" / "trainer_state.json")
    assert merged["global_step"] == 6 and "data_position" not in merged
    assert "is of step 3" in caplog.text
    own = read_saved(out / "checkpoint-3" / "trainer_state.json")
    assert own["global_step"] == 3 and own["data_position"]
