"""Background upload of local checkpoints to S3, with commit, fencing and retention.

Training must never wait for S3, and S3 must never hold a checkpoint that
resume could half-read. So:

- a new local `checkpoint-<step>/` is snapshotted at once (hard links: cheap,
  and immune to the trainer's local rotation deleting the folder) and queued;
- one background thread uploads every file, then (multi-node: each node writes
  its part record, node rank 0 waits for all parts) writes `manifest.json`
  LAST; only then does the checkpoint exist for resume;
- before committing, the write fence is checked (a lower attempt never
  overwrites or runs beside a higher one, see `decisions.check_fence`);
- after a commit, node rank 0 applies remote retention (`plan_retention`);
- when S3 is down, uploads retry with backoff, at most `max_queued` snapshots
  wait on every node (older waiting ones are superseded by newer), and a
  status line says checkpoints are lagging. Training goes on regardless.
  Multi-node, node rank 0 gives a step up once a node that lacks a part of it
  has written its part of a newer step (it skipped the step, and uploads in
  step order), so a skip on one node never stalls the commit of the next.

The primary user is the launcher, which watches the local output folder
(`FolderWatcher`) so that S3 stays out of the worker processes and arbitrary
`-- command` jobs are synced too. `CheckpointSyncCallback` is the thin
in-process alternative for a Trainer run without the launcher.

Limits (by design, written down):
- Multi-node (shared-nothing pods): every node must create `checkpoint-<step>`
  (the trainer's local main process does, with at least its rng_state file);
  node rank 0 waits `part_wait_s` for the other nodes' parts, else that step
  stays torn. Every node restores the whole checkpoint (all nodes' files).
- The watcher polls (1 s): a checkpoint the trainer saves and rotates away
  within one poll is skipped; only the newest matters for resume. Writers
  that fill `checkpoint-<step>` in place are committed by the rule of
  `readiness.py` (ready markers, else quiescence), never at first sight.
- Fencing is check-then-write (plain S3 has no compare-and-swap across
  objects, and boto3's managed transfers take no If-None-Match). The fence
  is re-checked before every file and every retention delete, so a zombie
  (an attempt still running after its pod was force-deleted) stops at its
  next request: what it can overwrite under a newer commit is bounded by
  one in-flight request, which restore's sha256 check then catches (that
  checkpoint is skipped for the previous complete one).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Literal

from kubetrain_trainer.callbacks import TrainerCallback
from kubetrain_trainer.decisions import (
    MissingPartsError,
    RetentionPolicy,
    check_fence,
    merge_parts,
    plan_commit,
    plan_retention,
    stale_multipart_uploads,
)
from kubetrain_trainer.hashing import build_manifest, scan_folder, sha256_file
from kubetrain_trainer.layout import (
    FINAL_FOLDER,
    MANIFEST_NAME,
    TMP_PREFIX,
    TRAINER_STATE,
    checkpoint_dirname,
    node_part_name,
    parse_checkpoint_dirname,
)
from kubetrain_trainer.manifest import FileEntry, Manifest, ManifestError, NodePart, utc_now_rfc3339
from kubetrain_trainer.readiness import (
    CommitMode,
    FolderView,
    WriterView,
    decide_commit,
    is_hf_shaped,
    is_marker_name,
    markers_complete,
    observe_folder,
)
from kubetrain_trainer.retry import Backoff
from kubetrain_trainer.storage import CheckpointStore
from kubetrain_trainer.storage_errors import StorageError, StoragePermanentError

log = logging.getLogger(__name__)


class FencedError(StorageError):
    """A newer attempt owns the checkpoint location: this process must not commit."""


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
        return json.dumps({"kind": "kubetrain.io/last-checkpoint", "step": self.step, "uri": self.uri,
                           "time": self.time, **{k: v for k, v in optional.items() if v is not None}}, sort_keys=True)


@dataclass
class _Job:
    step: int
    folder: Path
    """The hard-linked snapshot under the staging folder (owned by the uploader)."""
    files: tuple[FileEntry, ...] | None = None
    uploaded: set[str] = field(default_factory=set)
    failures: int = 0
    started: float | None = None
    """When the first upload try began (monotonic)."""


class CheckpointUploader:
    """One background thread that commits snapshots of local checkpoints to S3, oldest first."""

    def __init__(
        self,
        store: CheckpointStore,
        settings: SyncSettings,
        *,
        staging_dir: Path,
        on_commit: Callable[[CommittedCheckpoint], None] | None = None,
        on_lag: Callable[[bool, str], None] | None = None,
        initial: CommittedCheckpoint | None = None,
        on_upload: Callable[[int, int, float], None] | None = None,
        save_seconds: Callable[[int], float | None] | None = None,
    ) -> None:
        self.store = store
        self.on_upload = on_upload
        """Called with (step, bytes, seconds) once this node's share of a checkpoint is in storage (metrics)."""
        self.save_seconds = save_seconds
        """Looks up how long the workers took to save a step, for the last-checkpoint record."""
        self.bytes_uploaded = 0
        self.settings = settings
        self.staging_dir = staging_dir
        self.on_commit = on_commit
        self.on_lag = on_lag
        """Called with (lagging, status line) whenever the lagging state flips (e.g. to annotate the pod)."""
        self._lag_reported = False
        self.last_committed: CommittedCheckpoint | None = initial
        self.last_error: str | None = None
        self.fenced: str | None = None
        self.dropped: list[int] = []
        self._queue: deque[_Job] = deque()
        self._current: _Job | None = None
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kubetrain-ckpt-upload", daemon=True)
        self._last_status = 0.0
        self._started_at = datetime.now(timezone.utc)
        """When this attempt's uploader started: multipart uploads begun before it are an earlier attempt's."""
        self._claims_checked_at = float("-inf")

    # ------------------------------------------------------------ public

    def start(self) -> "CheckpointUploader":
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def submit(self, folder: Path, step: int) -> bool:
        """Snapshot `folder` (a complete local checkpoint) and queue it. False if it vanished or we are fenced."""
        if self.fenced:
            return False
        snap = self.staging_dir / f"{checkpoint_dirname(step)}.{time.monotonic_ns()}"
        try:
            _snapshot(folder, snap)
        except FileNotFoundError:
            # The trainer rotated it away before we looked: nothing to upload.
            shutil.rmtree(snap, ignore_errors=True)
            log.warning("checkpoint-%d disappeared locally before it could be snapshotted", step)
            return False
        with self._lock:
            self._queue.append(_Job(step=step, folder=snap))
            # Every node may skip a waiting step for a newer one (the disk holds at most max_queued
            # snapshots). Node rank 0, waiting for a part some node skipped, gives that step up once
            # the node's part of a newer step exists (`_wait_for_parts`).
            while len(self._queue) > self.settings.max_queued:
                old = self._queue.popleft()
                self.dropped.append(old.step)
                shutil.rmtree(old.folder, ignore_errors=True)
                log.warning("checkpoint-%d superseded by a newer one before it could be uploaded", old.step)
            self._lock.notify_all()
        return True

    def pending_steps(self) -> list[int]:
        with self._lock:
            current = [self._current.step] if self._current else []
            return current + [j.step for j in self._queue]

    @property
    def lagging(self) -> bool:
        return bool(self.pending_steps()) and self.last_error is not None

    def status_line(self) -> str:
        last = self.last_committed.step if self.last_committed else None
        pending = self.pending_steps()
        state = "lagging" if self.lagging else ("uploading" if pending else "in sync")
        line = f"checkpoint sync {state}: last committed step {last}, pending steps {pending}"
        if self.last_error and pending:
            line += f", last error: {self.last_error}"
        if self.fenced:
            line += f", fenced: {self.fenced}"
        return line

    def keep_only_newest(self) -> list[int]:
        """Drop every waiting snapshot but the newest (on preemption the grace period is short)."""
        with self._lock:
            dropped = []
            while len(self._queue) > 1:
                old = self._queue.popleft()
                shutil.rmtree(old.folder, ignore_errors=True)
                dropped.append(old.step)
            self.dropped.extend(dropped)
        if dropped:
            log.warning("no time for older checkpoints %s: uploading the newest first", dropped)
        return dropped

    def wait(self, timeout_s: float) -> bool:
        """Wait until nothing is pending (True) or the timeout passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._queue or self._current is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(timeout=min(left, 1.0))
        return True

    def close(self, timeout_s: float) -> bool:
        """Drain the queue within `timeout_s`, then stop the thread. True when everything was committed."""
        done = self.wait(timeout_s)
        if not done:
            log.error("%s; giving up after %.0fs", self.status_line(), timeout_s)
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        self._thread.join(timeout=5.0)
        return done

    # ------------------------------------------------------------ worker

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self._current is None and self._queue:
                    self._current = self._queue.popleft()
                job = self._current
                if job is None:
                    self._lock.wait(timeout=1.0)
                    continue
            try:
                self._process(job)
                finished = True
            except FencedError as e:
                self.fenced = str(e)
                log.error("checkpoint-%d not committed: %s; no further uploads from this attempt", job.step, e)
                finished = True
                self._drop_all()
            except SupersededError as e:
                self.dropped.append(job.step)
                log.warning("%s", e)
                finished = True
            except ManifestError as e:
                # Inconsistent parts can not be fixed by retrying; the folder stays torn.
                self.last_error = str(e)
                log.error("checkpoint-%d can not be committed: %s", job.step, e)
                finished = True
            except Exception as e:  # storage/OS errors, or a bug: retried, never a dead thread
                finished = False
                if not isinstance(e, (StorageError, OSError)):
                    log.exception("checkpoint-%d: unexpected error while uploading", job.step)
                job.failures += 1
                self.last_error = str(e)
                permanent = isinstance(e, StoragePermanentError)
                delay = self.settings.backoff.maximum_s if permanent else self.settings.backoff.delay(job.failures)
                log.warning("checkpoint-%d upload failed (%s); retry %d in %.1fs", job.step, e, job.failures, delay)
                self._maybe_status(force=True)
                self._stop.wait(delay)
            if finished:
                shutil.rmtree(job.folder, ignore_errors=True)
                with self._lock:
                    self._current = None
                    self._lock.notify_all()
            self._maybe_status()

    def _drop_all(self) -> None:
        with self._lock:
            for j in self._queue:
                shutil.rmtree(j.folder, ignore_errors=True)
            self._queue.clear()

    def _maybe_status(self, *, force: bool = False) -> None:
        lagging = self.lagging
        if lagging != self._lag_reported:
            self._lag_reported = lagging
            if self.on_lag is not None:
                try:
                    self.on_lag(lagging, self.status_line())
                except Exception:  # reporting must never stop uploads
                    log.exception("on_lag hook failed")
        now = time.monotonic()
        if self.pending_steps() and (force or now - self._last_status >= self.settings.status_interval_s):
            if now - self._last_status >= min(5.0, self.settings.status_interval_s):
                log.log(logging.WARNING if self.lagging else logging.INFO, "%s", self.status_line())
                self._last_status = now

    def _process(self, job: _Job) -> None:
        s = self.settings
        job.started = job.started or time.monotonic()
        if job.files is None:
            job.files = scan_folder(job.folder)  # hashing once, not per retry
        decision = plan_commit(self.store.list_checkpoints(), step=job.step, files=job.files, attempt=s.attempt,
                               incarnation=s.incarnation, nnodes=s.nnodes, history=s.history,
                               claims=self._new_claims())
        if decision.action == "fenced":
            raise FencedError(decision.reason)
        if decision.action == "committed":
            log.info("checkpoint-%d is already committed with the same content", job.step)
            self._committed(job.step)
            return
        if decision.uncommit_first:
            self.store.uncommit(job.step)
        for f in job.files:
            if f.path not in job.uploaded:
                # Fence re-checked before every write, not once per checkpoint: a zombie whose check
                # passed before a newer attempt claimed stops at its next file, so what it can still
                # overwrite under a newer commit is one in-flight request, not a whole (retried) upload.
                self._check_claims(job.step, at_most_every_s=s.fence_check_interval_s)
                self.store.upload_file(job.step, job.folder / f.path, f.path, still_allowed=lambda: self._check_claims(
                    job.step, at_most_every_s=s.fence_check_interval_s))
                job.uploaded.add(f.path)
                self.bytes_uploaded += f.size
        files = job.files
        if s.nnodes > 1:
            self.store.write_node_part(NodePart(node_rank=s.node_rank, step=job.step, attempt=s.attempt, files=files,
                                                incarnation=s.incarnation))
            if s.node_rank != 0:
                log.info("checkpoint-%d: node %d's part uploaded", job.step, s.node_rank)
                self._uploaded(job)
                return
            files = self._wait_for_parts(job.step)
        manifest = build_manifest(
            job.folder, step=job.step, attempt=s.attempt, world_size=s.world_size, strategy=s.strategy, files=files,
            incarnation=s.incarnation,
        )
        # Re-check right before the commit: a newer attempt may have started meanwhile.
        fence = check_fence(self.store.list_checkpoints(), step=job.step, attempt=s.attempt, history=s.history,
                            incarnation=s.incarnation, claims=self._new_claims())
        if not fence.allowed:
            raise FencedError(fence.reason)
        self.store.commit(manifest)
        log.info("checkpoint-%d committed (%d files, %d bytes)", job.step, len(files), manifest.total_bytes)
        self._committed(job.step, size_bytes=manifest.total_bytes, upload_seconds=self._uploaded(job))
        self._apply_retention()

    def _wait_for_parts(self, step: int) -> tuple[FileEntry, ...]:
        s = self.settings
        deadline = time.monotonic() + s.part_wait_s
        while True:
            parts = self.store.read_node_parts(step)
            try:
                return merge_parts(parts, step=step, attempt=s.attempt, nnodes=s.nnodes, incarnation=s.incarnation)
            except MissingPartsError as e:
                if time.monotonic() > deadline:
                    raise
                missing = set(e.ranks)
            # A node skips a step only for a newer one, which this node saved too and has waiting:
            # without one queued here, nobody moved on, and the remote listing is not worth reading.
            with self._lock:
                newer_waiting = bool(self._queue)
            moved_on = self._moved_past(step, missing) if newer_waiting else set()
            if moved_on:
                raise SupersededError(f"checkpoint-{step}: node(s) {sorted(moved_on)} skipped it for a newer "
                                      "checkpoint (their uploads lagged); it stays torn and the newer one is committed")
            if self._stop.wait(2.0):
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

    def _uploaded(self, job: _Job) -> float:
        """This node's share of `job` is in storage: report it; returns the seconds it took."""
        seconds = round(time.monotonic() - (job.started or time.monotonic()), 3)
        if self.on_upload is not None:
            try:
                self.on_upload(job.step, sum(f.size for f in job.files or ()), seconds)
            except Exception:  # reporting must never stop uploads
                log.exception("on_upload hook failed")
        return seconds

    def _committed(self, step: int, *, size_bytes: int | None = None, upload_seconds: float | None = None) -> None:
        self.last_error = None
        try:
            saved = self.save_seconds(step) if self.save_seconds is not None and upload_seconds is not None else None
        except Exception:  # noqa: BLE001 - reporting must never stop uploads
            saved = None
        record = CommittedCheckpoint(step=step, uri=self.store.checkpoint_uri(step), time=utc_now_rfc3339(),
                                     size_bytes=size_bytes, save_seconds=saved, upload_seconds=upload_seconds)
        if self.last_committed is None or step >= self.last_committed.step:
            self.last_committed = record
        if self.on_commit is not None:
            try:
                self.on_commit(record)
            except Exception:  # reporting must never stop uploads
                log.exception("on_commit hook failed")

    def _new_claims(self) -> list[tuple[int, int]]:
        return [w for w in self.store.list_claims() if w not in self.settings.claims_at_start]

    def _check_claims(self, step: int, *, at_most_every_s: float = 0.0) -> None:
        """FencedError when a newer attempt has claimed since this writer started (one LIST; skipped
        within `at_most_every_s` of the last check, so a thousand-shard checkpoint is not a thousand LISTs)."""
        now = time.monotonic()
        if now - self._claims_checked_at < at_most_every_s:
            return
        self._claims_checked_at = now
        s = self.settings
        fence = check_fence((), step=step, attempt=s.attempt, incarnation=s.incarnation, claims=self._new_claims())
        if not fence.allowed:
            raise FencedError(fence.reason)

    def _apply_retention(self) -> None:
        """Node rank 0, after a commit: remote retention, then aborting uploads an earlier attempt left torn.

        Best effort by design: the commit before it stands whatever fails here
        (a failure must never send the committed step back through the upload
        path); what is left over is retried after the next commit.
        """
        s = self.settings
        if s.node_rank != 0:
            return
        try:
            remote = self.store.list_checkpoints()
            # A zombie may waste space, never delete: once a newer writer (attempt or incarnation)
            # has committed, this one deletes nothing, not even its own old steps; and no writer ever
            # deletes a checkpoint that a newer writer committed.
            fence = check_fence(remote, step=-1, attempt=s.attempt, history=s.history, incarnation=s.incarnation,
                                claims=self._new_claims())
            if not fence.allowed:
                log.warning("remote retention skipped: %s", fence.reason)
                return
            mine_or_older = [c for c in remote if c.manifest is None or c.manifest.writer <= (s.incarnation, s.attempt)]
            plan = plan_retention(mine_or_older, s.retention, in_flight=self.pending_steps())
            newest = max((c.step for c in remote if c.complete), default=None)
            for step in plan.delete:
                if step == newest:
                    continue  # the newest committed checkpoint is what the next attempt restores
                self._check_claims(step)  # per delete: a newer attempt may be restoring this very step
                log.info("deleting remote checkpoint-%d (retention; kept %s)", step, dict(plan.protected))
                self.store.delete_checkpoint(step)
            for upload in stale_multipart_uploads(self.store.list_multipart_uploads(),
                                                  attempt_started=self._started_at,
                                                  margin_s=self.settings.stale_upload_margin_s):
                log.info("aborting an incomplete multipart upload of %s left by an earlier attempt", upload.key)
                self.store.abort_multipart_upload(upload)
        except FencedError as e:
            log.warning("remote retention stopped: %s", e)
        except (StorageError, OSError) as e:
            log.warning("remote retention incomplete (%s); retried after the next commit", e)


class FolderWatcher:
    """Finds local checkpoint folders that are complete, by the rule of `readiness.decide_commit`.

    A folder is reported once, when its writer marked it ready, or (writers
    without markers) when it has been quiet for the settle period, an
    HF-shaped one only after its trainer_state.json; kubetrain's own Trainer
    renames a marked folder into place, so it is reported at first sight.
    Folders holding a `manifest.json` were restored from storage and are
    already committed. A folder re-saved at the same step gets a new inode and
    is judged again. `clock` is injectable so the rule is tested without waiting.
    """

    def __init__(self, root: Path, *, settle_s: float = 30.0, node_rank: int = 0, mode: CommitMode = "auto",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.settle_s = settle_s
        self.node_rank = node_rank
        self.clock = clock
        self._seen: dict[int, int] = {}
        """step -> inode of the folder already reported, given up, or left from before this launch."""
        self._pending: dict[int, _Pending] = {}
        self._uses_markers = mode == "marker"
        self._hf_writer = False
        self._writers: Literal["running", "finished", "died"] = "running"
        self._writers_end: float | None = None

    def writers_exited(self, *, clean: bool) -> None:
        """The workers are gone: clean (all exited 0 or 83) or not (a signal, a crash)."""
        if self._writers_end is None:
            self._writers_end = self.clock()
            self._writers = "finished" if clean else "died"

    def prime(self) -> list[int]:
        """Mark every folder present now as seen (left from before this launch, not ours to upload)."""
        return sorted(step for step, inode, _path in self._entries() if self._seen.setdefault(step, inode) == inode)

    def _entries(self) -> list[tuple[int, int, Path]]:
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        out = []
        for entry in entries:
            step = parse_checkpoint_dirname(entry.name)
            if step is None or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                out.append((step, entry.inode(), Path(entry.path)))
            except OSError:
                continue
        return out

    def poll(self) -> list[tuple[int, Path]]:
        now = self.clock()
        for step, inode, path in self._entries():
            if self._seen.get(step) == inode:
                continue
            if (path / MANIFEST_NAME).exists():
                self._seen[step] = inode
                continue
            pending = self._pending.get(step)
            if pending is None or pending.inode != inode:
                self._pending[step] = _Pending(inode=inode, path=path, changed_at=now)
        views: dict[int, tuple[frozenset[str], float]] = {}
        for step, pending in list(self._pending.items()):
            try:
                signature, names = observe_folder(pending.path)
            except OSError:
                del self._pending[step]  # rotated away before it was complete: nothing to upload
                continue
            if signature != pending.signature:
                pending.signature, pending.changed_at = signature, now
            if any(is_marker_name(n) for n in names):
                self._uses_markers = True
            if TRAINER_STATE in names:
                self._hf_writer = True
            end = self._writers_end if self._writers_end is not None else now
            views[step] = (names, max(0.0, end - pending.changed_at))
        writer = WriterView(uses_markers=self._uses_markers, expects_trainer_state=self.node_rank == 0,
                            state=self._writers)
        found = []
        for step, (names, quiet_s) in sorted(views.items()):
            pending = self._pending[step]
            view = FolderView(ready=markers_complete(names), hf_shaped=self._hf_writer or is_hf_shaped(names),
                              has_trainer_state=TRAINER_STATE in names, quiet_s=quiet_s)
            decision = decide_commit(view, writer, settle_s=self.settle_s)
            if decision.action == "wait":
                continue
            del self._pending[step]
            self._seen[step] = pending.inode
            if decision.action == "commit":
                log.info("local checkpoint-%d is complete: %s", step, decision.reason)
                found.append((step, pending.path))
            else:
                log.warning("local checkpoint-%d is never committed: %s", step, decision.reason)
        return found


@dataclass
class _Pending:
    inode: int
    path: Path
    changed_at: float
    signature: tuple | None = None


class WatchLoop:
    """Polls a `FolderWatcher` in a thread and hands new folders to an uploader."""

    def __init__(self, watcher: FolderWatcher, uploader: CheckpointUploader, *, interval_s: float = 1.0) -> None:
        self.watcher = watcher
        self.uploader = uploader
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._scan_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kubetrain-ckpt-watch", daemon=True)

    def start(self) -> "WatchLoop":
        self._thread.start()
        return self

    def scan_once(self) -> None:
        with self._scan_lock:
            for step, folder in self.watcher.poll():
                log.info("new local checkpoint-%d: queued for upload", step)
                self.uploader.submit(folder, step)

    def writers_exited(self, *, clean: bool) -> None:
        self.watcher.writers_exited(clean=clean)

    def stop(self) -> None:
        """Stop polling, after one last scan (the emergency checkpoint lands just before the workers exit)."""
        self._stop.set()
        self._thread.join(timeout=10.0)
        self.scan_once()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.scan_once()
            except Exception:  # a scan error must not kill the watcher
                log.exception("checkpoint folder scan failed")


class CheckpointSyncCallback(TrainerCallback):
    """Uploads each checkpoint the Trainer saves (thin alternative to the launcher's watcher).

    A no-op when the launcher already syncs (it sets KUBETRAIN_SYNC_BY_LAUNCHER=1
    for its workers) and on every process but world rank 0 (single-node only;
    multi-node sharded jobs need the launcher on every node).
    """

    def __init__(self, uploader: CheckpointUploader | None = None, *, wait_s: float = 600.0) -> None:
        self._uploader = uploader
        self.wait_s = wait_s
        self.enabled = os.environ.get("KUBETRAIN_SYNC_BY_LAUNCHER") != "1"

    def _get(self) -> CheckpointUploader | None:
        if self._uploader is None and self.enabled and os.environ.get("KUBETRAIN_CHECKPOINT_URI"):
            from kubetrain_trainer.storage import StorageConfig

            env = os.environ
            store = CheckpointStore(StorageConfig.from_env(env))
            settings = SyncSettings(
                attempt=int(env.get("KUBETRAIN_ATTEMPT", "1")),
                incarnation=int(env.get("KUBETRAIN_JOB_INCARNATION", "0")),
                world_size=int(env.get("WORLD_SIZE", "1")),
                strategy=env.get("KUBETRAIN_STRATEGY", "ddp"),
            )
            staging = Path(env.get("KUBETRAIN_LOCAL_CHECKPOINT_DIR", "/tmp/kubetrain/checkpoints")).parent / "upload-staging"
            self._uploader = CheckpointUploader(store, settings, staging_dir=staging).start()
        return self._uploader

    def on_save(self, args, state, control, **kwargs):
        if not self.enabled or not state.is_world_process_zero:
            return
        folder = kwargs.get("checkpoint_dir") or state.last_checkpoint_dir
        uploader = self._get()
        if uploader is not None and folder:
            uploader.submit(Path(folder), state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self._uploader is not None and state.is_world_process_zero:
            self._uploader.close(self.wait_s)


def upload_final_model(store: CheckpointStore, output_dir: Path, settings: SyncSettings, *, step: int,
                       deadline: float) -> str | None:
    """Upload the finished run's top-level outputs (the `from_pretrained` layout) to `<uri>/final/`.

    Everything directly produced in `output_dir` except checkpoint folders and
    hidden staging folders; `manifest.json` is written last, as for checkpoints,
    so a torn final upload is recognisable. Returns the folder's URI, or None
    when there was nothing to upload.
    """
    from kubetrain_trainer.retry import retrying

    found: list[FileEntry] = []
    for entry in sorted(output_dir.iterdir()):
        name = entry.name
        if name.startswith((".", f"{TMP_PREFIX}-")) or parse_checkpoint_dirname(name) is not None:
            continue  # checkpoints have their own folders; hidden ones are staging
        if entry.is_file() and not entry.is_symlink():
            found.append(FileEntry(path=name, size=entry.stat().st_size, sha256=sha256_file(entry)))
        elif entry.is_dir() and not entry.is_symlink():
            found.extend(FileEntry(f"{name}/{f.path}", f.size, f.sha256) for f in scan_folder(entry))
    files = tuple(found)
    if not files:
        return None
    for f in files:
        retrying(lambda: store.upload_file(step, output_dir / f.path, f.path, folder=FINAL_FOLDER),
                 deadline=deadline, backoff=settings.backoff, what=f"final/{f.path}")
    manifest = Manifest(step=step, attempt=settings.attempt, world_size=settings.world_size,
                        strategy=settings.strategy, files=files, created=utc_now_rfc3339(),
                        incarnation=settings.incarnation)
    retrying(lambda: store.put_bytes(step, MANIFEST_NAME, manifest.to_json(), folder=FINAL_FOLDER),
             deadline=deadline, backoff=settings.backoff, what="final/manifest.json")
    log.info("final model uploaded to %s (%d files)", store.folder_uri(FINAL_FOLDER), len(files))
    return store.folder_uri(FINAL_FOLDER)


def _snapshot(src: Path, dst: Path) -> None:
    """Hard-link every file of `src` under `dst` (copy across file systems)."""
    if not src.is_dir():
        raise FileNotFoundError(src)
    for root, _dirs, files in os.walk(src):
        rel = Path(root).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            s, d = Path(root) / name, dst / rel / name
            try:
                os.link(s, d)
            except OSError as e:
                if isinstance(e, FileNotFoundError):
                    raise
                shutil.copyfile(s, d)
