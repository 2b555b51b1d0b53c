"""Background upload of local checkpoints: one thread, a bounded queue of snapshots, status reporting.

Training must never wait for S3, and S3 must never hold a checkpoint that
resume could half-read. So:

- a new local `checkpoint-<step>/` is snapshotted at once (hard links: cheap,
  and immune to the trainer's local rotation deleting the folder) and queued;
- one background thread commits the snapshots oldest first, each by the
  protocol of `commit.py` (fence, files, nodes' parts, `manifest.json` LAST);
- after a commit, node rank 0 applies remote retention (`retention.py`);
- when S3 is down, uploads retry with backoff, at most `max_queued` snapshots
  wait on every node (older waiting ones are superseded by newer), and a
  status line says checkpoints are lagging. Training goes on regardless.
  Multi-node, node rank 0 gives a step up once a node that lacks a part of it
  has written its part of a newer step (it skipped the step, and uploads in
  step order), so a skip on one node never stalls the commit of the next.

Who hands folders over: the launcher's watcher or the Trainer callback
(`watcher.py`). Limit (by design): node rank 0 waits `part_wait_s` for the
other nodes' parts, else that step stays torn; every node restores the whole
checkpoint (all nodes' files).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import deque
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from kubetrain_trainer.commit import (
    ClaimsFence,
    CommitProtocol,
    CommittedCheckpoint,
    FencedError,
    SupersededError,
    SyncSettings,
    UploadJob,
    UploadStopped,
)
from kubetrain_trainer.hashing import HashCancelled
from kubetrain_trainer.layout import checkpoint_dirname
from kubetrain_trainer.manifest import ManifestError, utc_now_rfc3339
from kubetrain_trainer.retention import apply_retention
from kubetrain_trainer.storage import CheckpointStore
from kubetrain_trainer.storage_errors import StorageError, StoragePermanentError

log = logging.getLogger(__name__)


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
        self._queue: deque[UploadJob] = deque()
        self._current: UploadJob | None = None
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kubetrain-ckpt-upload", daemon=True)
        self._last_status = 0.0
        self._started_at = datetime.now(timezone.utc)
        """When this attempt's uploader started: multipart uploads begun before it are an earlier attempt's."""
        self._fence = ClaimsFence(store, settings)
        self._protocol = CommitProtocol(store, settings, fence=self._fence, stopped=self._stop,
                                        newer_waiting=self._newer_waiting)

    # ------------------------------------------------------------ public

    @property
    def fence(self) -> ClaimsFence:
        """This writer's claims fence (the final model's upload checks it too)."""
        return self._fence

    def start(self) -> "CheckpointUploader":
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def submit(self, folder: Path, step: int) -> bool:
        """Snapshot `folder` (a complete local checkpoint) and queue it. False if it vanished or we are fenced.

        Any other error taking the snapshot (a full disk, ENOSPC; EXDEV) removes the partial copy and is
        raised (`OSError`): the folder was not snapshotted, and the caller may try it again later."""
        if self.fenced:
            return False
        with self._lock:  # uploads go in step order: a folder tried again (after ENOSPC) behind a newer one is
            newer = [j.step for j in self._queue] + ([self._current.step] if self._current else []) + \
                ([self.last_committed.step] if self.last_committed else [])  # superseded, as on overflow
            if any(n > step for n in newer):
                self.dropped.append(step)
                log.warning("checkpoint-%d superseded by checkpoint-%d before it could be uploaded", step, max(newer))
                return False
        snap = self.staging_dir / f"{checkpoint_dirname(step)}.{time.monotonic_ns()}"
        try:
            _snapshot(folder, snap)
        except FileNotFoundError:
            # The trainer rotated it away before we looked (or while we did): nothing to upload.
            shutil.rmtree(snap, ignore_errors=True)
            log.warning("checkpoint-%d disappeared locally before it could be snapshotted", step)
            return False
        except BaseException:
            shutil.rmtree(snap, ignore_errors=True)  # never a partial copy left in staging
            raise
        with self._lock:
            self._queue.append(UploadJob(step=step, folder=snap))
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

    @property
    def bytes_uploaded(self) -> int:
        """Bytes of checkpoint files this node has put in storage (for /metrics)."""
        return self._protocol.bytes_uploaded

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

    def give_way_if_late(self, time_left_s: float) -> bool:
        """Preempted (asked again as the time runs out): stop the older upload in flight (its files at their
        next progress callback; it stays uncommitted) once the newest checkpoint waiting needs what is left,
        `NEWEST_HEADROOM` x its size at the rate the older one's bytes went out, or at once when the
        older one is failing (retrying, nothing to wait for). Until then it goes on, and the newest is committed
        after it. True when it was stopped now."""
        with self._lock:
            current, newest = self._current, (self._queue[-1] if self._queue else None)
            if current is None or newest is None or newest.step <= current.step or current.abandoned.is_set():
                return False
            files = current.files if current.files is not None else \
                (current.hashing.files if current.hashing is not None else None)
            elapsed = time.monotonic() - (current.started or time.monotonic())
            done = sum(f.size for f in files or () if f.path in current.uploaded)  # finished files only
            sent = getattr(self.store, "bytes_sent", None)
            if sent is not None and current.sent_base is not None:
                done = max(done, sent - current.sent_base)  # the bytes that went out, files in flight included
            if done > 0:  # the newest's need, now or never
                if newest.snapshot_bytes is None:
                    newest.snapshot_bytes = _folder_bytes(newest.folder)
                late = NEWEST_HEADROOM * newest.snapshot_bytes / (done / max(elapsed, 1e-3)) >= time_left_s
            else:
                late = current.failures > 0
            if not late:
                return False
            current.abandoned.set()
            if current.hashing is not None:
                current.hashing.cancel()
        log.warning("checkpoint-%d cannot finish uploading with checkpoint-%d in the %.0f s left: giving it up for "
                    "the newer one", current.step, newest.step, time_left_s)
        return True

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

    def close(self, timeout_s: float, *, join_s: float = 5.0) -> bool:
        """Drain the queue within `timeout_s`, then stop the thread (a transfer in flight stops at its next
        progress callback; the thread is waited for `join_s`). True when everything was committed."""
        done = self.wait(timeout_s)
        if not done:
            log.error("%s; giving up", self.status_line())
        self._stop.set()
        with self._lock:
            if self._current is not None and self._current.hashing is not None:
                self._current.hashing.cancel()  # its files stop going out too (`UploadStopped`)
            self._lock.notify_all()
        self._thread.join(timeout=join_s)
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
            except (UploadStopped, HashCancelled) as e:
                log.warning("checkpoint-%d not committed: %s", job.step, e)
                finished = job.abandoned.is_set()  # the newer one goes on; else the loop ends: `close` gave up
                if finished:
                    self.dropped.append(job.step)
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
                until = time.monotonic() + delay  # cut short when it is given up for a newer one (SIGTERM)
                while (left := until - time.monotonic()) > 0 and not job.abandoned.is_set():
                    if self._stop.wait(min(0.2, left)):
                        break
            if finished or self._stop.is_set():
                if job.hashing is not None:
                    job.hashing.cancel()  # done already, or no longer needed: never a thread hashing on
            if finished:
                shutil.rmtree(job.folder, ignore_errors=True)
                with self._lock:
                    self._current = None
                    self._lock.notify_all()
            self._maybe_status()

    def _newer_waiting(self) -> bool:
        with self._lock:
            return bool(self._queue)

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

    def _process(self, job: UploadJob) -> None:
        if job.abandoned.is_set():
            raise UploadStopped(f"checkpoint-{job.step}: given up for a newer checkpoint")
        job.started = job.started or time.monotonic()
        if job.sent_base is None:
            job.sent_base = getattr(self.store, "bytes_sent", None)
        outcome = self._protocol.run(job)
        if outcome.action == "already committed":
            self._committed(job.step)
            return
        if outcome.action == "part uploaded":
            self._uploaded(job)
            return
        self._committed(job.step, size_bytes=outcome.size_bytes, upload_seconds=self._uploaded(job))
        apply_retention(self.store, self.settings, self._fence, pending_steps=self.pending_steps,
                        started_at=self._started_at)

    def _uploaded(self, job: UploadJob) -> float:
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


NEWEST_HEADROOM = 1.5
"""After a SIGTERM, the time the newest checkpoint is given over its estimated upload time (`give_way_if_late`)."""


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _snapshot(src: Path, dst: Path) -> None:
    """Hard-link every file of `src` under `dst` (copy across file systems).

    Any error reading the folder fails the snapshot: a subfolder (or `src` itself) removed meanwhile by
    the trainer's local rotation raises FileNotFoundError, never a silently incomplete snapshot."""
    if not src.is_dir():
        raise FileNotFoundError(src)

    def walk_error(e: OSError) -> None:
        raise e

    for root, _dirs, files in os.walk(src, onerror=walk_error):
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
    if not src.is_dir():  # rotated away while it was walked: what was linked may lack a whole subfolder
        raise FileNotFoundError(src)
