"""A real local Kubernetes control plane and S3 server for kubetrain's tests.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok (fake
nodes) and MinIO run as local processes on 127.0.0.1, built from source by
testbed/build.sh. `python -m kubetrain_testbed up|down|status|env` drives it;
the pytest fixtures in tests/conftest.py use the same functions.
"""

from .cluster import down, up
from .kueue_run import ensure_kueue, remove_kueue
from .state import ComponentStatus, TestbedEnv, free_port, is_healthy, kubectl, load_env, status
from .config import KueueSettings, NodePool, TestbedConfig
from .nodes import fake_node
from .procs import ComponentFailed, TestbedError
from .waiting import WaitTimeout, wait_until
from .stages import (
    EXIT_CODE_ANNOTATION,
    EXIT_DELAY_ANNOTATION,
    EXIT_MESSAGE_ANNOTATION,
    EXIT_REASON_ANNOTATION,
    NODE_LOST_ANNOTATION,
)

__all__ = [
    "EXIT_CODE_ANNOTATION",
    "EXIT_DELAY_ANNOTATION",
    "EXIT_MESSAGE_ANNOTATION",
    "EXIT_REASON_ANNOTATION",
    "NODE_LOST_ANNOTATION",
    "ComponentFailed",
    "ComponentStatus",
    "KueueSettings",
    "NodePool",
    "TestbedConfig",
    "TestbedEnv",
    "TestbedError",
    "WaitTimeout",
    "down",
    "ensure_kueue",
    "fake_node",
    "free_port",
    "is_healthy",
    "kubectl",
    "load_env",
    "remove_kueue",
    "status",
    "up",
    "wait_until",
]
