"""Kueue as an optional testbed component (issue 14): `up --kueue`, or the `kueue` test fixture.

Kueue (sigs.k8s.io/kueue/cmd/kueue, version pinned in versions.env) is built
with its CRDs and its manager ClusterRole by `testbed/build.sh --kueue` into a
cache folder of its own, and started only when asked, on a running control
plane, so the plain testbed neither builds nor starts it.

How it runs here (`config_document` is the whole configuration):

- its own identity, a client certificate `kubetrain-testbed:kueue` bound to
  the module's own manager ClusterRole (config/components/rbac/role.yaml) plus
  read access to TrainingJobs, reached through a kubeconfig like the
  controllers;
- internal certificate management off; the webhook server (127.0.0.1, a free
  port) serves a certificate signed by the testbed CA; no webhook is
  registered with the API server (Workloads are created by the operator, and
  Kueue's pod webhooks must never intercept the other tests' pods);
- leader election off, metrics off, the visibility API server off; health and
  readiness on 127.0.0.1;
- `integrations.externalFrameworks: ["TrainingJob.v1alpha1.kubetrain.io"]`;
- waitForPodsReady with a short timeout and requeuing backoff (config.KueueSettings);
- the UnadmittedWorkloadsObservability gate on: a Workload that waits says why
  with Kueue's granular reasons (ExceedsMaxQuota, WaitingForQuota, ...) instead
  of the generic Pending.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Mapping

from .components import Component, Health, write_kubeconfig
from .config import KueueSettings
from .pki import ClientIdentity, Pki, ensure_client, ensure_serving
from .procs import TestbedError

NAME = "kueue"
IDENTITY = ClientIdentity(name="kueue", user="kubetrain-testbed:kueue")
SERVING_CERT = "kueue-webhook"
NAMESPACE = "kueue-system"
EXTERNAL_FRAMEWORK = "TrainingJob.v1alpha1.kubetrain.io"
MANAGER_ROLE = "kubetrain-testbed:kueue-manager"
TRAININGJOB_READER_ROLE = "kubetrain-testbed:kueue-trainingjobs"
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
"""Kueue v0.19 loads tls.crt/tls.key from here at start whenever internal certificate management is
off, even with metrics off (cmd/kueue/main.go): the testbed puts a certificate there if none exists."""


def config_document(*, settings: KueueSettings, health_port: int, webhook_port: int, cert_dir: Path) -> dict[str, Any]:
    """Kueue's configuration file (config.kueue.x-k8s.io/v1beta2 Configuration; JSON is YAML)."""
    requeuing: dict[str, Any] = {"timestamp": "Eviction", "backoffBaseSeconds": settings.backoff_base_seconds,
                                 "backoffMaxSeconds": settings.backoff_max_seconds}
    if settings.backoff_limit_count is not None:
        requeuing["backoffLimitCount"] = settings.backoff_limit_count
    wait: dict[str, Any] = {"timeout": settings.pods_ready_timeout, "blockAdmission": False,
                            "requeuingStrategy": requeuing}
    if settings.recovery_timeout is not None:
        wait["recoveryTimeout"] = settings.recovery_timeout
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "clientConnection": {"qps": 50, "burst": 100},
        "manageJobsWithoutQueueName": False,
        "waitForPodsReady": wait,
        "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [EXTERNAL_FRAMEWORK]},
        "featureGates": {"VisibilityOnDemand": False, "UnadmittedWorkloadsObservability": True},
    }


def component(*, bin_dir: Path, kubeconfig: Path, config_file: Path, health_port: int) -> Component:
    return Component(
        name=NAME,
        wave=3,
        argv=[str(bin_dir / "kueue"), f"--config={config_file}", f"--kubeconfig={kubeconfig}", "--zap-log-level=info"],
        health=Health(f"http://127.0.0.1:{health_port}/readyz"),
    )


def rbac_objects(manager_role: Mapping[str, Any], secrets_role: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Kueue's own manager ClusterRole (renamed) and secrets Role (in its namespace: MultiKueue's cluster
    credentials), read access to TrainingJobs, all bound to its identity."""
    role = {**manager_role, "metadata": {"name": MANAGER_ROLE}}
    secrets = {**secrets_role, "metadata": {"name": MANAGER_ROLE, "namespace": NAMESPACE}}
    reader = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
              "metadata": {"name": TRAININGJOB_READER_ROLE},
              "rules": [{"apiGroups": ["kubetrain.io"], "resources": ["trainingjobs"],
                         "verbs": ["get", "list", "watch"]}]}

    def binding(name: str, kind: str = "ClusterRole") -> dict[str, Any]:
        meta = {"name": name, "namespace": NAMESPACE} if kind == "Role" else {"name": name}
        return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": f"{kind}Binding", "metadata": meta,
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": IDENTITY.user}]}

    return [role, reader, secrets, binding(MANAGER_ROLE), binding(TRAININGJOB_READER_ROLE),
            binding(MANAGER_ROLE, "Role")]


# ------------------------------------------------------------------ binaries and files


def bin_dir(build_script: Path) -> Path:
    out = subprocess.run(["bash", str(build_script), "--kueue", "--print"], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def ensure_binaries(build_script: Path) -> Path:
    """`build.sh --kueue` (a no-op when cached; its progress goes to stderr); the bin folder."""
    proc = subprocess.run(["bash", str(build_script), "--kueue"], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise TestbedError(f"{build_script} --kueue failed (exit {proc.returncode}); its output is above")
    return Path(proc.stdout.strip().splitlines()[-1])


def crd_dir(kueue_bin: Path) -> Path:
    """The module's config/components/crd/bases, copied by build.sh."""
    return kueue_bin.parent / "crds"


def rbac_file(kueue_bin: Path, name: str) -> Path:
    """The module's config/components/rbac/<name>, copied by build.sh (role.yaml, manager_secrets_role.yaml)."""
    return kueue_bin.parent / "rbac" / name


def prepare_files(*, pki: Pki, run_dir: Path, api_server: str, settings: KueueSettings, health_port: int,
                  webhook_port: int) -> tuple[Path, Path]:
    """Kueue's kubeconfig, webhook certificate folder and configuration file; (kubeconfig, config file)."""
    ensure_client(pki, IDENTITY)
    ensure_serving(pki, SERVING_CERT)
    kubeconfig = pki.root / f"{IDENTITY.name}.kubeconfig"
    write_kubeconfig(kubeconfig, server=api_server, pki=pki, identity=IDENTITY.name)
    cert_dir = run_dir / "kueue-certs"
    cert_dir.mkdir(parents=True, exist_ok=True)
    cert_dir.chmod(0o700)
    shutil.copyfile(pki.crt(SERVING_CERT), cert_dir / "tls.crt")
    shutil.copyfile(pki.key(SERVING_CERT), cert_dir / "tls.key")
    (cert_dir / "tls.key").chmod(0o600)
    _ensure_metrics_cert(pki)
    config_file = run_dir / "kueue-config.yaml"
    doc = config_document(settings=settings, health_port=health_port, webhook_port=webhook_port, cert_dir=cert_dir)
    config_file.write_text(json.dumps(doc, indent=2) + "\n")
    return kubeconfig, config_file


def _ensure_metrics_cert(pki: Pki) -> None:
    crt, key = METRICS_CERT_DIR / "tls.crt", METRICS_CERT_DIR / "tls.key"
    if crt.is_file() and key.is_file():
        return
    try:
        METRICS_CERT_DIR.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pki.crt(SERVING_CERT), crt)
        shutil.copyfile(pki.key(SERVING_CERT), key)
        key.chmod(0o600)
    except OSError as exc:
        raise TestbedError(
            f"Kueue reads {crt} and {key} at start when its internal certificate management is off (even with "
            f"metrics off), and they could not be created ({exc}); create them (any certificate) or run as root"
        ) from exc


def manager_roles(kueue_bin: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The module's manager ClusterRole (role.yaml) and secrets Role (manager_secrets_role.yaml)."""
    return _one(rbac_file(kueue_bin, "role.yaml"), "ClusterRole"), _one(rbac_file(kueue_bin, "manager_secrets_role.yaml"),
                                                                          "Role")


def _one(path: Path, kind: str) -> dict[str, Any]:
    import yaml  # a dependency of the project (pyproject.toml)

    if not path.is_file():
        raise TestbedError(f"{path} is missing: run `testbed/build.sh --kueue`")
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    if len(docs) != 1 or docs[0].get("kind") != kind:
        raise TestbedError(f"{path}: expected one {kind}")
    return docs[0]
