"""Command lines of the testbed's server processes, as pure data.

Each `Component` says how to start one server (argv, environment), how to tell
it is healthy (an URL and whether that needs the admin client certificate) and
in which start wave it belongs. Nothing here starts anything, so the flags can
be read, reviewed and unit-tested in one place.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path

from .config import KWOK_NODE_ANNOTATION, TestbedConfig
from . import sts
from .pki import Pki

SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.1/16"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"


@dataclass(frozen=True)
class Ports:
    """Every TCP port the testbed listens on (all on 127.0.0.1)."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int
    minio: int
    minio_console: int

    @classmethod
    def from_dict(cls, raw: dict[str, int]) -> "Ports":
        return cls(**raw)


@dataclass(frozen=True)
class Health:
    url: str
    tls: str = "none"
    """"none": plain HTTP; "admin": verify with the CA and present the admin
    certificate; "insecure": HTTPS with a self-signed serving certificate."""


@dataclass(frozen=True)
class Component:
    name: str
    argv: list[str]
    health: Health
    wave: int
    """Components of one wave start together after the previous wave is healthy."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment (secrets go here, never into argv: argv is visible in ps)."""


def write_kubeconfig(path: Path, *, server: str, pki: Pki, identity: str) -> None:
    """A kubeconfig with the CA and the identity's client certificate embedded (JSON is YAML)."""

    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kubetrain-testbed", "cluster": {"server": server, "certificate-authority-data": b64(pki.ca_crt)}}],
        "users": [{"name": identity, "user": {"client-certificate-data": b64(pki.crt(identity)), "client-key-data": b64(pki.key(identity))}}],
        "contexts": [{"name": "kubetrain-testbed", "context": {"cluster": "kubetrain-testbed", "user": identity}}],
        "current-context": "kubetrain-testbed",
    }
    path.write_text(json.dumps(cfg, indent=2))
    path.chmod(0o600)


def component_kubeconfig(cfg: TestbedConfig, identity: str) -> Path:
    return cfg.pki_dir / f"{identity}.kubeconfig"


def build_components(
    *, cfg: TestbedConfig, bin_dir: Path, pki: Pki, ports: Ports, minio_user: str, minio_password: str
) -> list[Component]:
    """All server processes of the testbed, in start order."""
    run = cfg.run_dir
    kcm_kc = str(component_kubeconfig(cfg, "kube-controller-manager"))
    sched_kc = str(component_kubeconfig(cfg, "kube-scheduler"))
    admin_kc = str(cfg.kubeconfig)
    b = lambda name: str(bin_dir / name)  # noqa: E731
    etcd = Component(
        name="etcd",
        wave=0,
        argv=[
            b("etcd"),
            f"--data-dir={run / 'etcd-data'}",
            f"--listen-client-urls=http://127.0.0.1:{ports.etcd_client}",
            f"--advertise-client-urls=http://127.0.0.1:{ports.etcd_client}",
            f"--listen-peer-urls=http://127.0.0.1:{ports.etcd_peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{ports.etcd_peer}",
            f"--initial-cluster=default=http://127.0.0.1:{ports.etcd_peer}",
            "--unsafe-no-fsync",
            "--quota-backend-bytes=4294967296",
            "--log-level=warn",
        ],
        health=Health(f"http://127.0.0.1:{ports.etcd_client}/health"),
    )
    apiserver = Component(
        name="kube-apiserver",
        wave=1,
        argv=[
            b("kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={ports.apiserver}",
            f"--cert-dir={run / 'apiserver-certs'}",
            f"--tls-cert-file={pki.crt('apiserver')}",
            f"--tls-private-key-file={pki.key('apiserver')}",
            f"--client-ca-file={pki.ca_crt}",
            # Published for the controllers' delegated authentication; without it
            # they log a missing CA bundle forever. No front proxy ever connects.
            f"--requestheader-client-ca-file={pki.ca_crt}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--authorization-mode=RBAC",
            # `kubectl logs/exec` on the real node: its InternalIP (the bridge gateway), not a host name.
            "--kubelet-preferred-address-types=InternalIP,ExternalIP,Hostname",
            "--allow-privileged=true",
            # One tenant, few clients: fairness queues only cost CPU here.
            "--enable-priority-and-fairness=false",
            "--profiling=false",
            "--event-ttl=30m",
            "--v=1",
        ],
        health=Health(f"https://127.0.0.1:{ports.apiserver}/readyz", tls="admin"),
    )
    controller_manager = Component(
        name="kube-controller-manager",
        wave=2,
        argv=[
            b("kube-controller-manager"),
            f"--kubeconfig={kcm_kc}",
            f"--authentication-kubeconfig={kcm_kc}",
            f"--authorization-kubeconfig={kcm_kc}",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports.controller_manager}",
            f"--cert-dir={run / 'kcm-certs'}",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca_crt}",
            f"--cluster-signing-cert-file={pki.ca_crt}",
            f"--cluster-signing-key-file={pki.ca_key}",
            "--use-service-account-credentials=true",
            # "*" = every default controller: garbage collector, namespace,
            # serviceaccount(-token), disruption, node-lifecycle, taint-eviction ...
            "--controllers=*",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--leader-elect=false",
            f"--node-monitor-grace-period={cfg.node_monitor_grace_seconds}s",
            "--node-monitor-period=2s",
            "--kube-api-qps=100",
            "--kube-api-burst=200",
            "--profiling=false",
            "--v=1",
        ],
        health=Health(f"https://127.0.0.1:{ports.controller_manager}/healthz", tls="insecure"),
    )
    scheduler = Component(
        name="kube-scheduler",
        wave=2,
        argv=[
            b("kube-scheduler"),
            f"--kubeconfig={sched_kc}",
            f"--authentication-kubeconfig={sched_kc}",
            f"--authorization-kubeconfig={sched_kc}",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports.scheduler}",
            f"--cert-dir={run / 'scheduler-certs'}",
            "--leader-elect=false",
            "--kube-api-qps=100",
            "--kube-api-burst=200",
            "--profiling=false",
            "--v=1",
        ],
        health=Health(f"https://127.0.0.1:{ports.scheduler}/healthz", tls="insecure"),
    )
    kwok = Component(
        name="kwok",
        wave=2,
        argv=[
            b("kwok"),
            f"--kubeconfig={admin_kc}",
            f"--config={run / 'kwok-stages.yaml'}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
            f"--cidr={POD_CIDR}",
            "--node-ip=10.0.0.1",
            f"--node-lease-duration-seconds={cfg.node_lease_seconds}",
            f"--server-address=127.0.0.1:{ports.kwok}",
        ],
        health=Health(f"http://127.0.0.1:{ports.kwok}/healthz"),
    )
    minio = Component(
        name="minio",
        # After the API server: MinIO reads the OIDC discovery document of its STS roles at start.
        wave=2,
        argv=[
            b("minio"),
            "server",
            "--quiet",
            f"--address=127.0.0.1:{ports.minio}",
            f"--console-address=127.0.0.1:{ports.minio_console}",
            # Only CAs/ inside (the testbed CA, to fetch the discovery document): MinIO stays plain HTTP.
            f"--certs-dir={run / 'minio-certs'}",
            str(run / "minio-data"),
        ],
        env={
            "MINIO_ROOT_USER": minio_user,
            "MINIO_ROOT_PASSWORD": minio_password,
            "MINIO_BROWSER": "off",
            "MINIO_UPDATE": "off",
            "MINIO_CI_CD": "1",
            **sts.minio_env(ports.apiserver),
        },
        health=Health(f"http://127.0.0.1:{ports.minio}/minio/health/live"),
    )
    return [etcd, minio, apiserver, controller_manager, scheduler, kwok]
