"""The launcher's /metrics and /progress (metrics.py, docs/contract.md "Metrics and progress endpoint").

A real HTTP server on a free loopback port, scraped over HTTP and parsed with
prometheus_client's own parser. The workers' side is a real ProgressTracker
writing the real progress file; the uploader is a stand-in holding the few
numbers the endpoint reads from it (its upload logic is tested in test_ckpt_sync).
"""

from __future__ import annotations

import json
import logging
import math
import re
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubetrain_trainer.launch_config import ConfigError, LaunchConfig
from kubetrain_trainer.metrics import Telemetry, progress_document
from kubetrain_trainer.progress import ProgressTracker, WorkerProgress
from kubetrain_trainer.commit import CommittedCheckpoint

PROGRESS_KEYS = {"kind", "step", "maxSteps", "epoch", "loss", "learningRate", "samplesPerSecond", "tokensPerSecond",
                 "etaSeconds", "attempt", "incarnation", "updatedAt", "pendingUploads", "uploadLagSteps",
                 "lastCheckpoint"}


@dataclass
class UploaderView:
    """What the endpoint reads from a CheckpointUploader."""

    last_committed: CommittedCheckpoint | None = None
    pending: list[int] = field(default_factory=list)
    bytes_uploaded: int = 0

    def pending_steps(self) -> list[int]:
        return list(self.pending)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _get(port: int, path: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.status, r.headers["Content-Type"], r.read().decode()


def _scrape(port: int) -> dict[str, dict[str, float]]:
    """{family name: {sample name + labels: value}} from a real scrape."""
    _status, content_type, text = _get(port, "/metrics")
    assert content_type.startswith("text/plain")
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{le=%s}" % s.labels["le"] if "le" in s.labels else "")
            out.setdefault(family.name, {})[key] = s.value
    return out


@pytest.fixture
def served(tmp_path: Path):
    telemetry = Telemetry(progress_file=tmp_path / "progress.json", attempt=3, incarnation=1796302800)
    assert telemetry.serve(0, host="127.0.0.1")
    yield telemetry
    telemetry.close()


def _train(tracker: ProgressTracker, clock: Clock, steps: range, *, step_s: float, samples: int = 32) -> None:
    for step in steps:
        tracker.step_begin()
        clock.now += step_s
        tracker.step_end(step=step, max_steps=100, epoch=step / 50, samples_per_step=samples,
                         learning_rate=lambda: 1e-3)


def test_a_scrape_shows_the_workers_step_throughput_and_the_uploads(served: Telemetry):
    clock = Clock()
    tracker = ProgressTracker(served.progress_file, clock=clock, wall=lambda: 1_800_000_000.0, tokens_per_sample=64)
    tracker.train_begin(step=0, max_steps=100)
    before = _scrape(served.port)
    assert before["kubetrain_train_global_step"]["kubetrain_train_global_step"] == 0
    assert "kubetrain_train_samples_per_second" not in before  # unknown is absent, not 0

    _train(tracker, clock, range(1, 11), step_s=0.25)  # 10 steps in 2.5 s: written every 4th step (1 s)
    tracker.logged({"loss": 2.5, "learning_rate": 1e-3})
    tracker.saved(8)
    uploader = UploaderView(last_committed=CommittedCheckpoint(step=8, uri="s3://b/p/checkpoint-8", time="t",
                                                               size_bytes=4096),
                            pending=[10], bytes_uploaded=4096)
    served.attach(uploader)
    served.uploaded(8, 4096, 1.5)
    served.restored(0.75, None)
    m = _scrape(served.port)

    assert m["kubetrain_train_global_step"]["kubetrain_train_global_step"] == 10
    assert m["kubetrain_train_max_steps"]["kubetrain_train_max_steps"] == 100
    assert m["kubetrain_train_loss"]["kubetrain_train_loss"] == 2.5
    assert m["kubetrain_train_learning_rate"]["kubetrain_train_learning_rate"] == 1e-3
    samples = m["kubetrain_train_samples_per_second"]["kubetrain_train_samples_per_second"]
    assert samples == pytest.approx(32 / 0.25)  # every step 0.25 s, 32 samples
    assert m["kubetrain_train_tokens_per_second"]["kubetrain_train_tokens_per_second"] == pytest.approx(samples * 64)
    assert m["kubetrain_train_eta_seconds"]["kubetrain_train_eta_seconds"] == pytest.approx((100 - 10) * 0.25)
    steps = m["kubetrain_train_step_seconds"]
    assert steps["kubetrain_train_step_seconds_count"] == 10
    assert steps["kubetrain_train_step_seconds_bucket{le=0.25}"] == 10
    assert steps["kubetrain_train_step_seconds_bucket{le=0.1}"] == 0
    assert steps["kubetrain_train_step_seconds_sum"] == pytest.approx(2.5)
    assert m["kubetrain_checkpoint_save_seconds"]["kubetrain_checkpoint_save_seconds_count"] == 1
    assert m["kubetrain_checkpoint_uploads"]["kubetrain_checkpoint_uploads_total"] == 1
    assert m["kubetrain_checkpoint_upload_bytes"]["kubetrain_checkpoint_upload_bytes_total"] == 4096
    assert m["kubetrain_checkpoint_upload_seconds"]["kubetrain_checkpoint_upload_seconds_sum"] == 1.5
    assert m["kubetrain_checkpoint_pending_uploads"]["kubetrain_checkpoint_pending_uploads"] == 1
    assert m["kubetrain_checkpoint_upload_lag_steps"]["kubetrain_checkpoint_upload_lag_steps"] == 2
    assert m["kubetrain_checkpoint_last_committed_step"]["kubetrain_checkpoint_last_committed_step"] == 8
    assert m["kubetrain_checkpoint_size_bytes"]["kubetrain_checkpoint_size_bytes"] == 4096
    assert m["kubetrain_checkpoint_restore_seconds"]["kubetrain_checkpoint_restore_seconds"] == 0.75
    assert m["kubetrain_train_attempt"]["kubetrain_train_attempt"] == 3
    assert all(name.startswith("kubetrain_") for name in m)


def test_progress_has_exactly_the_contract_keys_and_values(served: Telemetry):
    status, content_type, text = _get(served.port, "/progress")
    assert status == 200 and content_type == "application/json"
    doc = json.loads(text)
    # before the workers report: the restored step (none here), the launcher's start time
    assert set(doc) == PROGRESS_KEYS and doc["kind"] == "kubetrain.io/progress"
    assert doc["step"] == 0 and doc["maxSteps"] is None and doc["lastCheckpoint"] is None
    assert (doc["attempt"], doc["incarnation"]) == (3, 1796302800)
    assert doc["updatedAt"].endswith("Z") and doc["pendingUploads"] == 0 and doc["uploadLagSteps"] == 0

    restored = CommittedCheckpoint(step=40, uri="s3://b/p/checkpoint-40", time="2026-01-01T00:00:00Z")
    served.restored(2.0, restored)
    assert json.loads(_get(served.port, "/progress")[2])["step"] == 40  # what the next step resumes from

    clock = Clock()
    tracker = ProgressTracker(served.progress_file, clock=clock, wall=lambda: 1_800_000_000.0)
    tracker.train_begin(step=40, max_steps=100)
    _train(tracker, clock, range(41, 51), step_s=0.5)
    tracker.logged({"loss": 1.25})
    tracker.saved(50)
    committed = CommittedCheckpoint(step=50, uri="s3://b/p/checkpoint-50", time="2026-01-01T00:01:00Z",
                                    size_bytes=1000, save_seconds=0.0, upload_seconds=2.5)
    served.attach(UploaderView(last_committed=committed, pending=[52, 54]))
    doc = json.loads(_get(served.port, "/progress")[2])
    assert set(doc) == PROGRESS_KEYS
    assert doc["step"] == 50 and doc["maxSteps"] == 100 and doc["epoch"] == 1.0 and doc["loss"] == 1.25
    assert doc["learningRate"] == 1e-3 and doc["samplesPerSecond"] == pytest.approx(64.0)
    assert doc["tokensPerSecond"] is None  # nobody counts tokens in this run
    assert doc["etaSeconds"] == pytest.approx((100 - 50) * 0.5)  # 0.5 s a step, measured at step 50
    assert doc["updatedAt"] == "2027-01-15T08:00:00Z"
    assert doc["pendingUploads"] == 2 and doc["uploadLagSteps"] == 4
    assert doc["lastCheckpoint"] == json.loads(committed.to_json())
    assert doc["lastCheckpoint"]["kind"] == "kubetrain.io/last-checkpoint"
    assert doc["lastCheckpoint"]["uploadSeconds"] == 2.5 and doc["lastCheckpoint"]["sizeBytes"] == 1000


def test_progress_turns_non_finite_numbers_into_null_and_stays_under_4_kib():
    worker = WorkerProgress(time=0.0, step=7, max_steps=10, epoch=0.5, loss=math.nan, learning_rate=math.inf,
                            samples_per_second=-math.inf, eta_seconds=math.nan)
    long_uri = "s3://" + "b" * 63 + "/" + "p" * 1024 + "/" + "n" * 63 + "/" + "j" * 63 + "/checkpoint-9999999999"
    record = json.loads(CommittedCheckpoint(step=9999999999, uri=long_uri, time="2026-01-01T00:00:00Z",
                                            size_bytes=2 ** 50, save_seconds=123.456, upload_seconds=7890.123).to_json())
    doc = progress_document(worker=worker, attempt=2 ** 31, incarnation=2 ** 40, started_at=0.0, restored_step=None,
                            pending_steps=list(range(10)), committed_step=None, last_checkpoint=record)
    assert doc["loss"] is None and doc["learningRate"] is None and doc["samplesPerSecond"] is None
    assert doc["etaSeconds"] is None and doc["epoch"] == 0.5
    text = json.dumps(doc, allow_nan=False)  # strict JSON: would raise on a NaN left in
    assert len(text.encode()) < 4096


@pytest.mark.parametrize("pending, committed, lag", [([], 40, 0), ([60], 40, 20), ([50, 60], None, 60), ([30], 40, 0)])
def test_upload_lag_is_the_newest_pending_step_minus_the_newest_committed(pending, committed, lag):
    doc = progress_document(worker=None, attempt=1, incarnation=0, started_at=0.0, restored_step=None,
                            pending_steps=pending, committed_step=committed, last_checkpoint=None)
    assert doc["uploadLagSteps"] == lag and doc["pendingUploads"] == len(pending)


def test_a_taken_port_logs_one_warning_and_serves_nothing(tmp_path: Path, caplog):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:  # the other pod's launcher on 127.0.0.1
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        telemetry = Telemetry(progress_file=tmp_path / "p.json", attempt=1, incarnation=0)
        with caplog.at_level(logging.WARNING, logger="kubetrain_trainer.metrics"):
            assert telemetry.serve(port, host="127.0.0.1") is False
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and f"metrics port {port} is taken" in warnings[0].getMessage()
        assert telemetry.port is None and telemetry.progress()["step"] == 0  # the launcher goes on


def test_other_paths_are_not_found(served: Telemetry):
    with pytest.raises(urllib.error.HTTPError) as e:
        _get(served.port, "/debug")
    assert e.value.code == 404


def test_a_corrupt_progress_file_serves_the_last_good_report(served: Telemetry):
    tracker = ProgressTracker(served.progress_file)
    tracker.train_begin(step=12, max_steps=20)
    assert served.progress()["step"] == 12
    served.progress_file.write_text('{"format": 1, "step": "many"')
    assert served.progress()["step"] == 12


@pytest.mark.parametrize("value, port", [(None, 9410), ("", 9410), ("0", 0), ("9500", 9500)])
def test_the_metrics_port_comes_from_the_contract_variable(value, port):
    env = {} if value is None else {"KUBETRAIN_METRICS_PORT": value}
    assert LaunchConfig.from_env(env, []).metrics_port == port


@pytest.mark.parametrize("value", ["http", "-1", "70000"])
def test_a_bad_metrics_port_is_an_invalid_configuration_naming_the_variable(value):
    with pytest.raises(ConfigError, match="KUBETRAIN_METRICS_PORT"):
        LaunchConfig.from_env({"KUBETRAIN_METRICS_PORT": value}, [])


@pytest.mark.slow
def test_a_launcher_whose_metrics_port_is_taken_still_runs_its_job(tmp_path: Path):
    """Two pods of the test node agent share 127.0.0.1: the second launcher warns once and trains on."""
    import os
    import subprocess
    import sys

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBETRAIN_", "AWS_"))}
        env.update(NNODES="1", NODE_RANK="0", NPROC_PER_NODE="1", KUBETRAIN_METRICS_PORT=str(port),
                   KUBETRAIN_LOCAL_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
                   KUBETRAIN_TERMINATION_LOG=str(tmp_path / "termination-log"))
        done = subprocess.run([sys.executable, "-m", "kubetrain_trainer.launch", "--", sys.executable, "-c",
                               "import os; print('worker ran', os.environ['KUBETRAIN_PROGRESS_FILE'] != '')"],
                              env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "worker ran True" in done.stdout
    assert done.stderr.count(f"metrics port {port} is taken") == 1


def _contract_section(title: str) -> str:
    text = (Path(__file__).resolve().parents[3] / "docs" / "contract.md").read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_the_contract_lists_exactly_the_metrics_and_progress_keys_served(served: Telemetry):
    section = _contract_section("Metrics and progress endpoint")
    documented = {name for row in section.splitlines() if row.startswith("| `kubetrain_")
                  for name in re.findall(r"`(kubetrain_[a-z_]+)`", row.split("|")[1])}
    tracker = ProgressTracker(served.progress_file, tokens_per_sample=4)
    tracker.train_begin(step=0, max_steps=10)
    tracker.step_begin()
    tracker.step_end(step=1, max_steps=10, epoch=0.1, samples_per_step=2, learning_rate=lambda: 0.1)
    tracker.logged({"loss": 1.0})
    tracker.saved(1)  # forced write: throughput and ETA measured
    served.attach(UploaderView(last_committed=CommittedCheckpoint(step=1, uri="s3://b/p/checkpoint-1", time="t",
                                                                  size_bytes=1)))
    served.restored(0.5, None)
    _status, _type, text = _get(served.port, "/metrics")
    served_names = {f.name + ("_total" if f.type == "counter" else "") for f in text_string_to_metric_families(text)}
    assert served_names == documented

    example = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1).replace("…", ""))
    assert set(example) == PROGRESS_KEYS == set(served.progress())
    record = _contract_section("Reporting the last checkpoint")
    optional = {"sizeBytes", "saveSeconds", "uploadSeconds"}
    assert all(f'"{key}"' in record for key in optional)
    full = CommittedCheckpoint(step=1, uri="s3://b/p/checkpoint-1", time="t", size_bytes=1, save_seconds=0.5,
                               upload_seconds=2.0)
    assert set(json.loads(full.to_json())) == set(example["lastCheckpoint"]) == {"kind", "step", "uri", "time"} | optional
