"""`async_save`: a checkpoint is staged in the loop, written and committed in the background (one process).

The strategy's writer is held back until the loop next waits for the save in
flight (`Held`), so "training went on while the write was in flight" and "the
next save waited for it" are facts of the run, not races: at the steps in
between, the folder must not exist yet under its committed name, and the
checkpoint written after training moved on must still hold the state of its
own step (resume is bitwise equal to a straight run).
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from kubetrain_trainer import Trainer, TrainerCallback, TrainingPreempted
from kubetrain_trainer.checkpoint import list_checkpoints
from kubetrain_trainer.readiness import READY_MARKER
from test_trainer_resume import StopAt

STEPS = 12


def _args(make_args, **kw):
    return make_args(**{**dict(max_steps=STEPS, gradient_accumulation_steps=2, warmup_steps=2,
                               lr_scheduler_type="cosine", weight_decay=0.1, save_steps=3), **kw})


class Held:
    """Holds each staged checkpoint's writer until the loop waits for that save (`Trainer._saves.wait`)."""

    def __init__(self, trainer: Trainer) -> None:
        self.gates: list[threading.Event] = []
        stage, wait = trainer.strategy.stage_checkpoint, trainer._saves.wait

        def held_stage(directory):
            write, gate = stage(directory), threading.Event()
            self.gates.append(gate)
            return lambda: (gate.wait(), write())

        def releasing_wait():
            for gate in self.gates:
                gate.set()
            return wait()
        trainer.strategy.stage_checkpoint = held_stage
        trainer._saves.wait = releasing_wait


class Watch(TrainerCallback):
    """What a user sees in output_dir at each step end, and each on_save (at which step, for which folder)."""

    def __init__(self, out, sigterm_at=None):
        self.out, self.sigterm_at = out, sigterm_at
        self.committed: dict[int, list[int]] = {}
        self.saves: list[tuple[int, str]] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if self.sigterm_at == state.global_step + 1:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_step_end(self, args, state, control, **kwargs):
        self.committed[state.global_step] = [s for s, _ in list_checkpoints(self.out)]

    def on_save(self, args, state, control, checkpoint_dir=None, **kwargs):
        self.saves.append((state.global_step, os.path.basename(checkpoint_dir)))


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_folder_is_committed_only_after_the_write_and_the_next_save_waits(tiny_gpt, tokens, make_args, tmp_path):
    out = tmp_path / "out"
    watch = Watch(out)
    trainer = Trainer(model=tiny_gpt(0), args=_args(make_args, output_dir=str(out), async_save=True, max_steps=7),
                      train_dataset=tokens(), callbacks=[watch])
    Held(trainer)
    trainer.train()
    # Steps 4 and 5 trained while checkpoint-3 was being written: not committed, not visible to resume.
    assert watch.committed[4] == [] and watch.committed[5] == []
    # The save at step 6 waited for checkpoint-3 (its on_save fired first, from inside that save).
    assert watch.saves[0] == (6, "checkpoint-3")
    # The end of training waited for checkpoint-6 (held until then) and then saved step 7.
    assert [name for _, name in watch.saves] == ["checkpoint-3", "checkpoint-6", "checkpoint-7"]
    assert [s for s, _ in list_checkpoints(out)] == [3, 6, 7]
    for step in (3, 6, 7):
        names = set(os.listdir(out / f"checkpoint-{step}"))
        assert {READY_MARKER, "model.safetensors", "optimizer.pt", "trainer_state.json"} <= names
    assert not [p for p in os.listdir(out) if p.startswith("tmp-")]


def test_async_checkpoint_resumes_bitwise_like_a_straight_run(tiny_gpt, tokens, make_args, tmp_path):
    straight = Trainer(model=tiny_gpt(0), args=_args(make_args, output_dir=str(tmp_path / "a")),
                       train_dataset=tokens())
    straight.train()

    out = tmp_path / "b"
    first = Trainer(model=tiny_gpt(0), args=_args(make_args, output_dir=str(out), async_save=True),
                    train_dataset=tokens(), callbacks=[StopAt(6)])
    Held(first)  # checkpoint-3's files are written only after step 6 has updated the weights
    first.train()
    resumed = Trainer(model=tiny_gpt(99), args=_args(make_args, output_dir=str(out), async_save=True),
                      train_dataset=tokens())
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    a, b = _params(straight.model), _params(resumed.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_emergency_checkpoint_waits_for_the_save_in_flight_and_commits_both(tiny_gpt, tokens, make_args, tmp_path):
    out = tmp_path / "out"
    watch = Watch(out, sigterm_at=4)
    trainer = Trainer(model=tiny_gpt(0), args=_args(make_args, output_dir=str(out), async_save=True),
                      train_dataset=tokens(), callbacks=[watch])
    Held(trainer)
    with pytest.raises(TrainingPreempted) as info:
        trainer.train()
    assert watch.committed[4] == []  # checkpoint-3 was still in flight when SIGTERM stopped the loop
    assert info.value.step == 4 and info.value.checkpoint_dir == str(out / "checkpoint-4")
    assert [name for _, name in watch.saves] == ["checkpoint-3", "checkpoint-4"]
    assert [s for s, _ in list_checkpoints(out)] == [3, 4]
    assert (out / "checkpoint-4" / READY_MARKER).is_file()


def test_a_failed_background_write_is_never_committed_and_stops_training(tiny_gpt, tokens, make_args, tmp_path):
    from kubetrain_trainer.background_save import CheckpointWriteError

    out = tmp_path / "out"
    trainer = Trainer(model=tiny_gpt(0), args=_args(make_args, output_dir=str(out), async_save=True),
                      train_dataset=tokens())

    def failing_stage(directory):
        def write():
            raise OSError(28, "No space left on device")
        return write
    trainer.strategy.stage_checkpoint = failing_stage
    with pytest.raises(CheckpointWriteError, match="checkpoint-3.*No space left"):
        trainer.train()
    assert list_checkpoints(out) == []


def test_sigterm_after_a_failed_background_write_still_commits_the_emergency_checkpoint(tiny_gpt, tokens, make_args,
                                                                                        tmp_path):
    """checkpoint-3's background write fails (disk full), then SIGTERM at step 4: the training state is
    fine, so the preemption still saves it (checkpoint-4, exit as preempted), instead of a crash that the
    launcher would count as a failure with the steps since the last checkpoint lost."""
    out = tmp_path / "out"
    watch = Watch(out, sigterm_at=4)
    trainer = Trainer(model=tiny_gpt(0), args=_args(make_args, output_dir=str(out), async_save=True),
                      train_dataset=tokens(), callbacks=[watch])
    stage, calls = trainer.strategy.stage_checkpoint, []

    def first_write_fails(directory):
        calls.append(directory)
        if len(calls) > 1:
            return stage(directory)

        def write():
            raise OSError(28, "No space left on device")
        return write
    trainer.strategy.stage_checkpoint = first_write_fails
    Held(trainer)
    with pytest.raises(TrainingPreempted) as info:
        trainer.train()
    assert info.value.step == 4 and info.value.checkpoint_dir == str(out / "checkpoint-4")
    assert [s for s, _ in list_checkpoints(out)] == [4]  # checkpoint-3 never committed
    assert (out / "checkpoint-4" / READY_MARKER).is_file()


def test_async_save_is_off_by_default(make_args):
    assert make_args().async_save is False


def test_the_progress_report_names_the_step_of_the_committed_folder(tmp_path):
    """An async save is reported when it lands (here at step 6): the progress file records checkpoint-3's step."""
    from kubetrain_trainer.progress import ProgressTracker, TrainProgressCallback, WorkerProgress
    from kubetrain_trainer.state import TrainerState

    path = tmp_path / "progress.json"
    callback = TrainProgressCallback(ProgressTracker(path))
    state = TrainerState(global_step=6, max_steps=12, is_local_process_zero=True)
    callback.on_save(None, state, None, checkpoint_dir=str(tmp_path / "checkpoint-3"))
    assert [step for step, _ in WorkerProgress.from_file(path.read_text()).saves] == [3]


def test_an_async_save_reports_its_whole_duration_for_the_grace_split(tmp_path):
    """The grace split gives the workers room for their slowest recent save: an async save must report the
    time from staging to commit (what the emergency checkpoint will need), not the ~0 s the loop was blocked."""
    from kubetrain_trainer.progress import ProgressTracker, TrainProgressCallback, WorkerProgress
    from kubetrain_trainer.state import TrainerState

    path = tmp_path / "progress.json"
    callback = TrainProgressCallback(ProgressTracker(path))
    state = TrainerState(global_step=6, max_steps=12, is_local_process_zero=True)
    callback.on_save(None, state, None, checkpoint_dir=str(tmp_path / "checkpoint-3"), save_seconds=21.5)
    assert list(WorkerProgress.from_file(path.read_text()).saves) == [(3, 21.5)]


def test_the_background_saver_times_a_save_from_staging_to_commit(tiny_gpt, tokens, make_args, tmp_path):
    out = tmp_path / "out"
    trainer = Trainer(model=tiny_gpt(0), args=_args(make_args, output_dir=str(out), async_save=True, max_steps=4),
                      train_dataset=tokens())
    stage = trainer.strategy.stage_checkpoint

    def slow_stage(directory):
        write = stage(directory)
        return lambda: (threading.Event().wait(0.3), write())
    trainer.strategy.stage_checkpoint = slow_stage
    seen = []
    trainer.add_callback(type("Seen", (TrainerCallback,), {
        "on_save": lambda self, args, state, control, save_seconds=None, **kw: seen.append(save_seconds)})())
    trainer.train()
    assert seen and seen[0] is not None and seen[0] >= 0.3, seen
