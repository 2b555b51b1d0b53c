"""One pod's checkpoint session: restore at start, background upload while training, the final model at the end.

The launcher (`launch.main`) opens a session when the job has checkpoint storage and drives it
in this order:

1. `restore()`: what every rank of the attempt restores (`restore.py`), the folder to resume from;
2. `start(restored)`: the uploader of `sync.py` and the folder watcher of `watcher.py`, so S3
   never sits in the workers' way; node rank 0 writes each commit's last-checkpoint record (`podreport.py`);
3. after the workers exited, `finish_watching(...)`: one last scan picks up the emergency
   checkpoint;
4. `close(budget_s)`: the pending uploads get the budget; node rank 0 reports its last checkpoint;
5. on success, node rank 0's `upload_final(...)`: the finished model to `<uri>/final/` (`final_model.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

from kubetrain_trainer.commit import CommittedCheckpoint, SyncSettings, UploadStopped
from kubetrain_trainer.decisions import RetentionPolicy
from kubetrain_trainer.final_model import upload_final_model
from kubetrain_trainer.metrics import Telemetry
from kubetrain_trainer.podreport import write_termination_message
from kubetrain_trainer.rank_files import NodeRanks
from kubetrain_trainer.readiness import CommitMode
from kubetrain_trainer.restore import Restored, fetch_best, restore_agreed
from kubetrain_trainer.retry import Backoff
from kubetrain_trainer.storage import CheckpointStore
from kubetrain_trainer.storage_errors import StorageError
from kubetrain_trainer.sync import CheckpointUploader
from kubetrain_trainer.watcher import FolderWatcher, WatchLoop

log = logging.getLogger("kubetrain_trainer.session")


@dataclass(frozen=True)
class SessionConfig:
    """What the session needs of the launcher's configuration (`launch.LaunchConfig.session_config`)."""

    local_dir: Path
    """The folder checkpoints are restored to and watched in: the trainer's output_dir."""
    node_rank: int
    nnodes: int
    world_size: int
    attempt: int
    incarnation: int
    strategy: str
    retention: RetentionPolicy
    restore_timeout_s: float
    """How long S3 may stay unreachable before the restore gives up."""
    access_retry_s: float
    """How long refused access or a missing bucket is retried at start."""
    settle_s: float
    """How long an unmarked folder must stay unchanged before it is committed (readiness.py)."""
    commit_mode: CommitMode
    termination_log: Path
    """Where node rank 0 writes its last-checkpoint record (podreport.py)."""


class CheckpointSession:
    """This pod's checkpoints in storage, from the restore to the final model."""

    def __init__(self, store: CheckpointStore, config: SessionConfig, *, telemetry: Telemetry,
                 stop: threading.Event) -> None:
        self.store = store
        self.config = config
        self.telemetry = telemetry
        self.stop = stop
        """Set on SIGTERM: cuts the restore's waits short."""
        self._uploader: CheckpointUploader | None = None
        self._watch: WatchLoop | None = None

    def restore(self) -> Restored:
        """Restore what every rank of this attempt restores (`restore.restore_agreed`).

        Raises `restore.RestoreAgreementError` when this rank cannot restore node rank 0's decision,
        `storage.StorageError` when storage stays unreachable or refuses access."""
        c = self.config
        started = time.monotonic()
        node = NodeRanks.of(node_rank=c.node_rank, nnodes=c.nnodes, world_size=c.world_size)
        restored = restore_agreed(self.store, c.local_dir, node_rank=c.node_rank, incarnation=c.incarnation,
                                  attempt=c.attempt, deadline=started + c.restore_timeout_s, stop=self.stop,
                                  access_deadline=started + c.access_retry_s, node=node)
        # load_best_model_at_end loads the best checkpoint at the end of training: on this node's disk too.
        fetch_best(self.store, restored, c.local_dir, deadline=time.monotonic() + c.restore_timeout_s, stop=self.stop,
                   access_deadline=time.monotonic() + c.access_retry_s, node=node)
        self.telemetry.restored(time.monotonic() - started, restored.committed)
        return restored

    def start(self, restored: Restored) -> None:
        """Start the uploader and the folder watcher, fenced by what storage held at `restored`."""
        c = self.config
        settings = SyncSettings(
            attempt=c.attempt,
            incarnation=c.incarnation,
            world_size=c.world_size,
            strategy=c.strategy,
            node_rank=c.node_rank,
            nnodes=c.nnodes,
            retention=c.retention,
            backoff=Backoff(initial_s=1.0, maximum_s=30.0),
            history=restored.history,
            claims_at_start=restored.claims,
        )
        staging = c.local_dir.parent / f".{c.local_dir.name}.upload-staging"
        uploader = CheckpointUploader(
            self.store, settings, staging_dir=staging, on_commit=self._on_commit, initial=restored.committed,
            on_upload=self.telemetry.uploaded, save_seconds=self.telemetry.save_seconds,
        ).start()
        self.telemetry.attach(uploader)
        watcher = FolderWatcher(c.local_dir, settle_s=c.settle_s, node_rank=c.node_rank, mode=c.commit_mode)
        stale = watcher.prime()
        if stale:
            log.warning("ignoring local checkpoints left from before this launch: %s", stale)
        self._uploader, self._watch = uploader, WatchLoop(watcher, uploader).start()

    def finish_watching(self, *, writers_clean: bool, keep_only_newest: bool) -> None:
        """The workers exited: one last scan (the emergency checkpoint). `writers_clean`: they stopped
        on their own terms, so their last folder is complete; `keep_only_newest`: preempted, so only
        the newest checkpoint is worth the rest of the grace period."""
        uploader, watch = self._running()
        watch.writers_exited(clean=writers_clean)
        watch.stop()
        if keep_only_newest:
            uploader.keep_only_newest()

    def wait_uploads(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the pending uploads; True when none is left."""
        return self._running()[0].wait(timeout_s)

    def keep_only_newest(self) -> None:
        """Preempted: only the newest checkpoint is worth what is left of the grace period."""
        self._running()[0].keep_only_newest()

    def give_way_if_late(self, time_left_s: float) -> bool:
        """Preempted: an older upload in flight that leaves the newest no time gives way (see the uploader's)."""
        return self._running()[0].give_way_if_late(time_left_s)

    def close(self, budget_s: float, *, join_s: float = 5.0) -> bool:
        """Wait up to `budget_s` for the pending uploads (then a transfer in flight stops, its thread
        waited for `join_s`); node rank 0 then reports its last checkpoint in the termination message.
        True when every checkpoint is in storage."""
        uploader, _ = self._running()
        synced = uploader.close(budget_s, join_s=join_s)
        log.info("%s", uploader.status_line())
        if self.config.node_rank == 0 and uploader.last_committed is not None:
            write_termination_message(self.config.termination_log, uploader.last_committed.to_json())
        return synced

    def upload_final(self, *, wait_s: float, give_up: Callable[[], bool] = lambda: False) -> bool:
        """Node rank 0, after success: the final model to `<uri>/final/`. False when it could not be stored,
        a newer attempt claimed the location, or `give_up()` turned true (the grace period after a SIGTERM
        is over: a file in flight stops at its next progress callback)."""
        uploader, _ = self._running()
        step = uploader.last_committed.step if uploader.last_committed else 0

        def still_allowed() -> None:  # as the checkpoints' files: out of time, or fenced (a zombie's final model)
            if give_up():
                raise UploadStopped("final model: the grace period after SIGTERM is over")
            uploader.fence.check(step, at_most_every_s=uploader.settings.fence_check_interval_s)

        def before_manifest() -> None:  # not skipped as "checked within the last second"
            still_allowed()
            uploader.fence.check(step)

        try:
            upload_final_model(self.store, self.config.local_dir, uploader.settings, step=step,
                               deadline=time.monotonic() + wait_s, still_allowed=still_allowed, cancelled=give_up,
                               before_manifest=before_manifest)
            return True
        except (StorageError, UploadStopped) as e:
            log.error("final model not uploaded: %s", e)
            return False

    @property
    def fenced(self) -> bool:
        """A newer attempt owns the checkpoint location: this pod must not write to it any more."""
        return bool(self._running()[0].fenced)

    def _on_commit(self, record: CommittedCheckpoint) -> None:
        if self.config.node_rank == 0:
            write_termination_message(self.config.termination_log, record.to_json())

    def _running(self) -> tuple[CheckpointUploader, WatchLoop]:
        if self._uploader is None or self._watch is None:
            raise RuntimeError("the checkpoint session was not started")
        return self._uploader, self._watch
