"""The launcher's /metrics and /progress while a real 2-process training run checkpoints to a real MinIO.

Scraped over HTTP and parsed with prometheus_client's parser, as Prometheus
and the operator would: the step rises, samples/s is positive, the upload
counter equals the checkpoints committed in MinIO, /progress has the contract's
keys and values. Then MinIO goes away and the pod is preempted: the emergency
checkpoint's step shows up, pending and lagging one step behind the committed one.

Deterministic without timing: the test hook holds training after checkpoint-60
(docs/contract.md, "Test hooks") and, after the SIGTERM, the launcher keeps
serving while it retries the upload that MinIO cannot take.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubetrain_testbed import free_port
from kubetrain_trainer.storage import CheckpointStore, StorageConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HOLD = 60
ARGS = {"max_steps": 400, "save_steps": 20, "use_cpu": True, "per_device_train_batch_size": 8, "logging_steps": 10,
        "report_to": ["none"], "disable_tqdm": True, "vocab_size": 32, "seq_len": 8, "d_model": 16, "n_layers": 1,
        "n_heads": 2, "num_samples": 4096}
PROGRESS_KEYS = {"kind", "step", "maxSteps", "epoch", "loss", "learningRate", "samplesPerSecond", "tokensPerSecond",
                 "etaSeconds", "attempt", "incarnation", "updatedAt", "pendingUploads", "uploadLagSteps",
                 "lastCheckpoint"}


def _get(port: int, path: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return None  # not up yet, or gone


def _metrics(text: str) -> dict[str, float]:
    """sample name -> value (no labels but le, which is not needed here)."""
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if "le" not in s.labels}


def _committed(store: CheckpointStore) -> dict[int, object]:
    return {c.step: c.manifest for c in store.list_checkpoints() if c.complete}


def test_scrapes_follow_training_uploads_and_a_preemption(minio, ckpt_env, tmp_path: Path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBETRAIN_")}
    env.update(ckpt_env)
    env.update(NNODES="1", NODE_RANK="0", NPROC_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1", KUBETRAIN_ATTEMPT="2", KUBETRAIN_JOB_INCARNATION="1796302800",
               KUBETRAIN_BUILTIN_TASK="causal-lm", KUBETRAIN_TRAINER_ARGS=json.dumps(ARGS),
               KUBETRAIN_LOCAL_CHECKPOINT_DIR=str(tmp_path / "ckpt"), KUBETRAIN_METRICS_PORT=str(port),
               KUBETRAIN_TERMINATION_LOG=str(tmp_path / "termination-log"),
               KUBETRAIN_TERMINATION_GRACE_SECONDS="30", KUBETRAIN_TEST_HOLD_AT_STEP=str(HOLD))
    log = tmp_path / "launcher.log"
    store = CheckpointStore(StorageConfig.from_env(ckpt_env))
    p = subprocess.Popen([sys.executable, "-m", "kubetrain_trainer.launch"], env=env,
                         stdout=open(log, "w"), stderr=subprocess.STDOUT)
    steps: list[int] = []
    try:
        # 1. Training up to the hold: every scrape parses, the step never goes back.
        deadline = time.monotonic() + 300  # a safety net on a loaded machine
        while True:
            assert p.poll() is None, f"the launcher ended early ({p.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            text, progress = _get(port, "/metrics"), _get(port, "/progress")
            if text is not None and progress is not None:
                m, doc = _metrics(text), json.loads(progress)
                steps.append(int(m["kubetrain_train_global_step"]))
                # Every commit counted once. A checkpoint the next one superseded before its upload began
                # (the watcher may find checkpoint-20, 40 and 60 at once: 60 steps take a second) is never
                # uploaded nor counted, so the count is MinIO's, not HOLD // 20.
                committed = _committed(store)
                if (doc["step"] == HOLD and doc["pendingUploads"] == 0 and HOLD in committed
                        and m["kubetrain_checkpoint_uploads_total"] == len(committed)):
                    break
            time.sleep(0.2)
        assert steps == sorted(steps) and steps[-1] == HOLD
        assert m["kubetrain_train_samples_per_second"] > 0 and m["kubetrain_train_tokens_per_second"] > 0
        assert m["kubetrain_train_max_steps"] == 400 and m["kubetrain_train_loss"] > 0
        assert m["kubetrain_train_step_seconds_count"] >= HOLD and m["kubetrain_checkpoint_save_seconds_count"] == 3
        committed = _committed(store)
        assert m["kubetrain_checkpoint_upload_bytes_total"] == sum(c.total_bytes for c in committed.values())
        assert m["kubetrain_checkpoint_upload_seconds_count"] == len(committed) and m["kubetrain_train_attempt"] == 2
        assert set(doc) == PROGRESS_KEYS and doc["kind"] == "kubetrain.io/progress"
        assert (doc["maxSteps"], doc["attempt"], doc["incarnation"]) == (400, 2, 1796302800)
        assert doc["samplesPerSecond"] > 0 and doc["loss"] > 0 and doc["etaSeconds"] > 0
        assert doc["uploadLagSteps"] == 0 and doc["updatedAt"].endswith("Z")
        last = doc["lastCheckpoint"]
        assert last["kind"] == "kubetrain.io/last-checkpoint" and last["step"] == HOLD
        assert last["uri"].endswith(f"/checkpoint-{HOLD}") and last["sizeBytes"] == committed[HOLD].total_bytes
        assert last["uploadSeconds"] >= 0 and last["saveSeconds"] >= 0
        assert len(progress.encode()) < 4096

        # 2. Preempted with S3 gone: the emergency checkpoint (step 61) is saved, pending, one step behind.
        minio.stop()
        p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 120
        while True:
            assert p.poll() is None, f"the launcher ended before it showed step {HOLD + 1}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            progress = _get(port, "/progress")
            doc = json.loads(progress) if progress else None
            if doc is not None and doc["step"] == HOLD + 1 and doc["pendingUploads"] == 1:
                break
            time.sleep(0.1)
        assert doc["uploadLagSteps"] == 1 and doc["lastCheckpoint"]["step"] == HOLD
        m = _metrics(_get(port, "/metrics") or "")
        assert m["kubetrain_train_global_step"] == HOLD + 1 and m["kubetrain_checkpoint_upload_lag_steps"] == 1
        assert p.wait(timeout=120) == 83, log.read_text()[-4000:]
    finally:
        if p.poll() is None:
            p.kill()
        if minio.proc is None:
            minio.start()
    report = json.loads((tmp_path / "termination-log").read_text())
    assert report["step"] == HOLD and report["sizeBytes"] == committed[HOLD].total_bytes
    assert _get(port, "/progress") is None  # the endpoint ends with the launcher
