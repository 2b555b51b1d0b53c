"""The launcher's HTTP endpoint: Prometheus metrics and the job's live progress (docs/contract.md).

Every training pod's launcher serves, on `KUBETRAIN_METRICS_PORT` (default 9410,
0: off), `GET /metrics` (Prometheus exposition written by prometheus_client from
this launcher's own registry) and `GET /progress` (one small JSON object the
operator polls, so that `kubectl get tj` shows the step without the pods
having any API rights).

Where the numbers come from:
- the workers' progress file (`progress.py`): step, loss, learning rate,
  throughput, step and save times. It is read when scraped, never on a timer;
- the checkpoint uploader (`sync.py`), through two hooks (`uploaded`,
  `save_seconds`) and what it exposes (pending steps, bytes uploaded, the last
  committed checkpoint);
- the restore (`restored`).

No labels: each pod is one scrape target, and Prometheus' service discovery
already attaches namespace, pod and (through the ServiceMonitor's relabeling)
the job's name. Constant labels would repeat them, and an attempt label would
start new series on every restart; the attempt is a gauge instead.

A port that is taken (two pods of the test node agent share 127.0.0.1) costs
one warning and the endpoint, never the job. The handler copies no log text and
no credentials into its answers: only numbers and the last-checkpoint record.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import socketserver
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from .grace import GraceSplit, split_grace
from .manifest import rfc3339
from .progress import Histogram, WorkerProgress, finite_or_none

DEFAULT_PORT = 9410
UPLOAD_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
PROGRESS_KIND = "kubetrain.io/progress"
MAX_PROGRESS_BYTES = 4096

log = logging.getLogger(__name__)


class ProgressFile:
    """The workers' latest report, parsed again only when the file changed (a scrape costs a stat)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._key: tuple[int, int, int] | None = None
        self._report: WorkerProgress | None = None
        self._lock = threading.Lock()

    def read(self) -> WorkerProgress | None:
        with self._lock:
            try:
                st = self.path.stat()
                key = (st.st_ino, st.st_mtime_ns, st.st_size)  # every write is a new file (renamed into place)
                if key != self._key:
                    self._report, self._key = WorkerProgress.from_file(self.path.read_text()), key
            except FileNotFoundError:
                pass  # no report yet: the workers are starting or restoring
            except (OSError, ValueError) as e:
                log.debug("progress file %s unreadable (%s); serving the last good report", self.path, e)
            return self._report


def progress_document(*, worker: WorkerProgress | None, attempt: int, incarnation: int, started_at: float,
                      restored_step: int | None, pending_steps: list[int], committed_step: int | None,
                      last_checkpoint: dict[str, Any] | None) -> dict[str, Any]:
    """The `/progress` object (docs/contract.md). Pure.

    Before the workers' first report the step is the restored checkpoint's (0 without one) and
    `updatedAt` is when the launcher started; `uploadLagSteps` is the newest step saved locally
    and not yet committed minus the newest committed one (0 when nothing is pending).
    """
    w = worker
    newest_pending = max(pending_steps, default=None)
    lag = max(0, newest_pending - (committed_step or 0)) if newest_pending is not None else 0
    doc = {
        "kind": PROGRESS_KIND,
        "step": w.step if w is not None else (restored_step or 0),
        "maxSteps": w.max_steps if w is not None else None,
        "epoch": w.epoch if w is not None else None,
        "loss": w.loss if w is not None else None,
        "learningRate": w.learning_rate if w is not None else None,
        "samplesPerSecond": w.samples_per_second if w is not None else None,
        "tokensPerSecond": w.tokens_per_second if w is not None else None,
        "etaSeconds": w.eta_seconds if w is not None else None,
        "attempt": attempt,
        "incarnation": incarnation,
        "updatedAt": rfc3339(w.time if w is not None else started_at),
        "pendingUploads": len(pending_steps),
        "uploadLagSteps": lag,
        "lastCheckpoint": last_checkpoint,
    }
    return {k: finite_or_none(v) for k, v in doc.items()}


class Telemetry:
    """This pod's metrics registry and progress view; `serve(port)` puts them on HTTP."""

    def __init__(self, *, progress_file: Path, attempt: int, incarnation: int) -> None:
        self.progress_file = progress_file
        self.attempt, self.incarnation = attempt, incarnation
        self.started_at = time.time()
        self.registry = CollectorRegistry()
        self._progress = ProgressFile(progress_file)
        self._uploader: Any = None
        self._restored: Any = None
        self._uploaded_step: int | None = None
        self._uploads = 0
        self._upload_seconds = Histogram.empty(UPLOAD_BUCKETS)
        self._restore_seconds: float | None = None
        # Everything is collected at scrape time (no client-side Counter objects): no `_created`
        # series, and one place that decides what exists.
        self.registry.register(_Collector(self))
        self.server: ThreadingHTTPServer | None = None

    @classmethod
    def for_pod(cls, *, attempt: int, incarnation: int) -> "Telemetry":
        """One launcher's telemetry, with a fresh progress file its workers write (`KUBETRAIN_PROGRESS_FILE`)."""
        path = Path(tempfile.gettempdir()) / f"kubetrain-progress-{os.getpid()}.json"
        path.unlink(missing_ok=True)
        return cls(progress_file=path, attempt=attempt, incarnation=incarnation)

    # ------------------------------------------------------------ hooks
    def attach(self, uploader: Any) -> None:
        """The checkpoint uploader, once started (its pending steps and bytes are read when scraped)."""
        self._uploader = uploader

    def restored(self, seconds: float, committed: Any) -> None:
        """The restore took `seconds`; `committed` is the restored checkpoint's record (None: from scratch)."""
        self._restore_seconds, self._restored = seconds, committed

    def uploaded(self, step: int, size_bytes: int, seconds: float) -> None:
        """The uploader's hook: this node's share of `checkpoint-<step>` is in storage."""
        self._uploads += 1
        self._upload_seconds = self._upload_seconds.observe(seconds)  # immutable: a scrape sees old or new
        self._uploaded_step = max(step, self._uploaded_step or 0)

    def save_seconds(self, step: int) -> float | None:
        """How long the workers took to save `checkpoint-<step>`, when they reported it."""
        report = self._progress.read()
        return report.save_seconds_of(step) if report is not None else None

    def grace_split(self, grace_s: float) -> GraceSplit:
        """The SIGTERM split of `grace_s` with this pod's measured step and save times (grace.py)."""
        report = self._progress.read()
        if report is None:
            return split_grace(grace_s)
        return split_grace(grace_s, step_s=report.step_seconds.mean, save_s=report.slowest_recent_save)

    # ------------------------------------------------------------ views
    def worker(self) -> WorkerProgress | None:
        return self._progress.read()

    def last_checkpoint(self) -> Any:
        up = self._uploader
        return up.last_committed if up is not None else self._restored

    def pending_steps(self) -> list[int]:
        return self._uploader.pending_steps() if self._uploader is not None else []

    def committed_step(self) -> int | None:
        last = self.last_checkpoint()
        steps = [s for s in (last.step if last is not None else None, self._uploaded_step) if s is not None]
        return max(steps, default=None)

    def progress(self) -> dict[str, Any]:
        last = self.last_checkpoint()
        return progress_document(
            worker=self.worker(), attempt=self.attempt, incarnation=self.incarnation, started_at=self.started_at,
            restored_step=self._restored.step if self._restored is not None else None,
            pending_steps=self.pending_steps(), committed_step=self.committed_step(),
            last_checkpoint=json.loads(last.to_json()) if last is not None else None)

    # ------------------------------------------------------------ HTTP
    def serve(self, port: int, *, host: str = "") -> bool:
        """Serve /metrics and /progress on `port` (0: any free port, for tests) in a daemon thread.

        False, after one warning, when the port is taken or cannot be bound: training goes on without it.
        """
        try:
            self.server = _bind(host, port, self)
        except OSError as e:
            taken = e.errno == errno.EADDRINUSE
            log.warning("metrics port %d %s (%s): serving no /metrics or /progress; training goes on",
                        port, "is taken" if taken else "cannot be bound", e.strerror or e)
            return False
        threading.Thread(target=self.server.serve_forever, name="kubetrain-metrics", daemon=True).start()
        log.info("serving /metrics and /progress on port %d", self.server.server_address[1])
        return True

    @property
    def port(self) -> int | None:
        return self.server.server_address[1] if self.server is not None else None

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class _Collector:
    """What is read at scrape time: the workers' report and the uploader's state."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.t = telemetry

    def collect(self) -> Iterator[Metric]:
        t, w = self.t, self.t.worker()
        restored = t._restored.step if t._restored is not None else 0
        yield _gauge("kubetrain_train_global_step", "Optimizer steps taken (the restored step until the "
                     "workers report).", w.step if w is not None else restored)
        yield _gauge("kubetrain_train_attempt", "This pod's attempt (KUBETRAIN_ATTEMPT).", t.attempt)
        if w is not None:
            for name, doc, value in (
                    ("kubetrain_train_max_steps", "Steps this run trains in all.", w.max_steps),
                    ("kubetrain_train_epoch", "Fractional epoch reached.", w.epoch),
                    ("kubetrain_train_loss", "Training loss of the last log record.", w.loss),
                    ("kubetrain_train_learning_rate", "Current learning rate.", w.learning_rate),
                    ("kubetrain_train_samples_per_second", "Samples per second, all ranks together.",
                     w.samples_per_second),
                    ("kubetrain_train_tokens_per_second", "Tokens per second, all ranks together.",
                     w.tokens_per_second),
                    ("kubetrain_train_eta_seconds", "Estimated seconds to max_steps.", w.eta_seconds),
                    ("kubetrain_train_last_report_timestamp_seconds", "When the workers last reported.", w.time)):
                if value is not None:
                    yield _gauge(name, doc, value)
            yield _histogram("kubetrain_train_step_seconds", "Time of one optimizer step.", w.step_seconds)
            yield _histogram("kubetrain_checkpoint_save_seconds", "Time the workers took to save a checkpoint.",
                             w.save_seconds)
        up = t._uploader
        yield CounterMetricFamily("kubetrain_checkpoint_upload_bytes", "Bytes of checkpoint files this pod "
                                  "uploaded.", value=getattr(up, "bytes_uploaded", 0))
        yield CounterMetricFamily("kubetrain_checkpoint_uploads", "Checkpoints whose upload this pod's node "
                                  "completed (node rank 0: committed; other nodes: their part written).",
                                  value=t._uploads)
        yield _histogram("kubetrain_checkpoint_upload_seconds", "From the first upload try to the commit, retries "
                         "included.", t._upload_seconds)
        if t._restore_seconds is not None:
            yield _gauge("kubetrain_checkpoint_restore_seconds", "How long this pod's restore from storage took.",
                         t._restore_seconds)
        pending = t.pending_steps()
        committed = t.committed_step()
        yield _gauge("kubetrain_checkpoint_pending_uploads", "Checkpoints saved locally, not yet in storage.",
                     len(pending))
        lag = max(0, max(pending) - (committed or 0)) if pending else 0
        yield _gauge("kubetrain_checkpoint_upload_lag_steps", "Newest locally saved step minus the newest "
                     "committed one.", lag)
        last = t.last_checkpoint()
        if last is not None:
            yield _gauge("kubetrain_checkpoint_last_committed_step", "Step of the newest committed checkpoint.",
                         last.step)
            if getattr(last, "size_bytes", None) is not None:
                yield _gauge("kubetrain_checkpoint_size_bytes", "Size of the newest committed checkpoint.",
                             last.size_bytes)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=h.cumulative(), sum_value=h.total)


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    timeout = 10  # a client that stalls costs one thread for at most this long

    def do_GET(self) -> None:  # the http.server name
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                body = encoder(self.server.telemetry.registry)
            elif path == "/progress":
                body, content_type = json.dumps(self.server.telemetry.progress()).encode(), "application/json"
            else:
                self.send_error(404, "only /metrics and /progress are served here")
                return
        except Exception:  # a scrape must never take the launcher down
            log.exception("serving %s failed", path)
            self.send_error(500)
            return
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # the http.server signature
        log.debug("%s " + format, self.address_string(), *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_port = False  # never share the port with another pod's launcher: it is "taken"
    telemetry: Telemetry

    def server_bind(self) -> None:
        # Not HTTPServer.server_bind: its getfqdn() may wait for a reverse DNS lookup.
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "kubetrain-launcher", self.server_address[1]


class _Server4(_Server):
    address_family = socket.AF_INET


class _Server6(_Server):
    address_family = socket.AF_INET6


def _bind(host: str, port: int, telemetry: Telemetry) -> _Server:
    """Both IPv4 and IPv6 where the node has both (dual-stack clusters), else IPv4 only."""
    server: _Server
    if not host and socket.has_dualstack_ipv6():
        try:
            server = _Server6(("::", port), _Handler)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise
            server = _Server4(("0.0.0.0", port), _Handler)
    else:
        server = _Server4((host or "0.0.0.0", port), _Handler)
    server.telemetry = telemetry
    return server
