"""Each node restores only what its ranks load, against a real MinIO (`rank_files.py`).

Two nodes commit a checkpoint in the layout `strategies/dcp_files.RankFilesWriter` writes (each
rank's proper shards in a file of its own, a record naming them), then each node restores it
through `restore_agreed`. That a real FSDP run resumes bitwise from such a partial folder is
tests/slow/strategies/test_sharded_strategies.py.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kubetrain_trainer.commit import ClaimsFence, CommitProtocol, SyncSettings, UploadJob
from kubetrain_trainer.layout import RANK_FILES_NAME, corrupt_marker_name
from kubetrain_trainer.rank_files import NodeRanks, RankFiles
from kubetrain_trainer.restore import RestoreAgreementError, restore_agreed

from test_ckpt_storage_minio import _store

pytestmark = pytest.mark.integration

DCP = ("pytorch_model_fsdp_0", "optimizer_0")
SHARD = 6 << 20  # above the test store's 5 MiB multipart threshold: the private shards go in parts


def _node_folder(root: Path, node: int, step: int, *, world: int = 2) -> Path:
    """What node `node` (one rank, rank == node) holds locally after a save at `step`."""
    folder = root / f"node-{node}" / f"checkpoint-{step}"
    for sub in DCP:
        (folder / sub).mkdir(parents=True)
        (folder / sub / f"__{node}_0.distcp").write_bytes(os.urandom(SHARD))
        (folder / sub / f"__{node}_shared.distcp").write_bytes(os.urandom(3000))
        if node == 0:  # the coordinator writes the metadata and the record
            (folder / sub / ".metadata").write_bytes(os.urandom(2000))
            record = RankFiles(world_size=world, private={r: (f"__{r}_0.distcp",) for r in range(world)})
            (folder / sub / RANK_FILES_NAME).write_bytes(record.to_json())
    (folder / f"rng_state_{node}.pth").write_bytes(os.urandom(500))
    if node == 0:
        (folder / "trainer_state.json").write_text('{"global_step": %d}' % step)
    return folder


def _commit_two_nodes(env, root: Path, step: int, *, attempt: int = 1) -> list[Path]:
    folders = [_node_folder(root, node, step) for node in range(2)]
    errors: list[BaseException] = []

    def commit(node: int) -> None:
        try:
            store = _store(env)
            s = SyncSettings(attempt=attempt, incarnation=5, world_size=2, strategy="fsdp", node_rank=node,
                             nnodes=2, part_wait_s=120)
            CommitProtocol(store, s, fence=ClaimsFence(store, s), stopped=threading.Event(),
                           newer_waiting=lambda: False).run(UploadJob(step=step, folder=folders[node]))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=commit, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    return folders


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and p.name != "manifest.json"}


def _restore(store, root: Path, node: int, attempt: int):
    return restore_agreed(store, root / f"restore-{node}-a{attempt}", node_rank=node, incarnation=5,
                          attempt=attempt, deadline=time.monotonic() + 120,
                          node=NodeRanks.of(node_rank=node, nnodes=2, world_size=2))


def test_each_node_restores_its_own_shards_and_what_every_rank_loads(ckpt_env, minio, tmp_path: Path):
    store = _store(ckpt_env)
    written = [_files(f) for f in _commit_two_nodes(ckpt_env, tmp_path, 10)]
    everything = {**written[0], **written[1]}
    for node in range(2):
        restored = _restore(store, tmp_path, node, attempt=2)
        assert restored.committed.step == 10
        got = _files(restored.path)
        other = 1 - node
        left = {f"{sub}/__{other}_0.distcp" for sub in DCP}
        assert set(got) == set(everything) - left, sorted(set(everything) ^ set(got))
        assert all(got[name] == everything[name] for name in got), "every restored file is byte-exact"
        fetched = sum(map(len, got.values()))
        print(f"node {node}: {fetched} of {sum(map(len, everything.values()))} bytes")
        assert fetched < 0.6 * sum(map(len, everything.values()))


def test_other_world_size_restores_every_file(ckpt_env, minio, tmp_path: Path):
    store = _store(ckpt_env)
    written = [_files(f) for f in _commit_two_nodes(ckpt_env, tmp_path, 10)]
    restored = restore_agreed(store, tmp_path / "r", node_rank=0, incarnation=5, attempt=2,
                              deadline=time.monotonic() + 120,
                              node=NodeRanks.of(node_rank=0, nnodes=4, world_size=4))
    assert _files(restored.path) == {**written[0], **written[1]}


def test_a_corrupt_shard_only_its_node_reads_is_marked_and_the_next_attempt_falls_back(ckpt_env, minio,
                                                                                     tmp_path: Path):
    store = _store(ckpt_env)
    _commit_two_nodes(ckpt_env, tmp_path / "s10", 10)
    _commit_two_nodes(ckpt_env, tmp_path / "s20", 20)
    # Node 1's own shard of step 20 replaced in storage by other bytes of the same size: only node 1 reads it.
    key = store.location.key("checkpoint-20", "optimizer_0/__1_0.distcp")
    minio.client().put_object(Bucket=store.location.bucket, Key=key, Body=b"\0" * SHARD)

    assert _restore(store, tmp_path, 0, attempt=2).committed.step == 20
    with pytest.raises(RestoreAgreementError, match="checkpoint-20.*__1_0.distcp"):
        _restore(store, tmp_path, 1, attempt=2)
    listed = {c.step: c for c in store.list_checkpoints()}
    assert corrupt_marker_name(1, (5, 1)) in listed[20].listing and not listed[20].complete
    # The gang restarts: the next attempt's decision passes over step 20, and both nodes resume from 10.
    assert _restore(store, tmp_path, 0, attempt=3).committed.step == 10
    assert _restore(store, tmp_path, 1, attempt=3).committed.step == 10
    # Attempt 3 trains to step 20 again and commits it into the same folder: the mark named attempt 1's
    # commit, so the new one is complete and restored.
    _commit_two_nodes(ckpt_env, tmp_path / "again", 20, attempt=3)
    assert {c.step: c for c in store.list_checkpoints()}[20].complete
    assert _restore(store, tmp_path, 0, attempt=4).committed.step == 20
    assert _restore(store, tmp_path, 1, attempt=4).committed.step == 20


class _RemovedAfterVerify:
    """The real store, where checkpoint-20's manifest is gone by the time the node re-reads it."""

    def __init__(self, store) -> None:
        self._store, self.verified = store, False

    def download_checkpoint(self, *a, **kw):
        try:
            return self._store.download_checkpoint(*a, **kw)
        finally:
            self.verified = True

    def read_manifest(self, step):
        return None if self.verified and step == 20 else self._store.read_manifest(step)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_commit_that_changed_since_it_was_verified_is_not_marked(ckpt_env, minio, tmp_path: Path):
    store = _store(ckpt_env)
    _commit_two_nodes(ckpt_env, tmp_path / "s20", 20)
    key = store.location.key("checkpoint-20", "optimizer_0/__1_0.distcp")
    minio.client().put_object(Bucket=store.location.bucket, Key=key, Body=b"\0" * SHARD)
    assert _restore(store, tmp_path, 0, attempt=2).committed.step == 20
    with pytest.raises(RestoreAgreementError, match="__1_0.distcp"):
        _restore(_RemovedAfterVerify(store), tmp_path, 1, attempt=2)
    assert not any(name.startswith("corrupt.") for name in {c.step: c for c in store.list_checkpoints()}[20].listing)
