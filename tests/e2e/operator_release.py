"""Installing the operator with its Helm chart into the testbed, as a user would.

The chart's Deployment is placed on the test node agent's node (nodeSelector +
toleration), so the agent runs `kubetrain operator run` as a local process
with a kubeconfig built from a token of the chart's ServiceAccount: whatever
the operator does, it does with exactly the RBAC the chart grants.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from kubetrain_testbed import free_port

from .helpers import AGENT_LABEL, AGENT_PLACEMENT

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kubetrain"
EXAMPLE = REPO / "examples" / "trainingjob.yaml"


def helm(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    out = subprocess.run(["helm", *args], env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out.stdout


@dataclass(frozen=True)
class Release:
    name: str
    namespace: str
    service_account: str


def install(env: dict[str, str], *, release: str, namespace: str, watch_namespaces: list[str], values_dir: Path) -> Release:
    values = {
        "namespaces": watch_namespaces,
        "logLevel": "info",
        # kopf's liveness endpoint binds on this machine: a free port avoids clashes.
        "healthPort": free_port(),
        **{k: v for k, v in AGENT_PLACEMENT.items()},
    }
    path = values_dir / f"{release}-values.json"
    path.write_text(json.dumps(values))
    helm(env, "upgrade", "--install", release, str(CHART), "--namespace", namespace, "--create-namespace",
         "--values", str(path), "--wait", "--timeout", "4m")
    return Release(name=release, namespace=namespace, service_account=_fullname(release))


def _fullname(release: str) -> str:
    return release if "kubetrain" in release else f"{release}-kubetrain"


def uninstall(env: dict[str, str], rel: Release) -> None:
    subprocess.run(["helm", "uninstall", rel.name, "--namespace", rel.namespace, "--wait", "--timeout", "2m"],
                   env=env, capture_output=True, text=True, timeout=180)


def training_job(*, name: str, bucket: str, prefix: str, endpoint: str, args: dict, master_port: int,
                 secret: str = "kubetrain-s3", identity: dict | None = None) -> dict:
    """examples/trainingjob.yaml, pointed at the testbed's MinIO and the agent's node. The pods
    reach the store with the keys of Secret `secret`, or with `identity` instead (spec.checkpoint's
    identity, e.g. {"webIdentity": {...}})."""
    job = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"] = {"name": name}
    spec = job["spec"]
    spec["masterPort"] = master_port
    merged = {**spec["trainer"]["builtin"]["args"], **args}
    spec["trainer"]["builtin"]["args"] = {k: v for k, v in merged.items() if v is not None}  # None: drop the key
    checkpoint = {k: v for k, v in spec.get("checkpoint", {}).items()
                  if k not in ("credentialsSecret", "webIdentity", "ambient")}
    spec["checkpoint"] = {**checkpoint, "uri": f"s3://{bucket}/{prefix.strip('/')}", "endpoint": endpoint,
                          **(identity or {"credentialsSecret": {"name": secret}})}
    tpl = spec.setdefault("podTemplate", {})
    tpl["nodeSelector"] = {**tpl.get("nodeSelector", {}), AGENT_LABEL: "true"}
    tpl["tolerations"] = [*tpl.get("tolerations", []), *AGENT_PLACEMENT["tolerations"]]
    return job
