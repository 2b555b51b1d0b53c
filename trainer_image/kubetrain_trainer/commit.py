"""The commit protocol for one checkpoint: fence, upload its files, gather the nodes' parts, manifest last.

The I/O around `decisions.plan_commit`, for one hard-linked snapshot
(`UploadJob`) of a local `checkpoint-<step>/`:

1. list the remote checkpoints and the claims, and ask `plan_commit`: fenced,
   already committed with the same content, or upload (uncommitting another
   writer's manifest first);
2. upload every file not yet uploaded (a retry resumes where the last try
   stopped), up to `StorageConfig.upload_file_concurrency` files at once, the
   claims fence re-read before each file and while its bytes go out
   (`ClaimsFence`, at most once per `fence_check_interval_s`);
3. multi-node: write this node's part (`manifest.node-<r>.json`); node rank 0
   then waits up to `part_wait_s` for every node's part and merges them
   (`decisions.merge_parts`, `MissingPartsError` while one is missing; a path
   several nodes wrote with other content is node rank 0's, uploaded again now),
   or gives the step up (`SupersededError`) once a missing node wrote a part of a newer
   step (each node uploads in step order, so it skipped this one);
4. re-check the fence against manifests and claims, then write `manifest.json`
   LAST: from then on the checkpoint exists for resume.

Fencing is check-then-write (plain S3 has no compare-and-swap across objects,
and boto3's managed transfers take no If-None-Match): a zombie (an attempt
still running after its pod was force-deleted) stops at its next request, so
what it can overwrite under a newer commit is bounded by its in-flight requests
(one per file in flight, each cut within one part), which restore's digest
check then catches. In time the bound is `fence_check_interval_s` plus one
part after the claim, while a newer attempt must first restore and train
before it writes the same step.

Retries, the queue and reporting are the uploader's (`sync.py`); retention
after the commit is `retention.py`'s.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal

from kubetrain_trainer.contract import LAST_CHECKPOINT_KIND
from kubetrain_trainer.decisions import (
    MissingPartsError,
    RemoteCheckpoint,
    RetentionPolicy,
    check_fence,
    merge_parts,
    rewrites,
    plan_commit,
)
from kubetrain_trainer.hashing import FolderHash, LocalFile, build_manifest
from kubetrain_trainer.layout import node_part_name
from kubetrain_trainer.manifest import FileEntry, ManifestError, NodePart
from kubetrain_trainer.retry import Backoff
from kubetrain_trainer.storage_errors import StorageError, TransferStopped

if TYPE_CHECKING:
    from kubetrain_trainer.storage import CheckpointStore

log = logging.getLogger(__name__)


class FencedError(StorageError):
    """A newer attempt owns the checkpoint location: this process must not commit."""


class UploadStopped(TransferStopped):
    """The uploader is closing (its time is up): this try ends before its next file, or within its current
    one's next part, nothing committed."""


class SupersededError(Exception):
    """Another node skipped this checkpoint for a newer one: node rank 0 gives it up too."""


@dataclass(frozen=True)
class SyncSettings:
    """Who is uploading, and the rules to follow."""

    attempt: int
    world_size: int
    strategy: str
    node_rank: int = 0
    nnodes: int = 1
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    backoff: Backoff = field(default_factory=Backoff)
    part_wait_s: float = 900.0
    """How long node rank 0 waits for the other nodes' parts of one checkpoint."""
    max_queued: int = 2
    """Snapshots waiting behind the one uploading; older waiting ones are dropped beyond this."""
    status_interval_s: float = 30.0
    history: frozenset[tuple[int, int, int]] = frozenset()
    """(step, incarnation, attempt) of every manifest seen at start (see `check_fence`)."""
    incarnation: int = 0
    """KUBETRAIN_JOB_INCARNATION: orders this job's writers after those of a job it replaced."""
    claims_at_start: frozenset[tuple[int, int]] = frozenset()
    """Attempt claims already in storage at start: history, never a reason to stop (see `check_fence`)."""
    fence_check_interval_s: float = 1.0
    """The claims fence is re-read before a file upload at most this often (0: before every file)."""
    stale_upload_margin_s: float = 300.0
    """Incomplete multipart uploads begun this long before the uploader started are aborted (clock skew margin)."""


@dataclass(frozen=True)
class CommittedCheckpoint:
    """The contract's last-checkpoint record (termination message, pod annotation)."""

    step: int
    uri: str
    time: str
    size_bytes: int | None = None
    """Bytes of the committed checkpoint (all nodes' files), when this pod committed it."""
    save_seconds: float | None = None
    """How long the workers took to save it, when they reported it (progress.py)."""
    upload_seconds: float | None = None
    """From the first upload try to the commit, retries and waiting for other nodes included."""

    def to_json(self) -> str:
        # `kind` tells the operator this is the record, not a log line that looks like JSON.
        optional = {"sizeBytes": self.size_bytes, "saveSeconds": self.save_seconds,
                    "uploadSeconds": self.upload_seconds}
        return json.dumps({"kind": LAST_CHECKPOINT_KIND, "step": self.step, "uri": self.uri,
                           "time": self.time, **{k: v for k, v in optional.items() if v is not None}}, sort_keys=True)


@dataclass
class UploadJob:
    """One snapshot on its way to storage, with what its earlier tries already did."""

    step: int
    folder: Path
    """The hard-linked snapshot under the staging folder (owned by the uploader)."""
    files: tuple[FileEntry, ...] | None = None
    """The snapshot's commit records, once hashed (once per job, not per try)."""
    hashing: FolderHash | None = None
    """The hash pass in the background while the files go out."""
    uploaded: set[str] = field(default_factory=set)
    failures: int = 0
    started: float | None = None
    """When the first upload try began (monotonic)."""
    snapshot_bytes: int | None = None
    """The snapshot's size, once asked (`CheckpointUploader.give_way_if_late`, every half second after a SIGTERM)."""
    sent_base: int | None = None
    """The store's `bytes_sent` when this job's first try began (its bytes out so far: the rate it goes at)."""
    abandoned: threading.Event = field(default_factory=threading.Event)
    """Set when a newer checkpoint must have the time left (SIGTERM): no file starts, those going out stop."""


@dataclass(frozen=True)
class CommitOutcome:
    """What one successful run of the protocol did with its checkpoint."""

    action: Literal["already committed", "part uploaded", "committed"]
    size_bytes: int | None = None
    """Bytes of the committed checkpoint (all nodes' files), when this run committed it."""


class ClaimsFence:
    """The claims half of the write fence, read from storage: FencedError once a newer attempt has claimed."""

    def __init__(self, store: CheckpointStore, settings: SyncSettings) -> None:
        self.store = store
        self.settings = settings
        self._checked_at = float("-inf")
        self._lock = threading.Lock()
        self._fenced: str | None = None
        """Once a check found a newer claim: every later check raises it at once. A claim is never taken
        back, and a check raised from a transfer's progress callback may be swallowed by the HTTP
        client's retry of that request: the retry's own check must not be skipped as 'just checked'."""

    def new_claims(self) -> list[tuple[int, int]]:
        """Claims written since this writer started (those at start are history)."""
        return [w for w in self.store.list_claims() if w not in self.settings.claims_at_start]

    def check(self, step: int, *, at_most_every_s: float = 0.0) -> None:
        """FencedError when a newer attempt has claimed since this writer started (one LIST; skipped
        within `at_most_every_s` of the last check, so a thousand-shard checkpoint is not a thousand LISTs).
        Safe from the upload threads: one of them reads, the others skip within the interval."""
        if self._fenced is not None:
            raise FencedError(self._fenced)
        with self._lock:
            now = time.monotonic()
            if now - self._checked_at < at_most_every_s:
                return
            self._checked_at = now
        s = self.settings
        fence = check_fence((), step=step, attempt=s.attempt, incarnation=s.incarnation, claims=self.new_claims())
        if not fence.allowed:
            self._fenced = fence.reason
            raise FencedError(fence.reason)

    def check_remote(self, remote: list[RemoteCheckpoint], step: int) -> None:
        """FencedError when a newer writer's manifest or claim is in storage (`decisions.check_fence`)."""
        s = self.settings
        fence = check_fence(remote, step=step, attempt=s.attempt, history=s.history, incarnation=s.incarnation,
                            claims=self.new_claims())
        if not fence.allowed:
            raise FencedError(fence.reason)


class CommitProtocol:
    """Runs the protocol for one `UploadJob` at a time; raises what the uploader retries or gives up on.

    `stopped` cuts the wait for other nodes' parts short; `newer_waiting` says
    whether a newer snapshot waits behind this one (only then can a missing
    node have moved past this step).
    """

    def __init__(self, store: CheckpointStore, settings: SyncSettings, *, fence: ClaimsFence,
                 stopped: threading.Event, newer_waiting: Callable[[], bool]) -> None:
        self.store = store
        self.settings = settings
        self.fence = fence
        self.stopped = stopped
        self.newer_waiting = newer_waiting
        self.bytes_uploaded = 0
        """Bytes of checkpoint files this writer has put in storage (manifests and parts not counted)."""

    def run(self, job: UploadJob) -> CommitOutcome:
        s = self.settings
        remote = self.store.list_checkpoints()
        if job.files is None and (job.hashing is None or job.hashing.failed):
            job.hashing = FolderHash(job.folder)  # hashes in the background; the paths and sizes are known now
        if job.files is None and any(c.step == job.step and c.manifest is not None for c in remote):
            job.files = job.hashing.result()  # only "already committed with these files?" needs them up front
            remote = self.store.list_checkpoints()  # the hash took a while: decide on a fresh listing
        if s.nnodes > 1 and s.node_rank != 0 and (done := self._done_by_this_writer(job, remote)) is not None:
            log.info("checkpoint-%d: %s (node %d uploads nothing again)", job.step, done.action, s.node_rank)
            return done
        # Without a manifest at this step the decision never compares files: the hashes may still be coming.
        decision = plan_commit(remote, step=job.step, files=job.files or (), attempt=s.attempt,
                               incarnation=s.incarnation, nnodes=s.nnodes, history=s.history,
                               claims=self.fence.new_claims())
        if decision.action == "fenced":
            raise FencedError(decision.reason)
        if decision.action == "committed":
            log.info("checkpoint-%d is already committed with the same content", job.step)
            return CommitOutcome("already committed")
        if decision.uncommit_first:
            self.store.uncommit(job.step)
        done = threading.Lock()

        def upload(f: LocalFile | FileEntry) -> None:
            # Fence re-checked before every write, not once per checkpoint: a zombie whose check
            # passed before a newer attempt claimed stops at its next file (and each file in flight
            # within one part), so what it can still overwrite under a newer commit is its in-flight
            # requests, not a whole (retried) upload.
            if self.stopped.is_set() or job.abandoned.is_set():  # closing, or a newer one goes first: no file starts
                raise UploadStopped(f"checkpoint-{job.step}: the uploader stopped before {f.path} went out")
            self.fence.check(job.step, at_most_every_s=s.fence_check_interval_s)
            self.store.upload_file(job.step, job.folder / f.path, f.path, still_allowed=lambda: self._still_allowed(
                job, f.path))
            with done:
                job.uploaded.add(f.path)
                self.bytes_uploaded += f.size

        listed = job.files if job.files is not None else job.hashing.files  # type: ignore[union-attr]
        self.store.each_upload([f for f in listed if f.path not in job.uploaded], upload)
        if job.files is None:
            job.files = job.hashing.result()  # type: ignore[union-attr]
        files = job.files
        if s.nnodes > 1:
            self.store.write_node_part(NodePart(node_rank=s.node_rank, step=job.step, attempt=s.attempt, files=files,
                                                incarnation=s.incarnation))
            if s.node_rank != 0:
                log.info("checkpoint-%d: node %d's part uploaded", job.step, s.node_rank)
                return CommitOutcome("part uploaded")
            files, again = self._wait_for_parts(job)
            if again:  # another node wrote these paths too, with other content: node rank 0's copy is the one
                log.warning("checkpoint-%d: uploading node 0's copy of %s again (other nodes wrote other content)",
                            job.step, ", ".join(again))
                by_path = {f.path: f for f in files}
                self.store.each_upload([by_path[p] for p in again], upload)
        manifest = build_manifest(
            job.folder, step=job.step, attempt=s.attempt, world_size=s.world_size, strategy=s.strategy, files=files,
            incarnation=s.incarnation,
        )
        # Re-check right before the commit: a newer attempt may have started meanwhile.
        self.fence.check_remote(self.store.list_checkpoints(), job.step)
        self.store.commit(manifest)
        log.info("checkpoint-%d committed (%d files, %d bytes)", job.step, len(files), manifest.total_bytes)
        return CommitOutcome("committed", size_bytes=manifest.total_bytes)

    def _done_by_this_writer(self, job: UploadJob, remote: list[RemoteCheckpoint]) -> CommitOutcome | None:
        """For a node other than rank 0, what makes an upload of `job` needless (None: upload it).

        This writer's commit of the step is in storage: node rank 0 committed it, and the step saved again
        holds the same training state (uploading our copy of a path node rank 0 also wrote, or uncommitting,
        would break it: `merge_parts`). Or our part of the step is there, every file it lists too, with these
        very files: a retry, or the same folder saved again while node rank 0 uploads its copies again."""
        s = self.settings
        here = next((c for c in remote if c.step == job.step), None)
        if here is None:
            return None
        if here.complete and here.manifest is not None and here.manifest.writer == (s.incarnation, s.attempt):
            return CommitOutcome("already committed")
        if node_part_name(s.node_rank) not in here.listing:
            return None
        part = next((p for p in self.store.read_node_parts(job.step) if p.node_rank == s.node_rank), None)
        if part is None or part.writer != (s.incarnation, s.attempt) or any(
                f.path not in here.listing for f in part.files):
            return None
        if job.files is None:
            job.files = job.hashing.result()  # type: ignore[union-attr]
        return CommitOutcome("part uploaded") if set(part.files) == set(job.files) else None

    def _wait_for_parts(self, job: UploadJob) -> tuple[tuple[FileEntry, ...], tuple[str, ...]]:
        """Every node's files, and the paths node rank 0 must upload again (`decisions.rewrites`)."""
        s, step = self.settings, job.step
        deadline = time.monotonic() + s.part_wait_s
        while True:
            parts = self.store.read_node_parts(step)
            try:
                files = merge_parts(parts, step=step, attempt=s.attempt, nnodes=s.nnodes, incarnation=s.incarnation)
                return files, rewrites(parts, files, step=step, attempt=s.attempt, incarnation=s.incarnation)
            except MissingPartsError as e:
                if time.monotonic() > deadline:
                    raise
                missing = set(e.ranks)
            # A node skips a step only for a newer one, which this node saved too and has waiting:
            # without one queued here, nobody moved on, and the remote listing is not worth reading.
            moved_on = self._moved_past(step, missing) if self.newer_waiting() else set()
            if moved_on:
                raise SupersededError(f"checkpoint-{step}: node(s) {sorted(moved_on)} skipped it for a newer "
                                      "checkpoint (their uploads lagged); it stays torn and the newer one is committed")
            if job.abandoned.is_set():
                raise UploadStopped(f"checkpoint-{step}: given up for a newer checkpoint while waiting for parts")
            if self.stopped.wait(2.0):
                raise ManifestError(f"checkpoint-{step}: stopped while waiting for other nodes' parts")

    def _moved_past(self, step: int, missing: set[int]) -> set[int]:
        """The missing ranks if every one of them wrote a part of a newer step in this attempt (so it will
        never write one for `step`: each node uploads in step order), else the empty set."""
        if not missing:
            return set()
        seen: set[int] = set()
        for remote in self.store.list_checkpoints():
            if remote.step <= step or not any(node_part_name(r) in remote.listing for r in missing - seen):
                continue
            for part in self.store.read_node_parts(remote.step):
                if part.writer == (self.settings.incarnation, self.settings.attempt) and part.node_rank in missing:
                    seen.add(part.node_rank)
            if seen == missing:
                return missing
        return set()

    def _still_allowed(self, job: UploadJob, path: str) -> None:
        """Called as a file's bytes go out: the transfer stops (its multipart upload aborted, a single PUT
        cut off) once the uploader is closing, its time up (a preempted pod must exit within its grace
        period, not when its largest file is out), or once a newer attempt has claimed."""
        if self.stopped.is_set() or job.abandoned.is_set():
            raise UploadStopped(f"checkpoint-{job.step}: the uploader stopped while {path} went out")
        self.fence.check(job.step, at_most_every_s=self.settings.fence_check_interval_s)
