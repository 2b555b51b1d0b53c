"""Shared pytest fixtures: the real testbed (control plane + kwok + MinIO) on demand.

Every fixture that needs the testbed depends on the session-scoped `testbed`
fixture, which reuses a healthy running testbed (`scripts/testbed.sh up`) or
starts one and stops it again at the end of the session (unless
KUBETRAIN_TESTBED_KEEP=1). Nothing here imports the Kubernetes client or
boto3 at module level, so the unit tier collects and runs without them and
never starts the testbed.

Fixtures:
  testbed_config  TestbedConfig of this checkout (.testbed/ unless KUBETRAIN_TESTBED_DIR)
  testbed         TestbedEnv: kubeconfig path, API URL, S3 endpoint/credentials, bucket, bin folder
  testbed_env     dict for subprocess.run(env=...): os.environ + the testbed's variables, bin folder on PATH
  kubectl         callable: kubectl("get", "pods", "-n", ns, input=None) -> stdout (raises on failure)
  kube_api        kubernetes.client.ApiClient as the testbed admin (session)
  namespace       a fresh namespace (its default ServiceAccount exists), deleted after the test
  s3              boto3 S3 client for MinIO (session)
  s3_prefix       a unique "tests/<test>-<random>/" key prefix in the bucket, emptied after the test
"""

from __future__ import annotations

import os
import re
import secrets
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT / "testbed") not in sys.path:  # works without `pip install -e .` too
    sys.path.insert(0, str(_ROOT / "testbed"))
# Test helpers at tests/' top level (kubetrain_*.py) import by name, under any --import-mode; processes
# started with multiprocessing's `spawn` inherit sys.path, so they import them too.
if str(_ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(_ROOT / "tests"))

# The Kueue fixtures (tests/kubetrain_kueue.py) serve the Kueue integration tests and the real-node e2e tier.
pytest_plugins = ["kubetrain_kueue"]


def _slug(text: str, limit: int) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-") or "t"


@pytest.fixture(scope="session")
def testbed_config():
    from kubetrain_testbed import TestbedConfig

    return TestbedConfig.from_environ()


@pytest.fixture(scope="session")
def testbed(testbed_config):
    """The running testbed's TestbedEnv; fails fast, with the failing component's log tail."""
    from kubetrain_testbed import TestbedError, down, is_healthy, up

    reused = is_healthy(testbed_config)
    try:
        env = up(testbed_config)
    except TestbedError as exc:
        pytest.fail(f"testbed could not start: {exc}", pytrace=False)
    yield env
    if not reused and os.environ.get("KUBETRAIN_TESTBED_KEEP") != "1":
        down(testbed_config)


@pytest.fixture(scope="session")
def testbed_env(testbed) -> dict[str, str]:
    return testbed.subprocess_env()


@pytest.fixture(scope="session")
def kubectl(testbed):
    from kubetrain_testbed import kubectl as run_kubectl

    # A safety net only: a kubectl call on a loaded machine (CPU hogs on every core) may take a while.
    def call(*args: str, input: str | None = None, timeout: float = 180.0) -> str:
        return run_kubectl(testbed, *args, input=input, timeout=timeout)

    return call


@pytest.fixture(scope="session")
def kube_api(testbed):
    from kubernetes import config

    api = config.new_client_from_config(config_file=testbed.kubeconfig)
    yield api
    api.close()


@pytest.fixture
def namespace(request, kube_api):
    """A fresh namespace named after the test; deleted (not awaited) afterwards."""
    from kubernetes import client
    from kubetrain_testbed import wait_until

    core = client.CoreV1Api(kube_api)
    name = f"{_slug(request.node.name, 40)}-{secrets.token_hex(3)}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"kubetrain.io/test": "true"})))
    # Pods are rejected until the serviceaccount controller made `default`.
    wait_until(lambda: core.read_namespaced_service_account("default", name), timeout=120, what=f"ServiceAccount {name}/default")
    yield name
    try:
        core.delete_namespace(name, propagation_policy="Background")
    except client.ApiException as exc:
        if exc.status != 404:
            raise


@pytest.fixture(scope="session")
def s3(testbed):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=testbed.s3_endpoint,
        aws_access_key_id=testbed.access_key,
        aws_secret_access_key=testbed.secret_key,
        region_name=testbed.region,
        config=Config(retries={"max_attempts": 3, "mode": "standard"}),
    )


@pytest.fixture
def s3_prefix(request, s3, testbed) -> str:
    """A key prefix (ending in "/") no other test uses; everything under it is deleted afterwards."""
    prefix = f"tests/{_slug(request.node.name, 60)}-{secrets.token_hex(4)}/"
    yield prefix
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=testbed.bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=testbed.bucket, Delete={"Objects": keys, "Quiet": True})
