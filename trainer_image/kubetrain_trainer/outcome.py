"""What this node's workers did, as the contract's exit code (docs/contract.md, "Exit codes").

Their exit codes and the SIGTERM decide (`exit_code_for`), and so does their own word on the
training run (`progress.py`): a shell command that goes on after its training process crashed
(`bash -c "python train.py; echo done"`, a script without `set -e`) exits 0, and the job would
succeed without a model. When the run the workers reported began and never ended, the pod fails
instead (`unfinished_run`). A run that ended counts, whoever ran it: a shell that retries
(`python train.py || python train.py`) succeeds by its last run, and a command whose processes
do not report the end of their run (a custom loop without `train_begin(reports_end=True)`) is
judged by its exit code alone. So is a training process that is itself the worker (no shell
between: the launcher saw its exit): one that stops its run on purpose, catching an exception
and keeping what it has, and exits 0 has chosen success.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from kubetrain_trainer.contract import EXIT_INVALID_CONFIG, EXIT_OK, EXIT_PREEMPTED
from kubetrain_trainer.progress import WorkerProgress

EXIT_UNFINISHED = 1
"""The workers exited 0 but their training run never ended: an application failure (spends backoffLimit)."""


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


@dataclass(frozen=True)
class Verdict:
    """The pod's exit code once the workers' report on their run is weighed (`unfinished_run`)."""

    code: int
    problem: str | None = None
    """Why `code` is not the workers' own outcome, for the log; None when it is."""
    writers_unseen: bool = False
    """The training process stopped where the launcher could not see how (a shell exited 0 after it): its last
    checkpoint folder may be partial, so it counts as written by a worker that died (readiness.py, rule 5)."""


def unfinished_run(code: int, report: WorkerProgress | None, *, signalled: bool,
                   exited_ok: Collection[int] = ()) -> Verdict:
    """`code`, unless the workers exited 0 while the run they reported never ended: then 83 when a SIGTERM
    stopped it (or it stopped after its emergency checkpoint), else 1 (it crashed, and a shell went on).
    `exited_ok`: the pids of the workers that exited 0 themselves; a run of one of them was ended by its own
    choice (no shell hid a crash), though its last folder may be partial all the same."""
    if code != EXIT_OK or report is None or report.run not in ("training", "preempted"):
        return Verdict(code)
    at = f"step {report.step}" + (f" of {report.max_steps}" if report.max_steps else "")
    unseen = report.run == "training"
    if unseen and not signalled and report.pid is not None and report.pid in exited_ok:
        return Verdict(code, writers_unseen=True)
    if signalled or report.run == "preempted":
        return Verdict(EXIT_PREEMPTED, f"the command exited 0, but its training run stopped at {at} for the "
                                       "SIGTERM: exiting as preempted (the next attempt resumes it)", unseen)
    return Verdict(EXIT_UNFINISHED, (
        f"the command exited 0, but its training run never ended (last report: {at}): its training process "
        f"failed and the command went on (a shell without `set -e`, e.g. `python train.py; echo done`); "
        f"exiting {EXIT_UNFINISHED} so that the job does not succeed without its model (see the log above)"), unseen)
