"""The training container's entrypoint: `python -m kubetrain_trainer.launch [-- command...]`.

It is the trainer side of docs/contract.md, and PID 1 of the pod:

1. read and validate the environment once (`launch_config.py`; a bad value exits 82 naming it);
2. with checkpoint storage, open the pod's checkpoint session (`session.py`): restore the
   newest complete checkpoint, then upload every new `checkpoint-<step>` in the background;
3. start NPROC_PER_NODE workers (plain subprocesses: the launcher owns their
   signals) with RANK/LOCAL_RANK/WORLD_SIZE/... set; the default worker is the
   built-in trainer, `-- cmd...` runs the user's command. The built-in trainer starts
   before the restore (step 2) and waits for its outcome (`handoff.py`): its imports, model
   and process group cost no time after the restore. A user's command may name
   `$(KUBETRAIN_RESUME_FROM)`, so it starts after the restore;
4. forward SIGTERM to the workers, give them what the emergency checkpoint
   needs of the grace period (`grace.py`), then spend the rest uploading it;
5. exit with the contract's code: 0 success, 83 preempted, 82 invalid
   configuration, 84 checkpoint storage unusable, else the worker's code; 1 when the
   workers exited 0 but the training run they reported never ended (`outcome.py`).
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
from pathlib import Path
from typing import Callable, Mapping, Sequence

from kubetrain_trainer import handoff
from kubetrain_trainer.command import expand_command, shown_command
from kubetrain_trainer.exiting import exit_at_once
from kubetrain_trainer.grace import GraceSplit, split_grace
from kubetrain_trainer.launch_config import ConfigError, LaunchConfig, log_level, pod_environ
from kubetrain_trainer.metrics import Telemetry
from kubetrain_trainer.orphans import Orphans, become_subreaper
from kubetrain_trainer.podreport import report_storage_refused
from kubetrain_trainer.outcome import exit_code_for, unfinished_run
from kubetrain_trainer.progress import PROGRESS_FILE_ENV, final_report
from kubetrain_trainer.restore import RestoreAgreementError
from kubetrain_trainer.session import CheckpointSession, SessionConfig
from kubetrain_trainer.storage import CheckpointStore, StorageConfig
from kubetrain_trainer.storage_config import region_hint
from kubetrain_trainer.storage_errors import StorageAccessError, StorageError, StoragePermanentError

from kubetrain_trainer import contract
from kubetrain_trainer.contract import (
    EXIT_INVALID_CONFIG, EXIT_OK, EXIT_PREEMPTED, EXIT_STORAGE, FAILURE_STORAGE_ACCESS_DENIED,
    FAILURE_STORAGE_REQUEST_INVALID,
)

log = logging.getLogger("kubetrain_trainer.launch")


def writable_extensions(base: Mapping[str, str], scratch: Path) -> dict[str, str]:
    """`base` with TORCH_EXTENSIONS_DIR where torch can write: a read-only copy is copied to `scratch` once.

    torch takes a lock file in an extension's build folder even when the op is prebuilt, so the
    image's prebuilt DeepSpeed ops fail to load from a read-only root file system (the pods'
    default) unless they sit in a writable folder. A folder that does not exist (an image built
    without the prebuilt ops still names it) is one torch would create there: `scratch` instead.
    """
    env = dict(base)
    src = env.get("TORCH_EXTENSIONS_DIR")
    if not src:
        return env
    existing = Path(src)
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if os.access(existing, os.W_OK):  # torch can create or lock it where it is
        return env
    if not scratch.exists():
        if Path(src).is_dir():
            shutil.copytree(src, scratch)
        else:
            scratch.mkdir(parents=True)
    env["TORCH_EXTENSIONS_DIR"] = str(scratch)
    return env


def worker_env(cfg: LaunchConfig, local_rank: int, base: Mapping[str, str], resume_from: Path | None,
               outcome_fd: int | None = None) -> dict[str, str]:
    """The environment of one worker: torch.distributed's variables plus ours. `outcome_fd`: the
    worker starts before the restore and reads its outcome from this pipe (`handoff.py`)."""
    env = dict(base)
    env.update({
        contract.RANK: str(cfg.node_rank * cfg.nproc_per_node + local_rank),
        contract.LOCAL_RANK: str(local_rank),
        contract.WORLD_SIZE: str(cfg.world_size),
        contract.LOCAL_WORLD_SIZE: str(cfg.nproc_per_node),
        "GROUP_RANK": str(cfg.node_rank),
        "ROLE_RANK": str(cfg.node_rank * cfg.nproc_per_node + local_rank),
        "ROLE_WORLD_SIZE": str(cfg.world_size),
        contract.MASTER_ADDR: cfg.master_addr,
        contract.MASTER_PORT: str(cfg.master_port),
        contract.LOCAL_CHECKPOINT_DIR: str(cfg.local_dir),
        # The launcher uploads; an in-process CheckpointSyncCallback must not too.
        contract.SYNC_BY_LAUNCHER: "1",
    })
    # As torchrun does: N processes each spawning all-core thread pools thrash.
    if cfg.nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    env.pop(contract.RESUME_FROM, None)
    env.pop(contract.RESTORE_OUTCOME_FD, None)
    if resume_from is not None:
        env[contract.RESUME_FROM] = str(resume_from)
    if outcome_fd is not None:
        env[contract.RESTORE_OUTCOME_FD] = str(outcome_fd)
    # The built-in trainer takes output_dir from KUBETRAIN_LOCAL_CHECKPOINT_DIR
    # unless its arguments name one (then local_dir is that one) and resumes
    # from KUBETRAIN_RESUME_FROM: its arguments are passed through untouched.
    return env


class Workers:
    """The worker processes of this node, with signal forwarding and first-failure tracking."""

    def __init__(self, procs: list[subprocess.Popen], outcome_pipes: list[int] | None = None) -> None:
        self.procs = procs
        self.first_failure: int | None = None
        self._termed = False
        self._outcome_pipes = outcome_pipes or []
        """Write ends of the workers that wait for the restore's outcome (`handoff.py`)."""
        self.orphans = Orphans([p.pid for p in procs])

    @classmethod
    def spawn(cls, cfg: LaunchConfig, base_env: Mapping[str, str], resume_from: Path | None, *,
              before_restore: bool = False) -> "Workers":
        """Start the workers; `before_restore`: they wait for `hand_over(...)` before they train."""
        procs, pipes = [], []
        for local_rank in range(cfg.nproc_per_node):
            read_fd = None
            if before_restore:
                read_fd, write_fd = handoff.open_pipe()
                pipes.append(write_fd)
            env = worker_env(cfg, local_rank, base_env, resume_from, read_fd)
            # Own process group: a terminal's Ctrl-C or a group kill of the
            # launcher reaches workers only through us, exactly once.
            procs.append(subprocess.Popen(expand_command(cfg.command, env), env=env, process_group=0,
                                          pass_fds=(read_fd,) if read_fd is not None else ()))
            if read_fd is not None:
                os.close(read_fd)  # the worker's end: the launcher keeps only its write end
        log.info("started %d worker(s)%s: %s", len(procs), " (they wait for the restore)" if before_restore else "",
                 shown_command(cfg.command, base_env))
        return cls(procs, pipes)

    def hand_over(self, resume_from: Path | None) -> None:
        """Tell the waiting workers what the restore decided: `resume_from`, or None (start fresh)."""
        pipes, self._outcome_pipes = self._outcome_pipes, []
        for fd in pipes:
            handoff.send(fd, resume_from)  # a worker already gone: supervise() reads its exit code

    def stop_before_training(self, wait_s: float = 10.0) -> None:
        """The restore failed or SIGTERM came first: the waiting workers never train. Their pipes close
        without an outcome, they get SIGTERM, and SIGKILL after `wait_s`."""
        pipes, self._outcome_pipes = self._outcome_pipes, []
        for fd in pipes:
            handoff.withhold(fd)
        self.terminate()
        deadline = time.monotonic() + wait_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)  # their exit codes mean nothing here: the launcher reports the restore's failure
        self.kill()

    def poll(self) -> bool:
        """Record exits; True when every worker has exited (a stopping one: its whole process group)."""
        self.orphans.reap()
        groups = None  # read once a stopping worker's leader exited, once per call (/proc may list many)
        for p in self.procs:
            code = p.poll()
            if code is not None and code != 0 and self.first_failure is None:
                self.first_failure = code
                log.warning("worker pid %d exited with %d", p.pid, code)
            if code is not None and self._termed:
                groups = self.orphans.groups() if groups is None else groups
                handed = self.orphans.hand_over(p.pid, groups.get(p.pid, []))
                if handed:
                    log.warning("worker pid %d: its exited process(es) left pid(s) %s running: SIGTERM to them",
                                p.pid, ", ".join(map(str, handed)))
        return all(p.returncode is not None and not (groups and groups.get(p.pid)) for p in self.procs)

    @property
    def all_ok(self) -> bool:
        return all(p.returncode == 0 for p in self.procs)

    @property
    def exited_cleanly(self) -> bool:
        """Every worker exited by itself with success or the contract's "preempted" (no signal, no crash);
        a shell the SIGTERM ended counts by the processes it left (`orphans.py`)."""
        return all(self.orphans.clean(p.pid, p.returncode, (EXIT_OK, EXIT_PREEMPTED), saved=EXIT_PREEMPTED)
                   for p in self.procs)

    def terminate(self) -> None:
        if self._termed:
            return
        self._termed = True
        for p in self.procs:
            if p.poll() is None:
                _signal(p, signal.SIGTERM, group=False)

    def kill(self) -> None:
        groups = self.orphans.groups()
        for p in self.procs:
            if p.poll() is None or groups.get(p.pid):
                log.error("worker pid %d did not stop in time: SIGKILL", p.pid)
                _signal(p, signal.SIGKILL, group=True)
        for p in self.procs:
            p.wait()
        self.orphans.reap()


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
    environ = pod_environ()
    invalid: ConfigError | None = None
    try:
        level = log_level(environ)
    except ConfigError as e:  # reported below, once logging works
        level, invalid = "INFO", e
    logging.basicConfig(level=level, format="%(asctime)s kubetrain-launch %(levelname)s %(message)s")
    for noisy in ("botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if invalid is not None:
            raise invalid
        cfg = LaunchConfig.from_env(environ, argv)
        cfg.make_local_dir()
    except ConfigError as e:
        log.error("invalid configuration: %s", e)
        return EXIT_INVALID_CONFIG

    stop = threading.Event()
    stopped_at: list[float] = []  # when the first SIGTERM came (monotonic): the grace period runs from there

    def on_signal(signum, _frame):
        if not stopped_at:
            stopped_at.append(time.monotonic())
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # The orphans of the workers' processes come to us (as to PID 1): reaped, and stopped.
    if not become_subreaper() and os.getpid() != 1:
        log.warning("cannot become a child subreaper (prctl refused): a shell command's training process "
                    "is not stopped cleanly on SIGTERM (run python directly, or the launcher as PID 1)")
    telemetry = Telemetry.for_pod(attempt=cfg.attempt, incarnation=cfg.incarnation)
    if cfg.metrics_port:
        telemetry.serve(cfg.metrics_port)  # a taken port costs a warning, never the job

    base = writable_extensions(environ, Path(tempfile.gettempdir()) / "kubetrain-torch-extensions")
    base[PROGRESS_FILE_ENV] = str(telemetry.progress_file)  # the workers' progress report (progress.py)
    session: CheckpointSession | None = None
    resume_from: Path | None = None
    early: Workers | None = None
    if cfg.checkpoint_uri:
        if cfg.builtin:  # it reads the restore's outcome from a pipe (handoff.py): start it now
            early = Workers.spawn(cfg, base, None, before_restore=True)
        try:
            if hint := region_hint(storage := StorageConfig.from_env(environ)):
                log.warning("%s", hint)
            session = CheckpointSession(CheckpointStore(storage), session_config(cfg),
                                        telemetry=telemetry, stop=stop)
            restored = session.restore()
            session.start(restored)  # before the hand-over: the watcher primes before any worker saves
            resume_from = restored.path
        except (RestoreAgreementError, StorageError) as e:
            if early is not None:
                early.stop_before_training()
            return _restore_failed(cfg, stop, e)
        except BaseException:  # a bug or an OS error: no worker waiting for the hand-over is left behind
            if early is not None:
                early.stop_before_training()
            raise
    if stop.is_set():
        log.warning("SIGTERM before training started")
        if early is not None:
            early.stop_before_training()
        return EXIT_PREEMPTED

    if early is not None:
        workers = early
        workers.hand_over(resume_from)
    else:
        workers = Workers.spawn(cfg, base, resume_from)
    started = time.monotonic()
    signalled_at = supervise(workers, stop, cfg, telemetry.grace_split)
    code = exit_code_for(first_failure=workers.first_failure, signalled=signalled_at is not None, all_ok=workers.all_ok)
    verdict = unfinished_run(code, final_report(telemetry.progress_file), signalled=signalled_at is not None,
                             exited_ok={p.pid for p in workers.procs if p.returncode == EXIT_OK})
    if verdict.problem:  # a shell that went on after its training process crashed exits 0
        log.error("%s", verdict.problem)
    code = verdict.code
    log.info("workers finished after %.1fs; outcome exit code %d", time.monotonic() - started, code)

    if session is not None:
        # Workers that stopped on their own terms wrote their last folder completely; dead ones may not have.
        # A gang preempted elsewhere (83 here too) needs this node's newest checkpoint first as well.
        session.finish_watching(writers_clean=workers.exited_cleanly and not verdict.writers_unseen,
                                keep_only_newest=stop.is_set() or code == EXIT_PREEMPTED)
        # A finished run waits for its uploads; a failed one saves what it can without holding up the retry for
        # long. A SIGTERM (before or after the workers ended) cuts either wait to its grace period (`_drain`).
        budget = cfg.upload_wait_s if code == EXIT_OK else min(cfg.upload_wait_s, 120.0)
        synced = _drain(session, budget, stop, lambda: _grace_end(stopped_at, cfg),
                        join_after_sigterm_s=split_grace(cfg.grace_s).margin_s / 2)
        final_needed = code == EXIT_OK and cfg.node_rank == 0 and not session.fenced

        def out_of_time() -> bool:
            end = _grace_end(stopped_at, cfg)
            return end is not None and time.monotonic() >= end

        final_ok = not final_needed or (not out_of_time() and session.upload_final(wait_s=cfg.upload_wait_s,
                                                                                   give_up=out_of_time))
        if code == EXIT_OK and stop.is_set() and not (synced and final_ok):
            # The run finished, its outputs are not all stored and the pod is going: the next attempt resumes
            # from the newest checkpoint and stores them. Not a storage failure (it spends no backoffLimit).
            log.warning("SIGTERM before the finished run's checkpoints%s were all in storage: exiting as "
                        "preempted", " and final model" if final_needed else "")
            code = EXIT_PREEMPTED
        elif code == EXIT_OK and not (synced and final_ok):
            log.error("training finished but its last checkpoints are not in storage")
            code = EXIT_STORAGE
    return code


def _grace_end(stopped_at: list[float], cfg: LaunchConfig) -> float | None:
    """When this pod must be done with its uploads after a SIGTERM (monotonic), or None before one."""
    return stopped_at[0] + cfg.grace_s - split_grace(cfg.grace_s).margin_s if stopped_at else None


def _drain(session: CheckpointSession, budget_s: float, stop: threading.Event,
           grace_end: Callable[[], float | None], *, join_after_sigterm_s: float = 1.0) -> bool:
    """Wait up to `budget_s` for the pending uploads, then close the session; True when all are stored.

    A SIGTERM, before the workers ended or during this wait, cuts the wait to the end of the grace
    period (less its exit margin) and keeps only the newest checkpoint: the pod then exits in time
    (a transfer still in flight stops at its next progress callback, its thread is waited for only
    `join_after_sigterm_s`, and `__main__` leaves without joining threads) instead of being SIGKILLed."""
    end = time.monotonic() + budget_s
    trimmed = stop.is_set()  # finish_watching kept only the newest already
    while True:
        if stop.is_set() and not trimmed:
            log.warning("SIGTERM while the last checkpoints upload: only the newest is kept")
            session.keep_only_newest()
            trimmed = True
        cut = grace_end()
        limit = end if cut is None else min(end, cut)
        left = limit - time.monotonic()
        if stop.is_set() and left > 0:
            session.give_way_if_late(left)  # the emergency checkpoint first, when both cannot go out in time
        if left <= 0 or session.wait_uploads(min(left, 0.5)):
            break
    return session.close(0.0, join_s=join_after_sigterm_s if stop.is_set() else 5.0)


def session_config(cfg: LaunchConfig) -> SessionConfig:
    """What the checkpoint session (`session.py`) needs of the launcher's configuration."""
    return SessionConfig(
        local_dir=cfg.local_dir, node_rank=cfg.node_rank, nnodes=cfg.nnodes, world_size=cfg.world_size,
        attempt=cfg.attempt, incarnation=cfg.incarnation, strategy=cfg.strategy, retention=cfg.retention(),
        restore_timeout_s=cfg.restore_timeout_s, access_retry_s=cfg.access_retry_s, settle_s=cfg.settle_s,
        commit_mode=cfg.commit_mode, termination_log=cfg.termination_log,
    )


def _restore_failed(cfg: LaunchConfig, stop: threading.Event, e: RestoreAgreementError | StorageError) -> int:
    """The exit code when the checkpoint session could not start: preempted when SIGTERM came first,
    82 when storage refused this pod (with the failure record), else 84."""
    if stop.is_set():  # the failure is the SIGTERM's consequence
        if isinstance(e, StorageError):
            log.warning("SIGTERM while restoring (%s)", e)
        return EXIT_PREEMPTED
    if isinstance(e, RestoreAgreementError):
        log.error("restore: %s; this pod fails so that the gang restarts and decides again", e)
        return EXIT_STORAGE
    if isinstance(e, StorageAccessError):
        log.error("invalid configuration: checkpoint storage %s refused access (or has no such bucket) "
                  "for %.0fs (KUBETRAIN_S3_AUTH_RETRY_SECONDS): %s", cfg.checkpoint_uri, cfg.access_retry_s, e)
        report_storage_refused(cfg.termination_log, e, reason=FAILURE_STORAGE_ACCESS_DENIED, where=cfg.checkpoint_uri)
        return EXIT_INVALID_CONFIG
    if isinstance(e, StoragePermanentError):
        log.error("invalid configuration: checkpoint storage %s: %s", cfg.checkpoint_uri, e)
        report_storage_refused(cfg.termination_log, e, reason=FAILURE_STORAGE_REQUEST_INVALID, where=cfg.checkpoint_uri)
        return EXIT_INVALID_CONFIG
    log.error("checkpoint storage %s unreachable: %s", cfg.checkpoint_uri, e)
    return EXIT_STORAGE


def _signal(p: subprocess.Popen, sig: int, *, group: bool) -> None:
    try:
        if group:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    try:
        outcome = main()
    except SystemExit as stop:
        outcome = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # a bug: its traceback in the log, and still no wait on the transfer threads
        log.exception("the launcher failed")
        outcome = 1
    # By now the workers are reaped, and the uploads are committed or given up (a commit is atomic: its
    # manifest goes last; an unfinished multipart upload is aborted by the next attempt's retention). The
    # threads are not joined: a transfer still in flight after a SIGTERM (stalled, or between progress
    # callbacks) would hold the pod past its grace period until the kubelet's SIGKILL (137).
    exit_at_once(outcome, join_threads=False)
