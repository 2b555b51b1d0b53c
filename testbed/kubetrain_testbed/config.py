"""Where the testbed lives and what it is made of, decided once.

Every other module of the testbed takes a `TestbedConfig` instead of reading
environment variables itself, so the CLI, the pytest fixtures and the tests of
this package agree on paths, node pools and timeouts by construction.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

#: Repository root: this file is testbed/kubetrain_testbed/config.py.
REPO_ROOT = Path(__file__).resolve().parents[2]

#: The annotation kwok selects the nodes it manages by (its value is "fake").
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"


@dataclass(frozen=True)
class NodePool:
    """A set of identical fake nodes simulated by kwok."""

    name: str
    """Prefix of the node names: `<name>-0`, `<name>-1`, ..."""
    count: int = 4
    cpu: str = "32"
    memory: str = "256Gi"
    pods: str = "110"
    gpus: str = "8"
    """Capacity of the extended resource `nvidia.com/gpu` (string quantity)."""
    labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"NodePool.count must be >= 0, got {self.count}")
        if not self.name or not self.name.replace("-", "").isalnum() or self.name != self.name.lower():
            raise ValueError(
                f"NodePool.name must be a lower-case DNS label prefix (letters, digits, '-'), got {self.name!r}"
            )


@dataclass(frozen=True)
class Timeouts:
    """Upper bounds, in seconds, for each component to become healthy."""

    etcd: float = 30.0
    apiserver: float = 120.0
    controllers: float = 60.0
    """kube-controller-manager, kube-scheduler and kwok."""
    minio: float = 60.0
    nodes_ready: float = 60.0
    kueue: float = 90.0
    """Kueue (optional: `up --kueue`), from its start to ready."""


@dataclass(frozen=True)
class KueueSettings:
    """Kueue's waitForPodsReady settings, what a test may want shorter or longer (kueue.config_document)."""

    pods_ready_timeout: str = "30s"
    """An admitted Workload whose PodsReady stays False this long is evicted (PodsReadyTimeout) and requeued."""
    recovery_timeout: str | None = None
    """The same after PodsReady was True once (WaitForRecovery); Kueue's default is pods_ready_timeout."""
    backoff_base_seconds: int = 5
    """Requeuing backoff after a PodsReadyTimeout eviction: base * 2^(n-1) seconds (Kueue's default: 60)."""
    backoff_max_seconds: int = 60
    backoff_limit_count: int | None = None
    """Requeues before Kueue deactivates the Workload; None: unlimited."""

    @classmethod
    def from_environ(cls, environ: os._Environ[str] | dict[str, str] | None = None) -> "KueueSettings":
        """Defaults, overridden by KUBETRAIN_TESTBED_KUEUE_PODS_READY_TIMEOUT (a Go duration, e.g. "45s")."""
        env = os.environ if environ is None else environ
        timeout = env.get("KUBETRAIN_TESTBED_KUEUE_PODS_READY_TIMEOUT", "").strip()
        return cls(pods_ready_timeout=timeout) if timeout else cls()


@dataclass(frozen=True)
class TestbedConfig:
    """Paths and knobs of one testbed instance (one per repository checkout)."""

    __test__ = False  # not a pytest test class despite its name

    state_dir: Path
    """Holds run/ (logs, pids, data), pki/, kubeconfig and env. Git-ignored."""
    build_script: Path = REPO_ROOT / "testbed" / "build.sh"
    node_pools: tuple[NodePool, ...] = (NodePool(name="kwok-node"),)
    bucket: str = "kubetrain-test"
    node_lease_seconds: int = 10
    """kwok renews node leases every quarter of this."""
    node_monitor_grace_seconds: int = 20
    """After this long without a lease renewal a node is marked NotReady."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    real_node: bool = False
    """Also run the real node (kubelet + containerd + CoreDNS + registry): `up --nodes real`."""
    kueue: bool = False
    """Also run Kueue (kubetrain_testbed.kueue): `up --kueue`."""
    kueue_settings: KueueSettings = field(default_factory=KueueSettings)

    @classmethod
    def from_environ(cls, environ: os._Environ[str] | dict[str, str] | None = None) -> "TestbedConfig":
        """Defaults, overridden by KUBETRAIN_TESTBED_DIR, KUBETRAIN_TESTBED_NODES, KUBETRAIN_TESTBED_REAL_NODE=1,
        KUBETRAIN_TESTBED_KUEUE=1 and KUBETRAIN_TESTBED_KUEUE_PODS_READY_TIMEOUT."""
        env = os.environ if environ is None else environ
        state_dir = Path(env.get("KUBETRAIN_TESTBED_DIR", str(REPO_ROOT / ".testbed"))).resolve()
        nodes_raw = env.get("KUBETRAIN_TESTBED_NODES", "4")
        try:
            count = int(nodes_raw)
        except ValueError:
            raise ValueError(
                f"KUBETRAIN_TESTBED_NODES must be a whole number of fake nodes, got {nodes_raw!r}"
            ) from None
        real = env.get("KUBETRAIN_TESTBED_REAL_NODE", "0")
        if real not in ("0", "1"):
            raise ValueError(f"KUBETRAIN_TESTBED_REAL_NODE must be 0 or 1, got {real!r}")
        kueue = env.get("KUBETRAIN_TESTBED_KUEUE", "0")
        if kueue not in ("0", "1"):
            raise ValueError(f"KUBETRAIN_TESTBED_KUEUE must be 0 or 1, got {kueue!r}")
        return cls(state_dir=state_dir, node_pools=(NodePool(name="kwok-node", count=count),), real_node=real == "1",
                   kueue=kueue == "1", kueue_settings=KueueSettings.from_environ(env))

    # -- derived paths --------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return self.state_dir / "run"

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def env_file(self) -> Path:
        return self.state_dir / "env"

    @property
    def state_file(self) -> Path:
        return self.run_dir / "state.json"

    @property
    def lock_file(self) -> Path:
        return self.state_dir / "lock"

    def log_file(self, component: str) -> Path:
        return self.run_dir / f"{component}.log"

    def bin_dir(self) -> Path:
        """The cache folder build.sh fills (nothing is built by asking)."""
        out = subprocess.run(
            ["bash", str(self.build_script), "--print"], check=True, capture_output=True, text=True
        )
        return Path(out.stdout.strip())
