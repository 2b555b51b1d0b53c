"""Leaving a process without the interpreter's teardown: the built-in trainer's workers and the launcher.

With torch loaded the teardown takes 1-2 s, on the path from SIGTERM to the next attempt, and gloo's
threads can abort it (SIGABRT, "terminate called without an active exception"), so a finished run's
exit status would say a failure. The launcher must also not wait for the teardown's join of its
transfer threads: one still in flight after a SIGTERM would hold the pod past its grace period.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import typing


def exit_at_once(code: int, *, join_threads: bool = True) -> typing.NoReturn:
    """Exit with `code` now, skipping the interpreter's teardown. Everything else a normal exit does is
    kept, in its order: non-daemon threads are joined (unless `join_threads` is False), then the atexit
    handlers run (logging, reporters, multiprocessing), then stdout and stderr are flushed."""
    if join_threads:
        # What Python's own shutdown runs first: threading's exit hooks (they wake idle executor workers,
        # e.g. a ThreadPoolExecutor still alive) and then the join of every non-daemon thread. A bare join
        # would wait forever on an idle executor's workers.
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        else:  # pragma: no cover - CPython has had threading._shutdown since 3.x
            for thread in threading.enumerate():
                if thread is not threading.main_thread() and not thread.daemon:
                    thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def exit_82_on_config_error(error_type: type[BaseException], code: int) -> None:
    """In a worker the launcher started: an uncaught `error_type` (kubetrain's ConfigError, raised by
    TrainingArguments or the Trainer for settings that can never work) ends the process with `code` (82,
    invalid configuration: the job fails at once) after Python's usual traceback, instead of 1 (an
    application failure, retried until backoffLimit for a mistake no retry can fix). A user's own script
    gets this as the built-in trainer does, without catching anything itself."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: typing.Any) -> None:
        previous(exc_type, exc, tb)
        if issubclass(exc_type, error_type):
            print(f"kubetrain: invalid configuration: {exc}", file=sys.stderr)
            exit_at_once(code)

    sys.excepthook = hook
