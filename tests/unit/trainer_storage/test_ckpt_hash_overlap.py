"""The digest pass runs beside the upload (`hashing.FolderHash`), not before it.

A checkpoint step with no manifest in storage needs no hash to decide its commit, so its files go out
while they are hashed; the manifest still carries every file's digest, and a step that is already
committed is still compared by hash before anything is written. The S3 boundary is the in-memory
store of test_ckpt_sync; the real store's uploads are covered against MinIO in tests/integration.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kubetrain_digest import xxh128_of
from kubetrain_trainer import hashing
from kubetrain_trainer.commit import ClaimsFence, CommitProtocol, SyncSettings, UploadJob
from kubetrain_trainer.hashing import FolderHash, scan_folder
from kubetrain_trainer.manifest import Manifest
from test_ckpt_sync import FAST, MemoryStore, _local_checkpoint


def _protocol(store: MemoryStore, attempt: int = 1) -> CommitProtocol:
    settings = SyncSettings(attempt=attempt, world_size=1, strategy="ddp", backoff=FAST)
    return CommitProtocol(store, settings, fence=ClaimsFence(store, settings), stopped=threading.Event(),
                          newer_waiting=lambda: False)


def _held_hashing(monkeypatch) -> tuple[threading.Event, list[str]]:
    """file_digest waits for `release`; the names it hashed are recorded."""
    release, hashed = threading.Event(), []
    real = hashing.file_digest

    def held(path: Path, **kw) -> str:
        assert release.wait(10), "the hash was never released"
        hashed.append(path.name)
        return real(path, **kw)

    monkeypatch.setattr(hashing, "file_digest", held)
    return release, hashed


def test_files_go_out_while_they_are_hashed_and_the_manifest_has_every_hash(tmp_path: Path, monkeypatch):
    folder = _local_checkpoint(tmp_path, 5)
    expected = {f.path: f.digest for f in scan_folder(folder)}
    store = MemoryStore()
    release, hashed = _held_hashing(monkeypatch)
    uploaded_before_hash = []
    real_upload = store.upload_file

    def upload_file(step, local, rel, *, still_allowed=None):
        uploaded_before_hash.append((rel, not hashed))
        real_upload(step, local, rel, still_allowed=still_allowed)
        if len(uploaded_before_hash) == len(expected):
            release.set()  # every file is out: now let the hashing finish

    store.upload_file = upload_file
    outcome = _protocol(store).run(UploadJob(step=5, folder=folder))
    assert outcome.action == "committed"
    assert uploaded_before_hash == [(rel, True) for rel in sorted(expected)]  # none waited for a hash
    manifest = Manifest.from_json(store.objects["checkpoint-5/manifest.json"])
    assert {f.path: f.digest for f in manifest.files} == expected
    assert store.writes[-1] == "checkpoint-5/manifest.json"
    for rel, digest in expected.items():
        assert xxh128_of(store.objects[f"checkpoint-5/{rel}"]) == digest


def test_a_step_already_committed_is_compared_by_hash_before_anything_is_written(tmp_path: Path):
    folder = _local_checkpoint(tmp_path, 3)
    store = MemoryStore()
    assert _protocol(store).run(UploadJob(step=3, folder=folder)).action == "committed"
    writes = len(store.writes)
    assert _protocol(store).run(UploadJob(step=3, folder=folder)).action == "already committed"
    assert len(store.writes) == writes  # same content: no byte written again

    (folder / "model.safetensors").write_bytes(b"other weights")  # another attempt, other bytes
    assert _protocol(store, attempt=2).run(UploadJob(step=3, folder=folder)).action == "committed"
    manifest = Manifest.from_json(store.objects["checkpoint-3/manifest.json"])
    assert manifest.attempt == 2
    assert {f.path: f.digest for f in manifest.files}["model.safetensors"] == \
        xxh128_of(b"other weights")
    assert "uncommit checkpoint-3" in store.writes[writes:]


def test_a_failed_hash_fails_the_try_and_the_next_try_hashes_again(tmp_path: Path, monkeypatch):
    folder = _local_checkpoint(tmp_path, 4)
    store = MemoryStore()
    real = hashing.file_digest
    calls = {"n": 0}

    def flaky(path: Path, **kw) -> str:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("read error on the staging disk")
        return real(path, **kw)

    monkeypatch.setattr(hashing, "file_digest", flaky)
    job = UploadJob(step=4, folder=folder)
    protocol = _protocol(store)
    with pytest.raises(OSError, match="read error"):
        protocol.run(job)
    assert "checkpoint-4/manifest.json" not in store.objects  # never committed without every hash
    assert job.uploaded  # the files that went out are not sent again
    writes = len(store.writes)
    assert protocol.run(job).action == "committed"
    assert store.writes[writes:] == ["checkpoint-4/manifest.json"]
    manifest = Manifest.from_json(store.objects["checkpoint-4/manifest.json"])
    assert {f.path: f.digest for f in manifest.files} == {f.path: f.digest for f in scan_folder(folder)}


def test_folder_hash_is_scan_folder_in_the_background(tmp_path: Path):
    folder = _local_checkpoint(tmp_path, 9, loss=0.5)
    background = FolderHash(folder)
    assert [f.path for f in background.files] == [f.path for f in scan_folder(folder)]
    assert background.result() == scan_folder(folder)
    assert not background.failed


def test_closing_the_uploader_stops_the_hash_and_the_files_not_yet_started(tmp_path: Path, monkeypatch):
    # A pod out of time: `close` gives up on the checkpoint. Nothing of it may keep the process busy (the
    # hash pool and the upload pool are joined at exit, past the grace period) and nothing is committed.
    from test_ckpt_sync import _uploader

    folder = _local_checkpoint(tmp_path / "out", 6)
    for i in range(6):
        (folder / f"extra-{i}.bin").write_bytes(b"x" * 1000)
    store = MemoryStore()

    def endless(path: Path, *, cancelled=None, **kw) -> str:  # a huge file: checks `cancelled` per chunk
        while not (cancelled is not None and cancelled.wait(0.01)):
            pass
        raise hashing.HashCancelled(f"hashing {path.name} stopped")

    monkeypatch.setattr(hashing, "file_digest", endless)
    first_upload, let_go = threading.Event(), threading.Event()
    real_upload = store.upload_file

    def slow_upload(step, local, rel, *, still_allowed=None):
        first_upload.set()
        assert let_go.wait(10)
        real_upload(step, local, rel, still_allowed=still_allowed)

    store.upload_file = slow_upload
    up = _uploader(tmp_path, store)
    assert up.submit(folder, 6)
    assert first_upload.wait(10)
    threading.Timer(0.3, let_go.set).start()  # the file in flight goes on after close has given up
    assert not up.close(0.1)
    assert up._thread.join(5) is None and not up._thread.is_alive()
    hashers = [t for t in threading.enumerate() if t.name.startswith(("digest", "s3-files"))]
    for t in hashers:
        t.join(5)
    assert not any(t.is_alive() for t in hashers), "a hash or upload thread outlived close"
    assert "checkpoint-6/manifest.json" not in store.objects
    # Nothing stored: the file in flight was cut at its progress callback too (a preempted pod exits in
    # its grace period, not when its largest file is out), and no other file started.
    assert [k for k in store.objects if k.startswith("checkpoint-6/")] == []


def test_a_bug_in_retention_does_not_make_a_committed_checkpoint_look_failed(tmp_path: Path, caplog):
    from kubetrain_trainer.decisions import RetentionPolicy
    from test_ckpt_sync import _uploader

    store = MemoryStore()

    def buggy_delete(step):
        raise TypeError("delete_checkpoint() got an unexpected keyword")

    store.delete_checkpoint = buggy_delete
    committed = []
    up = _uploader(tmp_path, store, retention=RetentionPolicy(save_total_limit=1))
    up.on_commit = committed.append
    for step in (1, 2):
        up.submit(_local_checkpoint(tmp_path / "out", step), step)
        assert up.wait(10)
    assert up.close(10)
    assert [c.step for c in committed] == [1, 2]  # each reported once: no retry of a committed step
    assert up.last_error is None and "in sync" in up.status_line()
    assert "remote retention failed on an unexpected error" in caplog.text


def test_a_node_part_waits_for_its_hashes_and_the_manifest_has_both_nodes_files(tmp_path: Path, monkeypatch):
    """Two nodes: node 1's files go out while its hash is held, but its part (what node rank 0 builds
    the manifest from) is written only once every one of its files is hashed, with those hashes."""
    store = MemoryStore()
    folders = {}
    for rank in (0, 1):
        folder = tmp_path / f"o{rank}" / "checkpoint-6"
        folder.mkdir(parents=True)
        (folder / f"rng_state_{rank}.pth").write_bytes(b"rank %d" % rank)
        (folder / f"shard_{rank}.distcp").write_bytes(bytes([rank]) * 5000)
        folders[rank] = folder
    expected = {name: xxh128_of((folders[r] / name).read_bytes())
                for r in (0, 1) for name in (f"rng_state_{r}.pth", f"shard_{r}.distcp")}

    def protocol(rank: int) -> CommitProtocol:
        settings = SyncSettings(attempt=1, world_size=2, strategy="fsdp", node_rank=rank, nnodes=2, backoff=FAST,
                                part_wait_s=10)
        return CommitProtocol(store, settings, fence=ClaimsFence(store, settings), stopped=threading.Event(),
                              newer_waiting=lambda: False)

    release, _ = _held_hashing(monkeypatch)
    outcome: dict[int, str] = {}
    node1 = threading.Thread(target=lambda: outcome.__setitem__(1, protocol(1).run(
        UploadJob(step=6, folder=folders[1])).action))
    node1.start()
    for _ in range(500):  # both of node 1's files in storage, their hashes still held
        if {"checkpoint-6/rng_state_1.pth", "checkpoint-6/shard_1.distcp"} <= store.objects.keys():
            break
        threading.Event().wait(0.01)
    else:
        pytest.fail("node 1's files did not go out while their hashes were held")
    threading.Event().wait(0.2)
    assert not any(".node-" in key for key in store.objects), "a node part was written before its hashes"
    release.set()
    node1.join(10)
    assert outcome[1] == "part uploaded"
    assert protocol(0).run(UploadJob(step=6, folder=folders[0])).action == "committed"
    manifest = Manifest.from_json(store.objects["checkpoint-6/manifest.json"])
    assert {f.path: f.digest for f in manifest.files} == expected
