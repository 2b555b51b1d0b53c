"""The uploader's ordering, fencing, retry and retention logic, with the S3 boundary faked in memory.

The real S3 behaviour of the same code is covered against MinIO in
tests/integration/trainer_storage; here the store is a dict so that the
order of writes (manifest LAST) and the failure paths can be asserted exactly.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ParamValidationError

from kubetrain_trainer.decisions import RemoteCheckpoint, RetentionPolicy
from kubetrain_trainer.layout import MANIFEST_NAME, node_part_name
from kubetrain_trainer.manifest import Manifest
from kubetrain_trainer.retry import Backoff, retrying
from kubetrain_trainer.storage_errors import StorageAccessError, StoragePermanentError, StorageTemporaryError, classify
from kubetrain_trainer.readiness import mark_ready
from kubetrain_trainer.commit import SyncSettings
from kubetrain_trainer.sync import CheckpointUploader
from kubetrain_trainer.watcher import FolderWatcher

FAST = Backoff(initial_s=0.01, maximum_s=0.05)


class MemoryStore:
    """Just enough of CheckpointStore: objects in a dict, every write logged, failures injectable."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.writes: list[str] = []
        self.fail_next = 0
        self.lock = threading.Lock()

    def _maybe_fail(self) -> None:
        with self.lock:
            if self.fail_next > 0:
                self.fail_next -= 1
                raise StorageTemporaryError("connect to 127.0.0.1:1 refused")

    def checkpoint_uri(self, step: int) -> str:
        return f"s3://b/p/checkpoint-{step}"

    def list_checkpoints(self) -> list[RemoteCheckpoint]:
        self._maybe_fail()
        steps: dict[int, dict[str, int]] = {}
        for key, data in self.objects.items():
            folder, rel = key.split("/", 1)
            if folder == "attempts":
                continue
            steps.setdefault(int(folder.split("-")[1]), {})[rel] = len(data)
        out = []
        for step, listing in sorted(steps.items()):
            raw = self.objects.get(f"checkpoint-{step}/{MANIFEST_NAME}")
            out.append(RemoteCheckpoint(step, Manifest.from_json(raw) if raw else None, listing))
        return out

    def _put(self, key: str, data: bytes) -> None:
        self._maybe_fail()
        self.objects[key] = data
        self.writes.append(key)

    def upload_file(self, step: int, local: Path, rel: str, *, still_allowed=None) -> None:
        data = local.read_bytes()
        if still_allowed is not None:  # as a transfer's progress callback would, before the object exists
            still_allowed()
        self._put(f"checkpoint-{step}/{rel}", data)

    def each_upload(self, items, fn) -> None:
        """One file after another (as `upload_file_concurrency=1`), so the write order is deterministic."""
        for item in items:
            fn(item)

    def commit(self, manifest: Manifest) -> None:
        self._put(f"checkpoint-{manifest.step}/{MANIFEST_NAME}", manifest.to_json())

    def write_node_part(self, part) -> None:
        self._put(f"checkpoint-{part.step}/{node_part_name(part.node_rank)}", part.to_json())

    def read_node_parts(self, step: int):
        from kubetrain_trainer.manifest import NodePart

        return [NodePart.from_json(v) for k, v in self.objects.items()
                if k.startswith(f"checkpoint-{step}/manifest.node-")]

    def uncommit(self, step: int) -> None:
        self._maybe_fail()
        self.objects.pop(f"checkpoint-{step}/{MANIFEST_NAME}", None)
        self.writes.append(f"uncommit checkpoint-{step}")

    def delete_checkpoint(self, step: int) -> None:
        self.uncommit(step)
        for k in [k for k in self.objects if k.startswith(f"checkpoint-{step}/")]:
            del self.objects[k]

    def list_multipart_uploads(self):
        self._maybe_fail()
        return []

    def write_claim(self, claim) -> None:
        self._put(f"attempts/{claim.name}", claim.to_json())

    def read_claim(self, incarnation: int, attempt: int):
        from kubetrain_trainer.manifest import AttemptClaim
        raw = self.objects.get(f"attempts/{incarnation}-{attempt}.json")
        return AttemptClaim.from_json(raw) if raw else None

    def list_claims(self):
        from kubetrain_trainer.layout import parse_claim_name
        self._maybe_fail()
        return [w for k in self.objects if k.startswith("attempts/") and (w := parse_claim_name(k[9:]))]

    def abort_multipart_upload(self, upload) -> None:
        raise AssertionError("nothing to abort in memory")


def _local_checkpoint(root: Path, step: int, *, loss: float | None = None) -> Path:
    folder = root / f"checkpoint-{step}"
    (folder / "shards").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * (step + 10))
    (folder / "shards" / "rank0.pt").write_bytes(b"s%d" % step)
    if loss is not None:
        (folder / "trainer_state.json").write_text(
            '{"log_history": [{"step": %d, "eval_loss": %s}]}' % (step, loss))
    return folder


def _uploader(tmp_path: Path, store: MemoryStore, **kw) -> CheckpointUploader:
    settings = SyncSettings(attempt=kw.pop("attempt", 1), world_size=2, strategy="ddp", backoff=FAST,
                            status_interval_s=0.01, **kw)
    return CheckpointUploader(store, settings, staging_dir=tmp_path / "staging").start()


def test_files_first_manifest_last_and_content_exact(tmp_path: Path):
    store = MemoryStore()
    committed = []
    up = _uploader(tmp_path, store)
    up.on_commit = committed.append
    src = _local_checkpoint(tmp_path / "out", 5)
    assert up.submit(src, 5)
    assert up.close(10)
    assert store.writes[-1] == "checkpoint-5/manifest.json"
    assert set(store.writes[:-1]) == {"checkpoint-5/model.safetensors", "checkpoint-5/shards/rank0.pt"}
    assert store.objects["checkpoint-5/shards/rank0.pt"] == b"s5"
    m = Manifest.from_json(store.objects["checkpoint-5/manifest.json"])
    assert (m.step, m.attempt, m.world_size) == (5, 1, 2)
    assert [c.step for c in committed] == [5] and committed[0].uri.endswith("checkpoint-5")
    assert not list((tmp_path / "staging").iterdir()), "snapshot not cleaned up"


def test_snapshot_survives_the_trainer_rotating_the_folder_away(tmp_path: Path):
    store = MemoryStore()
    store.fail_next = 3  # keep the upload busy while the local folder disappears
    up = _uploader(tmp_path, store)
    src = _local_checkpoint(tmp_path / "out", 7)
    up.submit(src, 7)
    import shutil

    shutil.rmtree(src)
    assert up.close(10)
    assert store.objects["checkpoint-7/model.safetensors"] == b"w" * 17


def test_outage_retries_reports_lagging_then_catches_up(tmp_path: Path, caplog):
    store = MemoryStore()
    store.fail_next = 10**9
    up = _uploader(tmp_path, store)
    up.submit(_local_checkpoint(tmp_path / "out", 1), 1)
    deadline = time.monotonic() + 10
    while not up.lagging:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "lagging" in up.status_line() and "refused" in up.status_line()
    assert not up.wait(0.2)
    store.fail_next = 0
    assert up.close(10)
    assert "checkpoint-1/manifest.json" in store.objects
    assert "in sync" in up.status_line()


def test_older_waiting_snapshots_are_superseded(tmp_path: Path):
    store = MemoryStore()
    store.fail_next = 10**9
    up = _uploader(tmp_path, store, max_queued=1)
    for step in (1, 2, 3, 4):
        up.submit(_local_checkpoint(tmp_path / "out", step), step)
    store.fail_next = 0
    assert up.close(10)
    committed = sorted(c.step for c in store.list_checkpoints() if c.complete)
    assert committed[-1] == 4 and len(committed) < 4
    assert up.dropped


def test_a_lower_attempt_never_overwrites_nor_runs_beside_a_higher_one(tmp_path: Path):
    store = MemoryStore()
    newer = _uploader(tmp_path / "a2", store, attempt=2)
    newer.submit(_local_checkpoint(tmp_path / "out2", 10), 10)
    assert newer.close(10)
    before = dict(store.objects)
    zombie = _uploader(tmp_path / "a1", store, attempt=1)  # started before attempt 2 committed
    zombie.submit(_local_checkpoint(tmp_path / "out1", 10), 10)
    zombie.submit(_local_checkpoint(tmp_path / "out1", 20), 20)
    zombie.close(10)
    assert store.objects == before
    assert zombie.fenced and "attempt 2" in zombie.fenced
    assert not zombie.submit(tmp_path / "out1" / "checkpoint-20", 20)


def test_a_job_re_created_under_the_same_name_is_never_fenced_by_the_old_jobs_late_commit(tmp_path: Path):
    """The old job's pods commit an emergency checkpoint after the new job (a newer incarnation,
    attempt 1) started: the new job goes on committing; the old writer is fenced from then on."""
    store = MemoryStore()
    old = _uploader(tmp_path / "old", store, attempt=5, incarnation=100)  # the deleted job's attempt 5
    new = _uploader(tmp_path / "new", store, attempt=1, incarnation=200)  # its successor, started meanwhile
    old.submit(_local_checkpoint(tmp_path / "o", 30), 30)  # the old pods' emergency commit lands late
    assert old.wait(10)
    assert Manifest.from_json(store.objects["checkpoint-30/manifest.json"]).writer == (100, 5)
    new.submit(_local_checkpoint(tmp_path / "n", 10), 10)
    assert new.wait(10)
    new.submit(_local_checkpoint(tmp_path / "n", 40), 40)
    assert new.close(10) and not new.fenced, new.fenced
    assert Manifest.from_json(store.objects["checkpoint-40/manifest.json"]).writer == (200, 1)
    before = dict(store.objects)
    old.submit(_local_checkpoint(tmp_path / "o", 50), 50)
    old.close(10)
    assert old.fenced and "newer incarnation" in old.fenced
    assert store.objects == before


def test_a_zombie_attempt_never_deletes_through_retention(tmp_path: Path):
    """Attempt 1 keeps running after attempt 2 started (its node was force-deleted): its retention
    must not delete the checkpoint attempt 2 restores from, nor what attempt 2 committed."""
    store = MemoryStore()
    keep_one = RetentionPolicy(save_total_limit=1)
    zombie = _uploader(tmp_path / "a1", store, attempt=1, retention=keep_one)
    zombie.submit(_local_checkpoint(tmp_path / "z", 10), 10)
    assert zombie.wait(10)
    newer = _uploader(tmp_path / "a2", store, attempt=2, retention=keep_one,
                      history=frozenset({(10, 0, 1)}))  # attempt 2 restored checkpoint-10
    newer.submit(_local_checkpoint(tmp_path / "n", 20), 20)
    assert newer.wait(10)
    assert sorted(c.step for c in store.list_checkpoints() if c.complete) == [20]
    deletes_before = [w for w in store.writes if w.startswith("uncommit")]
    zombie.submit(_local_checkpoint(tmp_path / "z", 30), 30)
    zombie.close(10)
    assert zombie.fenced
    assert [w for w in store.writes if w.startswith("uncommit")] == deletes_before
    assert sorted(c.step for c in store.list_checkpoints() if c.complete) == [20]


def test_retention_skips_a_newer_writers_checkpoints_and_the_newest(tmp_path: Path):
    store = MemoryStore()
    old_job = _uploader(tmp_path / "o", store, attempt=3, incarnation=100, retention=RetentionPolicy(save_total_limit=1))
    new_job = _uploader(tmp_path / "n", store, attempt=1, incarnation=200, retention=RetentionPolicy(save_total_limit=1))
    new_job.submit(_local_checkpoint(tmp_path / "nn", 10), 10)
    assert new_job.wait(10)
    # The old job's writer was started before the new one committed, with that commit not in its history:
    # it is fenced, so its retention (keep 1) leaves the new job's checkpoint-10 alone.
    old_job.submit(_local_checkpoint(tmp_path / "oo", 5), 5)
    old_job.close(10)
    assert 10 in {c.step for c in store.list_checkpoints() if c.complete}


def test_a_claim_already_there_at_start_is_history_a_new_one_fences(tmp_path: Path):
    from kubetrain_trainer.manifest import AttemptClaim
    store = MemoryStore()
    store.write_claim(AttemptClaim(incarnation=0, attempt=7))  # e.g. a job whose clock ran ahead
    up = _uploader(tmp_path, store, attempt=1, claims_at_start=frozenset({(0, 7)}))
    up.submit(_local_checkpoint(tmp_path / "a", 10), 10)
    assert up.wait(10) and not up.fenced, up.fenced
    store.write_claim(AttemptClaim(incarnation=0, attempt=2))  # a newer attempt started after us
    up.submit(_local_checkpoint(tmp_path / "a", 20), 20)
    up.close(10)
    assert up.fenced and "attempt 2 > 1 has started" in up.fenced


def test_a_newer_attempt_replaces_an_older_commit_at_the_same_step_uncommitting_first(tmp_path: Path):
    store = MemoryStore()
    old = _uploader(tmp_path / "a1", store, attempt=1)
    old.submit(_local_checkpoint(tmp_path / "out1", 10), 10)
    assert old.close(10)
    new = _uploader(tmp_path / "a2", store, attempt=2, history=frozenset({(10, 0, 1)}))
    src = _local_checkpoint(tmp_path / "out2", 10)
    (src / "model.safetensors").write_bytes(b"different")
    new.submit(src, 10)
    assert new.close(10)
    writes = store.writes[store.writes.index("uncommit checkpoint-10"):]
    assert writes[-1] == "checkpoint-10/manifest.json" and len(writes) > 2
    assert Manifest.from_json(store.objects["checkpoint-10/manifest.json"]).attempt == 2
    assert store.objects["checkpoint-10/model.safetensors"] == b"different"


def test_retention_after_commit_keeps_best_and_newest(tmp_path: Path):
    store = MemoryStore()
    up = _uploader(tmp_path, store, retention=RetentionPolicy(save_total_limit=1, metric_for_best_model="loss"))
    for step, loss in ((1, 0.9), (2, 0.1), (3, 0.5), (4, 0.7)):
        up.submit(_local_checkpoint(tmp_path / "out", step, loss=loss), step)
        assert up.wait(10)
    assert up.close(10)
    assert sorted(c.step for c in store.list_checkpoints()) == [2, 4]


def test_multi_node_commit_waits_for_every_nodes_part(tmp_path: Path):
    store = MemoryStore()
    node0 = _uploader(tmp_path / "n0", store, nnodes=2, node_rank=0, part_wait_s=10)
    node1 = _uploader(tmp_path / "n1", store, nnodes=2, node_rank=1)
    a = tmp_path / "o0" / "checkpoint-3"
    a.mkdir(parents=True)
    (a / "rng_state_0.pth").write_bytes(b"0")
    b = tmp_path / "o1" / "checkpoint-3"
    b.mkdir(parents=True)
    (b / "rng_state_1.pth").write_bytes(b"1")
    node0.submit(a, 3)
    time.sleep(0.3)
    assert "checkpoint-3/manifest.json" not in store.objects  # node 1's part is not there yet
    node1.submit(b, 3)
    assert node1.close(10) and node0.close(10)
    m = Manifest.from_json(store.objects["checkpoint-3/manifest.json"])
    assert [f.path for f in m.files] == ["rng_state_0.pth", "rng_state_1.pth"]


def _every_node_writes(tmp_path: Path) -> list[Path]:
    folders = []
    for rank in (0, 1):
        f = tmp_path / f"o{rank}" / "checkpoint-3"
        f.mkdir(parents=True)
        (f / "model.safetensors").write_bytes(b"w" * 64)
        (f / f"rng_state_{rank}.pth").write_bytes(b"%d" % rank)
        (f / "trainer_state.json").write_text('{"is_world_process_zero": %s}' % ("true" if rank == 0 else "false"))
        folders.append(f)
    return folders


def test_save_on_each_node_commits_node_zeros_copy_of_a_file_every_node_wrote(tmp_path: Path):
    """HF `save_on_each_node=True`: every node writes the whole folder, and trainer_state.json differs by node
    (`is_world_process_zero`). Node 1 uploads its copy after node 0's; the commit must still hold node 0's
    bytes under node 0's digest (it refused such a checkpoint, so the job never had one to resume)."""
    from kubetrain_trainer.hashing import file_digest

    store = MemoryStore()
    node0 = _uploader(tmp_path / "n0", store, nnodes=2, node_rank=0, part_wait_s=10)
    node1 = _uploader(tmp_path / "n1", store, nnodes=2, node_rank=1)
    folders = _every_node_writes(tmp_path)
    node0.submit(folders[0], 3)
    deadline = time.monotonic() + 10
    while "checkpoint-3/manifest.node-0.json" not in store.objects:
        assert time.monotonic() < deadline, store.writes
        time.sleep(0.01)
    node1.submit(folders[1], 3)  # its trainer_state.json lands after node 0's
    assert node1.close(10) and node0.close(10)
    m = Manifest.from_json(store.objects["checkpoint-3/manifest.json"])
    assert [f.path for f in m.files] == ["model.safetensors", "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"]
    ours = folders[0] / "trainer_state.json"
    assert store.objects["checkpoint-3/trainer_state.json"] == ours.read_bytes()
    assert {f.path: f.digest for f in m.files}["trainer_state.json"] == file_digest(ours)
    assert store.writes.index("checkpoint-3/trainer_state.json", store.writes.index(
        "checkpoint-3/manifest.node-1.json")) < store.writes.index("checkpoint-3/manifest.json")


class BeforeManifest(MemoryStore):
    """Runs `hook` once when node rank 0 is about to write manifest.json (after its rewrites)."""

    hook = None

    def commit(self, manifest: Manifest) -> None:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        super().commit(manifest)


def test_a_node_saving_the_same_step_again_never_overwrites_node_zeros_copy(tmp_path: Path):
    # Node 1 hands the same step over again (the folder saved again) while node 0 is between its rewrite and
    # the manifest, then once more after the commit: its part is there with these files, so it uploads nothing
    # (its trainer_state.json over node 0's would fail every restore's digest check), and never uncommits.
    from kubetrain_trainer.hashing import file_digest

    store = BeforeManifest()
    node0 = _uploader(tmp_path / "n0", store, nnodes=2, node_rank=0, part_wait_s=10)
    node1 = _uploader(tmp_path / "n1", store, nnodes=2, node_rank=1)
    folders = _every_node_writes(tmp_path)

    during: list = []  # what node 1 wrote meanwhile (the hook runs on node 0's uploader thread)

    def node1_again() -> None:
        before = len(store.writes)
        assert node1.submit(folders[1], 3) and node1.wait(10)
        during.append(store.writes[before:])

    store.hook = node1_again
    node1.submit(folders[1], 3)
    deadline = time.monotonic() + 10
    while "checkpoint-3/manifest.node-1.json" not in store.objects:
        assert time.monotonic() < deadline, store.writes
        time.sleep(0.01)
    node0.submit(folders[0], 3)
    assert node0.close(10)
    before = len(store.writes)
    assert node1.submit(folders[1], 3)  # after the commit: a retry, or a late re-save
    assert node1.close(10)
    assert during == [[]] and store.writes[before:] == [], (during, store.writes[before:])
    m = Manifest.from_json(store.objects["checkpoint-3/manifest.json"])
    ours = folders[0] / "trainer_state.json"
    assert {f.path: f.digest for f in m.files}["trainer_state.json"] == file_digest(ours)
    assert store.objects["checkpoint-3/trainer_state.json"] == ours.read_bytes()


def _committed_on_two_nodes(tmp_path: Path):
    store = MemoryStore()
    node0 = _uploader(tmp_path / "n0", store, nnodes=2, node_rank=0, part_wait_s=10)
    node1 = _uploader(tmp_path / "n1", store, nnodes=2, node_rank=1)
    folders = _every_node_writes(tmp_path)
    assert node1.submit(folders[1], 3) and node1.wait(10)
    assert node0.submit(folders[0], 3) and node0.wait(10)
    assert "checkpoint-3/manifest.json" in store.objects
    return store, node0, node1, folders


def test_a_node_saving_a_committed_step_again_with_other_bytes_leaves_the_commit_alone(tmp_path: Path):
    # An emergency save right after a regular one, at the same step: the committed step holds that state.
    # Node 1 once uncommitted node 0's manifest and overwrote its copies, leaving the step torn.
    store, node0, node1, folders = _committed_on_two_nodes(tmp_path)
    (folders[1] / "rng_state_1.pth").write_bytes(b"saved again")
    before = len(store.writes)
    assert node1.submit(folders[1], 3) and node1.close(10) and node0.close(10)
    assert store.writes[before:] == [] and "checkpoint-3/manifest.json" in store.objects


def test_a_node_whose_part_lost_a_file_uploads_again(tmp_path: Path):
    # Its part alone says nothing: a file it lists is gone (a delete that stopped halfway), so node 1 uploads.
    store, node0, node1, folders = _committed_on_two_nodes(tmp_path)
    del store.objects["checkpoint-3/rng_state_1.pth"], store.objects["checkpoint-3/manifest.json"]
    assert node1.submit(folders[1], 3) and node1.close(10) and node0.close(10)
    assert store.objects["checkpoint-3/rng_state_1.pth"] == b"1"


class DeleteFailsOnce(MemoryStore):
    """S3 answers everything but the first retention delete (a 503 in the middle of retention)."""

    def __init__(self) -> None:
        super().__init__()
        self.delete_failures = 1

    def delete_checkpoint(self, step: int) -> None:
        if self.delete_failures:
            self.delete_failures -= 1
            raise StorageTemporaryError(f"delete checkpoint-{step}: 503 SlowDown")
        super().delete_checkpoint(step)


def test_a_retention_failure_never_uncommits_the_newest_step_on_two_nodes(tmp_path: Path):
    """Node rank 0 commits the merged manifest of both nodes; retention then fails. The commit stands:
    the step is not sent back through the upload path (where node 0's own files never equal the merged
    manifest, and the retry used to un-commit the newest checkpoint)."""
    store = DeleteFailsOnce()
    kw = dict(nnodes=2, part_wait_s=10, retention=RetentionPolicy(save_total_limit=1))
    node0 = _uploader(tmp_path / "n0", store, node_rank=0, **kw)
    node1 = _uploader(tmp_path / "n1", store, node_rank=1, **kw)
    for step in (1, 2, 3):
        for rank, up in ((1, node1), (0, node0)):
            folder = tmp_path / f"o{rank}" / f"checkpoint-{step}"
            folder.mkdir(parents=True)
            (folder / f"rng_state_{rank}.pth").write_bytes(b"%d-%d" % (rank, step))
            up.submit(folder, step)
        assert node1.wait(10) and node0.wait(10)
        assert f"checkpoint-{step}/manifest.json" in store.objects  # committed, and it stays so
    assert node1.close(10) and node0.close(10)
    assert not [w for w in store.writes if w.startswith("uncommit") and w != "uncommit checkpoint-1"
                and w != "uncommit checkpoint-2"], store.writes
    assert [w for w in store.writes if w.endswith("/manifest.json")] == [
        "checkpoint-1/manifest.json", "checkpoint-2/manifest.json", "checkpoint-3/manifest.json"]
    # the failed deletion was made up for after the next commit: only the newest is left
    assert [c.step for c in store.list_checkpoints() if c.complete] == [3]
    assert node0.last_error is None


def test_a_step_another_node_skipped_does_not_stall_node0(tmp_path: Path):
    """S3 is down; node 1 may hold one waiting snapshot and drops older ones, node 0 keeps all.
    Node 0 must give up the steps node 1 skipped (once node 1's part of a newer step exists)
    instead of waiting part_wait_s for parts that will never come, and commit the newest."""
    store = MemoryStore()
    store.fail_next = 10**9
    node0 = _uploader(tmp_path / "n0", store, nnodes=2, node_rank=0, part_wait_s=60, max_queued=5)
    node1 = _uploader(tmp_path / "n1", store, nnodes=2, node_rank=1, max_queued=1)
    for step in (1, 2, 3):
        node0.submit(_local_checkpoint(tmp_path / "o0", step), step)
        node1.submit(_local_checkpoint(tmp_path / "o1", step), step)
    assert node1.dropped, "node 1 should have skipped a step while S3 was down"
    assert len(list((tmp_path / "n1" / "staging").iterdir())) <= 2, "node 1's disk holds current + 1 waiting"
    store.fail_next = 0
    start = time.monotonic()
    assert node1.close(20) and node0.close(20), "node 0 stalled on a step node 1 skipped"
    assert time.monotonic() - start < 20
    committed = [c.step for c in store.list_checkpoints() if c.complete]
    assert committed[-1] == 3
    assert set(node1.dropped) <= set(node0.dropped) and not set(committed) & set(node1.dropped)
    assert node0.last_error is None


def test_folder_watcher_reports_complete_new_and_replaced_folders_once(tmp_path: Path):
    (tmp_path / "checkpoint-1").mkdir()
    w = FolderWatcher(tmp_path)
    assert w.prime() == [1]
    assert w.poll() == []
    (tmp_path / "tmp-checkpoint-2").mkdir()
    mark_ready(tmp_path / "tmp-checkpoint-2")  # kubetrain's Trainer marks, then renames
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / MANIFEST_NAME).write_text("{}")  # restored: already committed
    assert w.poll() == []
    (tmp_path / "tmp-checkpoint-2").rename(tmp_path / "checkpoint-2")
    assert w.poll() == [(2, tmp_path / "checkpoint-2")]
    assert w.poll() == []
    (tmp_path / "checkpoint-2").rename(tmp_path / "old")
    (tmp_path / "checkpoint-2").mkdir()  # re-saved at the same step
    mark_ready(tmp_path / "checkpoint-2")
    assert w.poll() == [(2, tmp_path / "checkpoint-2")]


def _client_error(code: str, status: int, message: str = "") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


@pytest.mark.parametrize(
    "exc, kind",
    [
        (_client_error("SlowDown", 503), StorageTemporaryError),
        (_client_error("InternalError", 500), StorageTemporaryError),
        (_client_error("NoSuchBucket", 404), StorageAccessError),
        (_client_error("InvalidAccessKeyId", 403), StorageAccessError),
        (_client_error("AccessDenied", 403), StorageAccessError),
        (_client_error("", 401), StorageAccessError),
        (_client_error("InvalidBucketName", 400), StoragePermanentError),
        # STS refusing a web identity token (boto3's chain calls it): access, retried in the start window.
        (_client_error("InvalidIdentityToken", 400), StorageAccessError),
        (_client_error("IDPRejectedClaim", 403), StorageAccessError),
        (_client_error("ExpiredTokenException", 400), StorageAccessError),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), StorageTemporaryError),
        (ConnectionResetError("reset"), StorageTemporaryError),
        # A request botocore refuses to send (a bucket name it rejects) is never valid on a retry.
        (ParamValidationError(report="Invalid bucket name \"a b\""), StoragePermanentError),
    ],
)
def test_errors_are_classified_temporary_or_permanent(exc, kind):
    assert type(classify(exc, op="put", where="s3://b/k")) is kind


def test_credentials_never_appear_in_error_messages(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value-xyz")
    err = classify(_client_error("SignatureDoesNotMatch", 403, "expected s3cr3t-value-xyz"), op="put", where="s3://b/k")
    assert "s3cr3t-value-xyz" not in str(err) and "SignatureDoesNotMatch" in str(err)


def test_retrying_gives_up_at_the_deadline_and_succeeds_before_it():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise StorageTemporaryError("down")
        return "ok"

    assert retrying(flaky, deadline=time.monotonic() + 10, backoff=FAST) == "ok"
    with pytest.raises(StorageTemporaryError):
        retrying(lambda: (_ for _ in ()).throw(StorageTemporaryError("down")), deadline=time.monotonic() + 0.1,
                 backoff=FAST)
    with pytest.raises(StoragePermanentError):  # never retried
        retrying(lambda: (_ for _ in ()).throw(StoragePermanentError("no bucket")), deadline=None, backoff=FAST)


def test_keep_only_newest_drops_waiting_snapshots_on_preemption(tmp_path: Path):
    store = MemoryStore()
    store.fail_next = 10**9
    up = _uploader(tmp_path, store, max_queued=5)
    for step in (1, 2, 3, 4):
        up.submit(_local_checkpoint(tmp_path / "out", step), step)
    deadline = time.monotonic() + 30  # a safety net, never a speed
    while not (up._current is not None and up._current.failures > 0):  # step 1 is being uploaded (and failing)
        assert time.monotonic() < deadline, "step 1 never failed"
        time.sleep(0.02)
    dropped = up.keep_only_newest()
    assert dropped == [2, 3]
    store.fail_next = 0
    assert up.close(10)
    assert sorted(c.step for c in store.list_checkpoints() if c.complete) == [1, 4]


def test_an_older_upload_failing_after_a_sigterm_gives_way_to_the_newest(tmp_path: Path):
    """After a SIGTERM the drain asks, while time runs out: a failing upload in flight (retrying) stops at once,
    uncommitted, and the newest goes out. (One that makes progress goes on while the newest still has time
    after it: the e2e tier's 120 s grace commits both.)"""
    store = MemoryStore()
    store.fail_next = 10**9  # step 1 fails and retries
    up = _uploader(tmp_path, store, max_queued=5)
    for step in (1, 2):
        up.submit(_local_checkpoint(tmp_path / "out", step), step)
    deadline = time.monotonic() + 30  # a safety net, never a speed
    while not (up._current is not None and up._current.failures > 0):
        assert time.monotonic() < deadline, "step 1 never failed"
        time.sleep(0.02)
    assert up.give_way_if_late(60.0)
    store.fail_next = 0
    assert up.close(10)
    assert sorted(c.step for c in store.list_checkpoints() if c.complete) == [2]


def test_sync_callback_uploads_on_save_unless_the_launcher_does(tmp_path: Path, monkeypatch):
    from types import SimpleNamespace

    from kubetrain_trainer.watcher import CheckpointSyncCallback

    store = MemoryStore()
    folder = _local_checkpoint(tmp_path / "out", 9)
    state = SimpleNamespace(is_world_process_zero=True, global_step=9, last_checkpoint_dir=str(folder))
    monkeypatch.setenv("KUBETRAIN_SYNC_BY_LAUNCHER", "1")
    off = CheckpointSyncCallback(_uploader(tmp_path / "off", store))
    off.on_save(None, state, None, checkpoint_dir=str(folder))
    off.on_train_end(None, state, None)
    assert store.objects == {}
    monkeypatch.delenv("KUBETRAIN_SYNC_BY_LAUNCHER")
    on = CheckpointSyncCallback(_uploader(tmp_path / "on", store))
    on.on_save(None, SimpleNamespace(**{**vars(state), "is_world_process_zero": False}), None)
    assert on._uploader.pending_steps() == []  # only world rank 0 uploads
    on.on_save(None, state, None, checkpoint_dir=str(folder))
    on.on_train_end(None, state, None)
    assert "checkpoint-9/manifest.json" in store.objects


def test_the_callback_uploads_a_landed_async_save_under_its_own_step(tmp_path, monkeypatch):
    """With async_save, on_save fires when the save lands, a step or more later: checkpoint-9 must be
    stored as checkpoint-9, not under the step training has reached (11)."""
    from types import SimpleNamespace

    from kubetrain_trainer.watcher import CheckpointSyncCallback

    monkeypatch.delenv("KUBETRAIN_SYNC_BY_LAUNCHER", raising=False)
    store = MemoryStore()
    folder = _local_checkpoint(tmp_path / "out", 9)
    state = SimpleNamespace(is_world_process_zero=True, global_step=11, last_checkpoint_dir=str(folder))
    cb = CheckpointSyncCallback(_uploader(tmp_path / "up", store))
    cb.on_save(None, state, None, checkpoint_dir=str(folder))
    cb.on_train_end(None, state, None)
    assert "checkpoint-9/manifest.json" in store.objects
    assert not any(k.startswith("checkpoint-11/") for k in store.objects)


@pytest.mark.parametrize("state", ["null", "[]", '{"log_history": 5}', "[" * 3000])
def test_a_trainer_state_that_is_not_one_commits_all_the_same(tmp_path: Path, state: str):
    """A command's own trainer_state.json (valid JSON, not an HF trainer state) gives no metrics; it blocked the
    queue before (an unexpected error retried forever, every later checkpoint waiting behind it)."""
    store = MemoryStore()
    up = _uploader(tmp_path, store)
    for step in (10, 20):
        folder = _local_checkpoint(tmp_path / "out", step)
        (folder / "trainer_state.json").write_text(state if step == 10 else '{"log_history": []}')
        up.submit(folder, step)
    assert up.close(10)
    assert sorted(c.step for c in store.list_checkpoints() if c.complete) == [10, 20]
