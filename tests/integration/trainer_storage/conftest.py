"""A dedicated MinIO server process for the checkpoint-storage tests.

These tests stop and restart S3 on purpose (the outage test), which must not
disturb the shared testbed's MinIO that other tests use at the same time, so
they start their own MinIO from the testbed's build (`testbed/build.sh
--print`/minio, or KUBETRAIN_MINIO_BIN), on a free port with a throw-away data
folder. Same binary, same real S3 protocol; it starts in about a second.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from kubetrain_testbed import free_port

ROOT = Path(__file__).resolve().parents[3]
USER = "kubetrain-test"
PASSWORD = "kubetrain-test-" + secrets.token_hex(8)


def _minio_binary() -> Path:
    explicit = os.environ.get("KUBETRAIN_MINIO_BIN")
    if explicit:
        return Path(explicit)
    bin_dir = subprocess.run([str(ROOT / "testbed" / "build.sh"), "--print"], capture_output=True, text=True,
                             check=True).stdout.strip()
    return Path(bin_dir) / "minio"


@dataclass
class MinioServer:
    binary: Path
    data: Path
    port: int
    log: Path
    bucket: str = "kubetrain-ckpt-tests"
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "MinioServer":
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(self.data.parent),
               "MINIO_ROOT_USER": USER, "MINIO_ROOT_PASSWORD": PASSWORD, "MINIO_BROWSER": "off"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), "server", "--quiet", f"--address=127.0.0.1:{self.port}",
                 f"--console-address=127.0.0.1:{free_port()}", str(self.data)],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"MinIO exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/minio/health/live", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"MinIO not healthy after {timeout}s:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def env(self, prefix: str) -> dict[str, str]:
        """The pod contract's storage variables for a job whose checkpoints live under `prefix`."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": USER,
            "AWS_SECRET_ACCESS_KEY": PASSWORD,
            "AWS_REGION": "us-east-1",
            "KUBETRAIN_CHECKPOINT_URI": f"s3://{self.bucket}/{prefix}",
        }

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=USER, aws_secret_access_key=PASSWORD,
                            region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))


@pytest.fixture(scope="session")
def minio(tmp_path_factory) -> MinioServer:
    binary = _minio_binary()
    if not binary.is_file():
        pytest.fail(f"MinIO is not built ({binary} missing): run testbed/build.sh (or set KUBETRAIN_MINIO_BIN)",
                    pytrace=False)
    root = tmp_path_factory.mktemp("minio")
    server = MinioServer(binary=binary, data=root / "data", port=free_port(), log=root / "minio.log")
    server.data.mkdir()
    server.start()
    server.client().create_bucket(Bucket=server.bucket)
    yield server
    server.stop()


@pytest.fixture
def ckpt_env(minio: MinioServer, request, monkeypatch) -> dict[str, str]:
    """A unique job prefix; the storage variables are also set in this process's environment."""
    if minio.proc is None or minio.proc.poll() is not None:  # a previous test stopped it
        minio.start()
    prefix = f"{request.node.name[:40].replace('[', '-').replace(']', '')}-{secrets.token_hex(3)}/ns/job"
    env = minio.env(prefix)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env
