"""Finds new local checkpoint folders and hands them to the uploader: the launcher's folder watcher, or a callback.

The launcher watches the local output folder (`FolderWatcher`, polled by
`WatchLoop`), so that S3 stays out of the worker processes and arbitrary
`-- command` jobs are synced too; a folder is handed over once
`readiness.decide_commit` says it is complete. `CheckpointSyncCallback` is the
thin in-process alternative for a Trainer run without the launcher.

Limits (by design, written down):
- The watcher polls (1 s): a checkpoint the trainer saves and rotates away
  within one poll is skipped; only the newest matters for resume. Writers
  that fill `checkpoint-<step>` in place are committed by the rule of
  `readiness.py` (ready markers, else quiescence), never at first sight.
- Multi-node (shared-nothing pods): every node must create `checkpoint-<step>`
  (the trainer's local main process does, with at least its rng_state file).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from kubetrain_trainer.callbacks import TrainerCallback
from kubetrain_trainer.commit import SyncSettings
from kubetrain_trainer.layout import MANIFEST_NAME, TRAINER_STATE, parse_checkpoint_dirname
from kubetrain_trainer.manifest import Manifest
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
from kubetrain_trainer.storage import CheckpointStore, StorageConfig
from kubetrain_trainer.sync import CheckpointUploader
from kubetrain_trainer.workerenv import WorkerEnv

log = logging.getLogger(__name__)

RETRY_MAX_S = 60.0
"""A folder whose snapshot failed is tried again after 2, 4, 8... seconds, at most this many."""


def _restored(path: Path, step: int) -> bool:
    """Whether `path` was restored from storage: its manifest.json is a kubetrain manifest of this step."""
    try:
        return Manifest.from_json((path / MANIFEST_NAME).read_bytes()).step == step
    except (OSError, ValueError, RecursionError):  # ManifestError is a ValueError
        return False


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
        self._misnamed: dict[int, int] = {}
        """step -> inode of a folder whose manifest.json is not ours (warned once)."""
        self._pending: dict[int, _Pending] = {}
        self._handed: dict[int, _Pending] = {}
        """step -> the folder the last poll reported, until the next poll (`retry` puts it back)."""
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

    def retry(self, step: int) -> None:
        """The folder the last poll reported for `step` could not be snapshotted (e.g. a full disk):
        forget that it was reported, so a later poll judges it again and reports it once more."""
        pending = self._handed.pop(step, None)
        if pending is None:
            return
        if self._seen.get(step) == pending.inode:
            del self._seen[step]
        pending.failures += 1  # not at every poll: each try may copy a whole checkpoint
        pending.retry_at = self.clock() + min(RETRY_MAX_S, 2.0 ** pending.failures)
        self._pending.setdefault(step, pending)

    def poll(self) -> list[tuple[int, Path]]:
        now = self.clock()
        self._handed.clear()
        for step, inode, path in self._entries():
            if self._seen.get(step) == inode:
                continue
            if (path / MANIFEST_NAME).exists() and self._misnamed.get(step) != inode:  # read once per folder
                if _restored(path, step):
                    self._seen[step] = inode
                    continue
                self._misnamed[step] = inode  # a writer's own manifest.json: uploaded all the same
                log.warning("%s holds a manifest.json that is not a kubetrain manifest of step %d: that name is "
                            "reserved at a checkpoint's top level (the upload's own manifest), so the file is left "
                            "out of the upload; the rest goes up", path, step)
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
            if decision.action == "wait" or (decision.action == "commit" and now < pending.retry_at
                                             and self._writers_end is None):  # the last scan tries at once
                continue
            del self._pending[step]
            self._seen[step] = pending.inode
            if decision.action == "commit":
                log.info("local checkpoint-%d is complete: %s", step, decision.reason)
                self._handed[step] = pending
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
    failures: int = 0
    """Snapshots of this folder that failed (`FolderWatcher.retry`)."""
    retry_at: float = float("-inf")


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
                try:
                    self.uploader.submit(folder, step)
                except OSError as e:  # e.g. ENOSPC in the staging folder: not snapshotted, tried again later
                    self.watcher.retry(step)
                    log.error("checkpoint storage problem: local checkpoint-%d could not be snapshotted for "
                              "upload (%s); tried again at a later scan", step, e)

    def writers_exited(self, *, clean: bool) -> None:
        self.watcher.writers_exited(clean=clean)

    def stop(self) -> None:
        """Stop polling, after one last scan (the emergency checkpoint lands just before the workers exit)."""
        self._stop.set()
        self._thread.join(timeout=10.0)
        try:
            self.scan_once()
        except Exception:  # the launcher still drains what was queued and reports the exit as it is
            log.exception("checkpoint storage problem: the last checkpoint folder scan failed")

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
        self.enabled = not WorkerEnv.from_environ().sync_by_launcher

    def _get(self) -> CheckpointUploader | None:
        env = WorkerEnv.from_environ() if self._uploader is None and self.enabled else None
        if env is not None and env.checkpoint_uri:
            store = CheckpointStore(StorageConfig.from_env(env.environ))
            settings = SyncSettings(
                attempt=1 if env.attempt is None else env.attempt,
                incarnation=env.incarnation,
                world_size=env.world_size,
                strategy=env.strategy,
            )
            local_dir = env.local_checkpoint_dir or Path("/tmp/kubetrain/checkpoints")
            staging = local_dir.parent / "upload-staging"
            self._uploader = CheckpointUploader(store, settings, staging_dir=staging).start()
        return self._uploader

    def on_save(self, args, state, control, **kwargs):
        if not self.enabled or not state.is_world_process_zero:
            return
        folder = kwargs.get("checkpoint_dir") or state.last_checkpoint_dir
        uploader = self._get()
        if uploader is not None and folder:
            try:
                # The folder's own step: an async save's on_save fires when it lands, steps later.
                uploader.submit(Path(folder), parse_checkpoint_dirname(Path(folder).name) or state.global_step)
            except OSError as e:  # training goes on regardless of the upload (a full staging disk)
                log.error("checkpoint storage problem: checkpoint-%d not snapshotted for upload: %s",
                          state.global_step, e)

    def on_train_end(self, args, state, control, **kwargs):
        if self._uploader is not None and state.is_world_process_zero:
            self._uploader.close(self.wait_s)
