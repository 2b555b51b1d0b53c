"""When an in-place checkpoint folder is complete (readiness.py), and that the watcher never commits a partial one.

The rule is a pure function, table-tested here; the watcher around it runs
against real folders with an injected clock (no sleeping, no timing), feeding
the real uploader and an in-memory S3 (tests/unit/trainer_storage/test_ckpt_sync.py's MemoryStore).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kubetrain_trainer.hashing import scan_folder
from kubetrain_trainer.manifest import Manifest
from kubetrain_trainer.readiness import (
    FolderView,
    WriterView,
    decide_commit,
    is_hf_shaped,
    mark_ready,
    markers_complete,
    rank_marker_name,
)
from kubetrain_trainer.commit import SyncSettings
from kubetrain_trainer.sync import CheckpointUploader
from kubetrain_trainer.watcher import FolderWatcher, WatchLoop

from test_ckpt_sync import FAST, MemoryStore

SETTLE = 30.0


def _folder(*, ready=False, hf=False, state=False, quiet=0.0) -> FolderView:
    return FolderView(ready=ready, hf_shaped=hf, has_trainer_state=state, quiet_s=quiet)


def _writer(state="running", *, markers=False, rank0=True) -> WriterView:
    return WriterView(uses_markers=markers, expects_trainer_state=rank0, state=state)


@pytest.mark.parametrize(
    "folder, writer, action",
    [
        # 1. a ready marker is exact: at once, whatever else holds
        (_folder(ready=True), _writer(), "commit"),
        (_folder(ready=True, hf=True), _writer(markers=True), "commit"),
        (_folder(ready=True), _writer("died"), "commit"),
        # 2. a writer that marks is never second-guessed by heuristics
        (_folder(quiet=1e6), _writer(markers=True), "wait"),
        (_folder(quiet=1e6), _writer("finished", markers=True), "never"),
        (_folder(quiet=1e6), _writer("died", markers=True), "never"),
        # 3. HF-shaped on node rank 0: trainer_state.json (written last) first
        (_folder(hf=True, quiet=1e6), _writer(), "wait"),
        (_folder(hf=True, quiet=1e6), _writer("died"), "never"),
        (_folder(hf=True, quiet=1e6), _writer("finished"), "never"),
        (_folder(hf=True, state=True, quiet=SETTLE - 1), _writer(), "wait"),  # trainer_state.json may be half written
        (_folder(hf=True, state=True, quiet=SETTLE), _writer(), "commit"),
        (_folder(hf=True, quiet=SETTLE), _writer(rank0=False), "commit"),  # other nodes never write trainer_state.json
        # 4. workers that exited on their own terms wrote everything
        (_folder(quiet=0.0), _writer("finished"), "commit"),
        # 5. otherwise: quiet for the settle period while the writer ran
        (_folder(quiet=SETTLE - 0.5), _writer(), "wait"),
        (_folder(quiet=SETTLE), _writer(), "commit"),
        (_folder(quiet=SETTLE), _writer("died"), "commit"),
        (_folder(quiet=SETTLE - 0.5), _writer("died"), "never"),  # it may have died mid-save
    ],
)
def test_decide_commit(folder, writer, action):
    decision = decide_commit(folder, writer, settle_s=SETTLE)
    assert decision.action == action, decision.reason


@pytest.mark.parametrize(
    "names, complete",
    [
        ({".kubetrain-ready"}, True),
        ({rank_marker_name(0, 1)}, True),
        ({rank_marker_name(0, 2)}, False),
        ({rank_marker_name(0, 2), rank_marker_name(1, 2)}, True),
        ({rank_marker_name(1, 2), rank_marker_name(2, 2)}, False),
        ({"model.safetensors", ".kubetrain-ready.tmp-12"}, False),
        (set(), False),
    ],
)
def test_markers_complete(names, complete):
    assert markers_complete(names) is complete


def test_hf_shape_is_recognised_by_the_hf_trainers_own_files():
    assert is_hf_shaped({"model.safetensors", "training_args.bin"})
    assert is_hf_shaped({"rng_state_3.pth"})
    assert not is_hf_shaped({"model.pt", "optimizer.pt", "scheduler.pt"})  # any torch.save loop's names
    assert not is_hf_shaped({"model.safetensors", "config.json"})  # a plain save_pretrained folder
    assert not is_hf_shaped({"__0_0.distcp", ".metadata"})  # torch DCP


def test_markers_are_never_part_of_the_checkpoint(tmp_path: Path):
    (tmp_path / "model.pt").write_bytes(b"m")
    mark_ready(tmp_path)
    mark_ready(tmp_path, local_rank=0, local_world_size=1)
    assert [f.path for f in scan_folder(tmp_path)] == ["model.pt"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _sync(tmp_path: Path, **watch_kw):
    store, clock = MemoryStore(), Clock()
    settings = SyncSettings(attempt=1, world_size=1, strategy="ddp", backoff=FAST, status_interval_s=0.01)
    uploader = CheckpointUploader(store, settings, staging_dir=tmp_path / "staging").start()
    out = tmp_path / "out"
    out.mkdir()
    watcher = FolderWatcher(out, settle_s=SETTLE, clock=clock, **watch_kw)
    return store, clock, uploader, WatchLoop(watcher, uploader), out


def _manifests(store: MemoryStore) -> list[Manifest]:
    return [Manifest.from_json(store.objects[k]) for k in store.writes if k.endswith("/manifest.json")]


def test_a_folder_written_slowly_in_place_is_committed_only_once_complete(tmp_path: Path):
    """A torch.save-style loop: files appear one by one, pauses shorter than the settle period between them."""
    store, clock, uploader, watch, out = _sync(tmp_path)
    folder = out / "checkpoint-10"
    folder.mkdir()
    names = ["model.pt", "optimizer.pt", "extra_state.pt", "data_position.json"]
    for name in names:
        (folder / name).write_bytes(b"x" * 1000)
        for _ in range(3):  # the writer works on the next file for a while
            clock.now += SETTLE / 4
            watch.scan_once()
    assert uploader.wait(10) and _manifests(store) == []  # never while the writer might still add files
    clock.now += SETTLE
    watch.scan_once()
    assert uploader.close(10)
    manifests = _manifests(store)
    assert len(manifests) == 1 and [f.path for f in manifests[0].files] == sorted(names)


def test_a_file_still_growing_keeps_the_folder_uncommitted(tmp_path: Path):
    store, clock, uploader, watch, out = _sync(tmp_path)
    folder = out / "checkpoint-3"
    folder.mkdir()
    with open(folder / "model.pt", "wb") as fh:
        for _ in range(8):  # one big file, written in chunks slower than the settle period in total
            fh.write(b"w" * 4096)
            fh.flush()
            clock.now += SETTLE / 2
            watch.scan_once()
    assert uploader.wait(10) and _manifests(store) == []
    clock.now += SETTLE
    watch.scan_once()
    assert uploader.close(10)
    assert [(f.path, f.size) for f in _manifests(store)[0].files] == [("model.pt", 8 * 4096)]


def test_a_writer_killed_mid_save_leaves_a_folder_that_is_never_committed(tmp_path: Path):
    store, clock, uploader, watch, out = _sync(tmp_path)
    done = out / "checkpoint-1"
    done.mkdir()
    (done / "model.pt").write_bytes(b"a")
    watch.scan_once()
    clock.now += SETTLE
    watch.scan_once()  # checkpoint-1: quiet for the settle period, committed
    partial = out / "checkpoint-2"
    partial.mkdir()
    (partial / "model.pt").write_bytes(b"b")
    clock.now += 1
    watch.scan_once()
    watch.writers_exited(clean=False)  # SIGKILL: the rest of checkpoint-2 never comes
    clock.now += 10 * SETTLE
    watch.scan_once()  # the launcher's last scan once the workers are gone
    assert uploader.close(10)
    assert [m.step for m in _manifests(store)] == [1]


def test_hf_shaped_folder_waits_for_trainer_state_and_a_marking_writer_for_its_markers(tmp_path: Path):
    store, clock, uploader, watch, out = _sync(tmp_path)
    hf = out / "checkpoint-5"
    hf.mkdir()
    for name in ("model.safetensors", "config.json", "training_args.bin", "optimizer.pt", "scheduler.pt",
                 "rng_state.pth"):
        (hf / name).write_bytes(b"h")
    clock.now += 10 * SETTLE  # quiet, e.g. a slow trainer_state.json computation: still not complete
    watch.scan_once()
    assert uploader.wait(10) and _manifests(store) == []
    (hf / "trainer_state.json").write_text("{}")
    watch.scan_once()
    clock.now += SETTLE
    watch.scan_once()
    assert uploader.wait(10) and [m.step for m in _manifests(store)] == [5]

    # The HF callback's markers: exact, at once, and from then on required (two local processes here).
    marked = out / "checkpoint-6"
    marked.mkdir()
    (marked / "model.safetensors").write_bytes(b"6")
    mark_ready(marked, local_rank=0, local_world_size=2)
    watch.scan_once()
    clock.now += 10 * SETTLE
    watch.scan_once()
    assert uploader.wait(10) and [m.step for m in _manifests(store)] == [5]  # rank 1 has not marked yet
    (marked / "rng_state_1.pth").write_bytes(b"r1")
    mark_ready(marked, local_rank=1, local_world_size=2)
    watch.scan_once()
    assert uploader.wait(10) and [m.step for m in _manifests(store)] == [5, 6]
    assert {f.path for f in _manifests(store)[1].files} == {"model.safetensors", "rng_state_1.pth"}

    unmarked = out / "checkpoint-7"  # the same writer, killed before its markers
    unmarked.mkdir()
    (unmarked / "model.safetensors").write_bytes(b"7")
    (unmarked / "trainer_state.json").write_text("{}")
    clock.now += 10 * SETTLE
    watch.scan_once()
    watch.writers_exited(clean=True)
    watch.scan_once()  # the launcher's last scan once the workers are gone
    assert uploader.close(10)
    assert [m.step for m in _manifests(store)] == [5, 6]


def test_marker_mode_commits_only_marked_folders_from_the_first(tmp_path: Path):
    store, clock, uploader, watch, out = _sync(tmp_path, mode="marker")
    first = out / "checkpoint-1"
    first.mkdir()
    (first / "model.pt").write_bytes(b"1")
    clock.now += 10 * SETTLE
    watch.scan_once()
    assert uploader.wait(10) and _manifests(store) == []
    mark_ready(first)
    watch.scan_once()
    assert uploader.close(10)
    assert [m.step for m in _manifests(store)] == [1]


def test_a_writer_s_own_manifest_json_does_not_pass_for_a_restored_folder(tmp_path: Path, caplog):
    """Only a kubetrain manifest of the folder's step says "restored from storage, committed already"; a
    writer's own index of that name (reserved at a checkpoint's top level) is left out, and the rest goes up."""
    store, clock, uploader, watch, out = _sync(tmp_path, mode="marker")
    folder = out / "checkpoint-20"
    folder.mkdir()
    (folder / "model.pt").write_bytes(b"20")
    (folder / "manifest.json").write_text('{"shards": ["model.pt"]}')
    mark_ready(folder)
    watch.scan_once()
    assert uploader.close(10)
    assert [(m.step, [f.path for f in m.files]) for m in _manifests(store)] == [(20, ["model.pt"])]
    assert any("manifest.json" in r.getMessage() and "reserved" in r.getMessage() for r in caplog.records)
