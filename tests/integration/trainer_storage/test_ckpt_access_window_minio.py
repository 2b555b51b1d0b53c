"""Refused S3 access at start is retried for a bounded window, against a real MinIO (docs/contract.md).

The launcher runs a trivial command (`-- python -c ...`), so only its start-up
restore is under test:
- wrong credentials stay wrong: exit 82 once KUBETRAIN_S3_AUTH_RETRY_SECONDS
  passed, the location and the S3 error named, the secret never printed;
- a bucket that appears after the job started (another controller creating
  it): the restore waits for it, and the command runs.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

WRONG_SECRET = "wrong-secret-" + secrets.token_hex(6)


def _launch(env: dict[str, str], tmp: Path, log: Path, **extra: str) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("KUBETRAIN_", "AWS_"))}
    full.update(env)
    full.update(extra)
    full.update(KUBETRAIN_LOCAL_CHECKPOINT_DIR=str(tmp / "ckpt"), KUBETRAIN_TERMINATION_LOG=str(tmp / "termlog"),
                OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "kubetrain_trainer.launch", "--", sys.executable, "-c",
                             "print('user command ran')"], env=full, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _wait(p: subprocess.Popen, log: Path, timeout: float) -> int:
    try:
        return p.wait(timeout=timeout)  # a safety net, far above the window under test
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        assert p.returncode is not None, log.read_text()[-3000:]


def test_wrong_credentials_fail_with_82_after_the_window_naming_the_location(minio, ckpt_env, tmp_path: Path):
    env = dict(ckpt_env, AWS_SECRET_ACCESS_KEY=WRONG_SECRET)
    log = tmp_path / "launch.log"
    p = _launch(env, tmp_path, log, KUBETRAIN_S3_AUTH_RETRY_SECONDS="4")
    code = _wait(p, log, timeout=180)
    text = log.read_text()
    assert code == 82, text[-3000:]
    assert "retry 1" in text, text[-3000:]  # retried, not failed at first sight
    assert "SignatureDoesNotMatch" in text or "InvalidAccessKeyId" in text, text[-3000:]
    assert ckpt_env["KUBETRAIN_CHECKPOINT_URI"] in text  # the location is named
    assert "KUBETRAIN_S3_AUTH_RETRY_SECONDS" in text
    assert WRONG_SECRET not in text and ckpt_env["AWS_SECRET_ACCESS_KEY"] not in text
    assert "user command ran" not in text


def test_a_bucket_created_after_the_start_is_waited_for(minio, ckpt_env, tmp_path: Path):
    bucket = "late-" + secrets.token_hex(4)
    prefix = ckpt_env["KUBETRAIN_CHECKPOINT_URI"].split("/", 3)[3]
    env = dict(ckpt_env, KUBETRAIN_CHECKPOINT_URI=f"s3://{bucket}/{prefix}")
    log = tmp_path / "launch.log"
    p = _launch(env, tmp_path, log, KUBETRAIN_S3_AUTH_RETRY_SECONDS="300")
    try:
        deadline = time.monotonic() + 120
        while "NoSuchBucket" not in log.read_text():  # the launcher has met the missing bucket
            assert p.poll() is None, f"launcher ended ({p.returncode}):\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        minio.client().create_bucket(Bucket=bucket)
        code = _wait(p, log, timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "no complete checkpoint" in text and "user command ran" in text
