"""The training container's entrypoint: `python -m kubetrain_trainer.launch [-- command...]`.

It is the trainer side of docs/contract.md, and PID 1 of the pod:

1. read and validate the environment once (`launch_config.py`; a bad value exits 82 naming it);
2. restore the newest COMPLETE checkpoint from S3 into the local folder (every
   node restores, every file checked against its sha256);
3. start NPROC_PER_NODE workers (plain subprocesses: the launcher owns their
   signals) with RANK/LOCAL_RANK/WORLD_SIZE/... set; the default worker is the
   built-in trainer, `-- cmd...` runs the user's command;
4. watch the local folder and upload every new `checkpoint-<step>` in the
   background (`sync.py`), so S3 never sits in the workers' way;
5. forward SIGTERM to the workers, give them what the emergency checkpoint
   needs of the grace period (`grace.py`), then spend the rest uploading it;
6. exit with the contract's code: 0 success, 83 preempted, 82 invalid
   configuration, 84 checkpoint storage unusable, else the worker's code; on node
   rank 0 report the last committed checkpoint in the termination message (`podreport.py`).
Throughout, it serves /metrics and /progress on KUBETRAIN_METRICS_PORT (`metrics.py`).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from kubetrain_trainer.command import expand_command
from kubetrain_trainer.grace import GraceSplit, split_grace
from kubetrain_trainer.launch_config import ConfigError, LaunchConfig
from kubetrain_trainer.metrics import Telemetry
from kubetrain_trainer.podreport import report_storage_refused, write_termination_message
from kubetrain_trainer.progress import PROGRESS_FILE_ENV

from kubetrain_trainer.contract import (
    EXIT_INVALID_CONFIG, EXIT_OK, EXIT_PREEMPTED, EXIT_STORAGE, FAILURE_STORAGE_ACCESS_DENIED,
    FAILURE_STORAGE_REQUEST_INVALID,
)

log = logging.getLogger("kubetrain_trainer.launch")


def writable_extensions(base: Mapping[str, str], scratch: Path) -> dict[str, str]:
    """`base` with TORCH_EXTENSIONS_DIR where torch can write: a read-only copy is copied to `scratch` once.

    torch takes a lock file in an extension's build folder even when the op is prebuilt, so the
    image's prebuilt DeepSpeed ops fail to load from a read-only root file system (the pods'
    default) unless they sit in a writable folder.
    """
    env = dict(base)
    src = env.get("TORCH_EXTENSIONS_DIR")
    if not src or not Path(src).is_dir() or os.access(src, os.W_OK):
        return env
    if not scratch.exists():
        shutil.copytree(src, scratch)
    env["TORCH_EXTENSIONS_DIR"] = str(scratch)
    return env


def worker_env(cfg: LaunchConfig, local_rank: int, base: Mapping[str, str], resume_from: Path | None) -> dict[str, str]:
    """The environment of one worker: torch.distributed's variables plus ours."""
    env = dict(base)
    env.update(
        RANK=str(cfg.node_rank * cfg.nproc_per_node + local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(cfg.world_size),
        LOCAL_WORLD_SIZE=str(cfg.nproc_per_node),
        GROUP_RANK=str(cfg.node_rank),
        ROLE_RANK=str(cfg.node_rank * cfg.nproc_per_node + local_rank),
        ROLE_WORLD_SIZE=str(cfg.world_size),
        MASTER_ADDR=cfg.master_addr,
        MASTER_PORT=str(cfg.master_port),
        KUBETRAIN_LOCAL_CHECKPOINT_DIR=str(cfg.local_dir),
        # The launcher uploads; an in-process CheckpointSyncCallback must not too.
        KUBETRAIN_SYNC_BY_LAUNCHER="1",
    )
    # As torchrun does: N processes each spawning all-core thread pools thrash.
    if cfg.nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("KUBETRAIN_RESUME_FROM", None)
    if resume_from is not None:
        env["KUBETRAIN_RESUME_FROM"] = str(resume_from)
    # The built-in trainer takes output_dir from KUBETRAIN_LOCAL_CHECKPOINT_DIR
    # unless its arguments name one (then local_dir is that one) and resumes
    # from KUBETRAIN_RESUME_FROM: its arguments are passed through untouched.
    return env


def exit_code_for(*, first_failure: int | None, signalled: bool, all_ok: bool) -> int:
    """Map the workers' outcome to the contract's exit code."""
    if all_ok:
        return EXIT_OK
    if first_failure in (EXIT_INVALID_CONFIG, EXIT_PREEMPTED):
        return first_failure
    if signalled:
        return EXIT_PREEMPTED
    if first_failure is None:
        return 1
    return 128 - first_failure if first_failure < 0 else first_failure


class Workers:
    """The worker processes of this node, with signal forwarding and first-failure tracking."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs
        self.first_failure: int | None = None
        self._termed = False

    @classmethod
    def spawn(cls, cfg: LaunchConfig, base_env: Mapping[str, str], resume_from: Path | None) -> "Workers":
        procs = []
        for local_rank in range(cfg.nproc_per_node):
            env = worker_env(cfg, local_rank, base_env, resume_from)
            # Own process group: a terminal's Ctrl-C or a group kill of the
            # launcher reaches workers only through us, exactly once.
            procs.append(subprocess.Popen(expand_command(cfg.command, env), env=env, process_group=0))
        log.info("started %d worker(s): %s", len(procs), " ".join(cfg.command))
        return cls(procs)

    def poll(self) -> bool:
        """Record exits; True when every worker has exited."""
        for p in self.procs:
            code = p.poll()
            if code is not None and code != 0 and self.first_failure is None:
                self.first_failure = code
                log.warning("worker pid %d exited with %d", p.pid, code)
        return all(p.returncode is not None for p in self.procs)

    @property
    def all_ok(self) -> bool:
        return all(p.returncode == 0 for p in self.procs)

    @property
    def exited_cleanly(self) -> bool:
        """Every worker exited by itself with success or the contract's "preempted" (no signal, no crash)."""
        return all(p.returncode in (EXIT_OK, EXIT_PREEMPTED) for p in self.procs)

    def terminate(self) -> None:
        if self._termed:
            return
        self._termed = True
        for p in self.procs:
            if p.poll() is None:
                _signal(p, signal.SIGTERM, group=False)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                log.error("worker pid %d did not stop in time: SIGKILL", p.pid)
                _signal(p, signal.SIGKILL, group=True)
        for p in self.procs:
            p.wait()


def supervise(workers: Workers, stop: threading.Event, cfg: LaunchConfig,
              split: Callable[[float], GraceSplit] = split_grace) -> float | None:
    """Run until every worker exited. Returns when SIGTERM arrived (monotonic), or None."""
    signalled_at: float | None = None
    kill_at: float | None = None
    while not workers.poll():
        now = time.monotonic()
        if stop.is_set() and signalled_at is None:
            signalled_at = now
            plan = split(cfg.grace_s)  # what the save needs; the upload gets the rest (grace.py)
            log.warning("SIGTERM: asking workers for an emergency checkpoint (grace %.0fs: workers %.0fs, "
                        "upload at least %.0fs)", cfg.grace_s, plan.stop_s, plan.upload_s)
            workers.terminate()
            kill_at = now + plan.stop_s
        if workers.first_failure is not None and kill_at is None:
            # One dead rank leaves the others blocked in collectives: stop them all.
            log.warning("a worker failed: stopping the others")
            workers.terminate()
            kill_at = now + min(60.0, cfg.grace_s)
        if kill_at is not None and now >= kill_at:
            workers.kill()
            break
        time.sleep(0.2)
    workers.poll()
    return signalled_at


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("KUBETRAIN_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s kubetrain-launch %(levelname)s %(message)s",
    )
    for noisy in ("botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = LaunchConfig.from_env(os.environ, argv)
    except ConfigError as e:
        log.error("invalid configuration: %s", e)
        return EXIT_INVALID_CONFIG

    stop = threading.Event()

    def on_signal(signum, _frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cfg.local_dir.mkdir(parents=True, exist_ok=True)
    telemetry = Telemetry.for_pod(attempt=cfg.attempt, incarnation=cfg.incarnation)
    if cfg.metrics_port:
        telemetry.serve(cfg.metrics_port)  # a taken port costs a warning, never the job

    uploader = watch = None
    resume_from: Path | None = None
    if cfg.checkpoint_uri:
        from kubetrain_trainer.storage_errors import StorageAccessError, StorageError, StoragePermanentError

        try:
            uploader, watch, resume_from = _start_sync(cfg, stop, telemetry)
        except RestoreAgreementError as e:
            if stop.is_set():
                return EXIT_PREEMPTED
            log.error("restore: %s; this pod fails so that the gang restarts and decides again", e)
            return EXIT_STORAGE
        except StorageError as e:
            if stop.is_set():
                log.warning("SIGTERM while restoring (%s)", e)
                return EXIT_PREEMPTED
            if isinstance(e, StorageAccessError):
                log.error("invalid configuration: checkpoint storage %s refused access (or has no such bucket) "
                          "for %.0fs (KUBETRAIN_S3_AUTH_RETRY_SECONDS): %s", cfg.checkpoint_uri, cfg.access_retry_s, e)
                report_storage_refused(cfg.termination_log, e, reason=FAILURE_STORAGE_ACCESS_DENIED,
                                       where=cfg.checkpoint_uri)
                return EXIT_INVALID_CONFIG
            if isinstance(e, StoragePermanentError):
                log.error("invalid configuration: checkpoint storage %s: %s", cfg.checkpoint_uri, e)
                report_storage_refused(cfg.termination_log, e, reason=FAILURE_STORAGE_REQUEST_INVALID,
                                       where=cfg.checkpoint_uri)
                return EXIT_INVALID_CONFIG
            log.error("checkpoint storage %s unreachable: %s", cfg.checkpoint_uri, e)
            return EXIT_STORAGE
    if stop.is_set():
        log.warning("SIGTERM before training started")
        return EXIT_PREEMPTED

    base = writable_extensions(os.environ, Path(tempfile.gettempdir()) / "kubetrain-torch-extensions")
    base[PROGRESS_FILE_ENV] = str(telemetry.progress_file)  # the workers' progress report (progress.py)
    workers = Workers.spawn(cfg, base, resume_from)
    started = time.monotonic()
    signalled_at = supervise(workers, stop, cfg, telemetry.grace_split)
    code = exit_code_for(first_failure=workers.first_failure, signalled=signalled_at is not None, all_ok=workers.all_ok)
    log.info("workers finished after %.1fs; outcome exit code %d", time.monotonic() - started, code)

    if uploader is not None and watch is not None:
        # Workers that stopped on their own terms wrote their last folder completely; dead ones may not have.
        watch.writers_exited(clean=workers.exited_cleanly)
        watch.stop()  # one last scan: the emergency checkpoint
        if signalled_at is not None:
            uploader.keep_only_newest()
            budget = max(1.0, signalled_at + cfg.grace_s - split_grace(cfg.grace_s).margin_s - time.monotonic())
        elif code == EXIT_OK:
            budget = cfg.upload_wait_s
        else:
            # The run failed anyway: save what we can, but do not hold up the retry for long.
            budget = min(cfg.upload_wait_s, 120.0)
        synced = uploader.close(budget)
        log.info("%s", uploader.status_line())
        if code == EXIT_OK and cfg.node_rank == 0 and not uploader.fenced:
            synced = _upload_final(cfg, uploader) and synced
        if cfg.node_rank == 0 and uploader.last_committed is not None:
            write_termination_message(cfg.termination_log, uploader.last_committed.to_json())
        if not synced and code == EXIT_OK:
            log.error("training finished but its last checkpoints are not in storage")
            code = EXIT_STORAGE
    return code


@dataclass(frozen=True)
class Restored:
    path: Path | None
    """The restored local folder (None: no complete checkpoint, start from scratch)."""
    committed: Any
    """`sync.CommittedCheckpoint` of the restored one, or None."""
    history: frozenset[tuple[int, int, int]]
    """(step, incarnation, attempt) of every manifest in storage at start, for write fencing."""
    claims: frozenset[tuple[int, int]] = frozenset()
    """(incarnation, attempt) of every attempt claim in storage at start: only newer claims that
    appear later fence this writer (one already there is history, e.g. a clock that ran ahead)."""


RESTORE_WAIT_FACTOR = 4
"""Ranks other than 0 wait for node rank 0's restore decision up to this many restore timeouts
while its claim shows it is restoring (its own download of a big checkpoint)."""


class RestoreAgreementError(Exception):
    """This rank cannot restore the step node rank 0 decided for the attempt (or no decision came):
    the ranks never resume from different steps, so this pod fails and the gang restarts."""


def restore_agreed(store, dest: Path, *, node_rank: int, incarnation: int, attempt: int, deadline: float,
                   stop: threading.Event | None = None, access_deadline: float | None = None,
                   poll_s: float = 1.0) -> Restored:
    """Restore what every rank of this attempt restores, decided once by node rank 0.

    Node rank 0 first claims the attempt (`AttemptClaim`, undecided): from then on every older
    writer (a zombie of an earlier attempt, or of a deleted job of the same name) is fenced and
    deletes nothing, so the checkpoint about to be restored cannot vanish by retention. It then
    restores the newest complete checkpoint (falling back past corrupt ones) and records the step
    in the claim. The other ranks wait for that decision and restore exactly that step; if it is
    no longer there, or no decision comes before `deadline`, they fail (RestoreAgreementError)."""
    from kubetrain_trainer.manifest import AttemptClaim
    from kubetrain_trainer.retry import retrying

    cancelled = stop.is_set if stop is not None else (lambda: False)
    sleep = stop.wait if stop is not None else time.sleep
    if incarnation == 0:
        # Not started by the operator (no KUBETRAIN_JOB_INCARNATION): claim names would repeat from
        # run to run, so each rank restores the newest complete checkpoint on its own, as before.
        return restore_newest(store, dest, deadline=deadline, stop=stop, access_deadline=access_deadline)
    claims = frozenset(retrying(store.list_claims, deadline=deadline, access_deadline=access_deadline,
                                cancelled=cancelled, sleep=sleep, what="listing attempt claims"))
    budget = max(1.0, deadline - time.monotonic())
    if node_rank == 0:
        claim = AttemptClaim(incarnation=incarnation, attempt=attempt)
        retrying(lambda: store.write_claim(claim), deadline=deadline, access_deadline=access_deadline,
                 cancelled=cancelled, sleep=sleep, what="claiming the attempt")
        restored = restore_newest(store, dest, deadline=deadline, stop=stop, access_deadline=access_deadline)
        step = restored.committed.step if restored.committed is not None else None
        decided = AttemptClaim(incarnation=incarnation, attempt=attempt, decided=True, restore_step=step)
        retrying(lambda: store.write_claim(decided), deadline=time.monotonic() + budget,
                 access_deadline=access_deadline, cancelled=cancelled, sleep=sleep,
                 what="recording the restore decision")
        return replace(restored, claims=claims)
    # Node rank 0 downloads before it decides: while its claim says it is at work, wait longer than
    # the restore timeout (a big checkpoint), up to WAIT_FACTOR times it; without any claim, the timeout.
    hard = time.monotonic() + RESTORE_WAIT_FACTOR * budget
    while True:
        claim = retrying(lambda: store.read_claim(incarnation, attempt), deadline=time.monotonic() + budget,
                         access_deadline=access_deadline, cancelled=cancelled, sleep=sleep, what="restore decision")
        if claim is not None and claim.decided:
            break
        if cancelled():
            raise RestoreAgreementError("stopped while waiting for node rank 0's restore decision")
        now = time.monotonic()
        if (claim is None and now > deadline) or now > hard:
            raise RestoreAgreementError("node rank 0 recorded no restore decision for this attempt in time "
                                        "(KUBETRAIN_RESTORE_TIMEOUT_SECONDS)")
        sleep(poll_s)
    restored = restore_newest(store, dest, deadline=time.monotonic() + budget, stop=stop,
                              access_deadline=access_deadline, only_step=claim.restore_step, agreed=True)
    return replace(restored, claims=claims)


def restore_newest(store, dest: Path, *, deadline: float, stop: threading.Event | None = None,
                   access_deadline: float | None = None, only_step: int | None = None,
                   agreed: bool = False) -> Restored:
    """Download the newest COMPLETE checkpoint into `dest`, every file verified; older ones if it is corrupt.

    Temporary storage errors are retried until `deadline`, refused access or a
    missing bucket until `access_deadline` (None: not retried); a checksum
    mismatch marks that checkpoint bad and falls back to the next older one.
    """
    from kubetrain_trainer.decisions import newest_complete
    from kubetrain_trainer.retry import retrying
    from kubetrain_trainer.storage_errors import ChecksumError
    from kubetrain_trainer.commit import CommittedCheckpoint

    cancelled = stop.is_set if stop is not None else (lambda: False)
    sleep = stop.wait if stop is not None else time.sleep  # a SIGTERM cuts a backoff wait short
    remote = retrying(store.list_checkpoints, deadline=deadline, access_deadline=access_deadline,
                      cancelled=cancelled, sleep=sleep, what="listing checkpoints")
    history = frozenset((c.step, *c.manifest.writer) for c in remote if c.manifest is not None)
    bad: set[int] = set()
    if agreed:
        # Exactly the step node rank 0 decided (None: from scratch), never a fallback of our own.
        if only_step is None:
            log.info("node rank 0 decided to start from scratch")
            return Restored(path=None, committed=None, history=history)
        remote = [c for c in remote if c.step == only_step]
        if newest_complete(remote) is None:
            raise RestoreAgreementError(f"checkpoint-{only_step}, which node rank 0 restored for this attempt, "
                                        "is no longer complete in storage")
    while (chosen := newest_complete(remote, exclude=bad)) is not None:
        if stop is not None and stop.is_set():
            break
        manifest = chosen.manifest
        assert manifest is not None
        try:
            path = retrying(lambda: store.download_checkpoint(manifest, dest), deadline=deadline,
                            access_deadline=access_deadline, cancelled=cancelled, sleep=sleep, what="restore")
        except ChecksumError as e:
            if agreed:
                raise RestoreAgreementError(f"checkpoint-{chosen.step}, which node rank 0 restored for this "
                                            f"attempt, failed verification here: {e}") from None
            log.error("checkpoint-%d is corrupt (%s); trying an older one", chosen.step, e)
            bad.add(chosen.step)
            continue
        log.info("restored checkpoint-%d (attempt %d) into %s", chosen.step, manifest.attempt, path)
        committed = CommittedCheckpoint(step=chosen.step, uri=store.checkpoint_uri(chosen.step), time=manifest.created)
        return Restored(path=path, committed=committed, history=history)
    log.info("no complete checkpoint in %s: starting from scratch", store.location.uri)
    return Restored(path=None, committed=None, history=history)


def _upload_final(cfg: LaunchConfig, uploader) -> bool:
    """Node rank 0, after success: the final model to `<uri>/final/`. False when it could not be stored."""
    from kubetrain_trainer.storage_errors import StorageError
    from kubetrain_trainer.final_model import upload_final_model

    step = uploader.last_committed.step if uploader.last_committed else 0
    try:
        upload_final_model(uploader.store, cfg.local_dir, uploader.settings, step=step,
                           deadline=time.monotonic() + cfg.upload_wait_s)
        return True
    except StorageError as e:
        log.error("final model not uploaded: %s", e)
        return False


def _start_sync(cfg: LaunchConfig, stop: threading.Event, telemetry: Telemetry):
    """Restore, then start the uploader and the folder watcher. Returns (uploader, watch, resume_from)."""
    from kubetrain_trainer.retry import Backoff
    from kubetrain_trainer.storage import CheckpointStore, StorageConfig
    from kubetrain_trainer.commit import CommittedCheckpoint, SyncSettings
    from kubetrain_trainer.sync import CheckpointUploader
    from kubetrain_trainer.watcher import FolderWatcher, WatchLoop

    store = CheckpointStore(StorageConfig.from_env(os.environ))
    started = time.monotonic()
    restored = restore_agreed(store, cfg.local_dir, node_rank=cfg.node_rank, incarnation=cfg.incarnation,
                              attempt=cfg.attempt, deadline=started + cfg.restore_timeout_s, stop=stop,
                              access_deadline=started + cfg.access_retry_s)
    telemetry.restored(time.monotonic() - started, restored.committed)
    resume_from, initial, history = restored.path, restored.committed, restored.history
    claims_at_start = restored.claims

    def on_commit(record: CommittedCheckpoint) -> None:
        if cfg.node_rank != 0:
            return
        write_termination_message(cfg.termination_log, record.to_json())

    settings = SyncSettings(
        attempt=cfg.attempt,
        incarnation=cfg.incarnation,
        world_size=cfg.world_size,
        strategy=cfg.strategy,
        node_rank=cfg.node_rank,
        nnodes=cfg.nnodes,
        retention=cfg.retention(),
        backoff=Backoff(initial_s=1.0, maximum_s=30.0),
        history=history,
        claims_at_start=claims_at_start,
    )
    staging = cfg.local_dir.parent / f".{cfg.local_dir.name}.upload-staging"
    uploader = CheckpointUploader(
        store, settings, staging_dir=staging, on_commit=on_commit, initial=initial,
        on_upload=telemetry.uploaded, save_seconds=telemetry.save_seconds,
    ).start()
    telemetry.attach(uploader)
    watcher = FolderWatcher(cfg.local_dir, settle_s=cfg.settle_s, node_rank=cfg.node_rank, mode=cfg.commit_mode)
    stale = watcher.prime()
    if stale:
        log.warning("ignoring local checkpoints left from before this launch: %s", stale)
    return uploader, WatchLoop(watcher, uploader).start(), resume_from


def _signal(p: subprocess.Popen, sig: int, *, group: bool) -> None:
    try:
        if group:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main())
