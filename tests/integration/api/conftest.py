"""Fixtures of the API integration tests: the CRD applied to the real testbed
API server (server-side apply, so every test session serves the current
crds/trainingjob.yaml) and helpers to submit TrainingJobs through it."""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CRD_FILE = ROOT / "crds" / "trainingjob.yaml"
GROUP, VERSION, PLURAL = "kubetrain.io", "v1alpha1", "trainingjobs"


def run_kubectl(testbed, *args: str, input: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """The testbed's kubectl as admin; returns the finished process (the caller checks rc)."""
    argv = [str(Path(testbed.bin_dir) / "kubectl"), f"--kubeconfig={testbed.kubeconfig}", *args]
    return subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def trainingjob_crd(testbed, kube_api):
    """Applies crds/trainingjob.yaml and waits until it is established and served."""
    from kubernetes import client

    proc = run_kubectl(testbed, "apply", "--server-side", "--force-conflicts",
                       "--field-manager=kubetrain-api-tests", "-f", str(CRD_FILE))
    assert proc.returncode == 0, proc.stderr
    proc = run_kubectl(testbed, "wait", "--for=condition=Established", "--timeout=120s",
                       "crd/trainingjobs.kubetrain.io")
    assert proc.returncode == 0, proc.stderr
    # Established says the name is accepted; wait until a list is really served.
    custom = client.CustomObjectsApi(kube_api)
    deadline = time.monotonic() + 120
    while True:
        try:
            custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, limit=1)
            break
        except client.ApiException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    return CRD_FILE


class Rejected(Exception):
    """The API server refused an object; `text` holds its message and causes."""

    def __init__(self, status: int, text: str):
        super().__init__(f"{status}: {text}")
        self.status, self.text = status, text


@pytest.fixture(scope="session")
def api_namespace(kube_api):
    """One namespace for the many dry-run submissions (a fresh one per case only costs time)."""
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    name = f"api-tests-{secrets.token_hex(3)}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=name, labels={"kubetrain.io/test": "true"})))
    yield name
    core.delete_namespace(name, propagation_policy="Background")


@pytest.fixture(scope="session")
def submit(kube_api, trainingjob_crd, api_namespace):
    """submit(obj, dry_run=True, namespace=None) -> the object as stored (defaults applied).

    Raises submit.Rejected. Strict field validation, as `kubectl apply` uses by
    default: unknown fields are errors. Dry runs go to a shared namespace.
    """
    from kubernetes import client

    custom = client.CustomObjectsApi(kube_api)

    def call(obj: dict, *, dry_run: bool = True, namespace: str | None = None) -> dict:
        try:
            return custom.create_namespaced_custom_object(
                GROUP, VERSION, namespace or api_namespace, PLURAL, obj,
                dry_run="All" if dry_run else None, field_validation="Strict")
        except client.ApiException as exc:
            try:
                body = json.loads(exc.body)
                causes = [f"{c.get('field', '')}: {c.get('message', '')}"
                          for c in body.get("details", {}).get("causes", [])]
                text = "\n".join([body.get("message", ""), *causes])
            except (TypeError, ValueError):
                text = str(exc.body)
            raise Rejected(exc.status, text) from None

    call.Rejected = Rejected  # tests say pytest.raises(submit.Rejected): no import of a conftest
    return call
