"""Kueue as an optional testbed component: its configuration, RBAC and build folder (issue 14)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from kubetrain_testbed import KueueSettings, TestbedConfig
from kubetrain_testbed.kueue import EXTERNAL_FRAMEWORK, IDENTITY, component, config_document, rbac_objects

ROOT = Path(__file__).resolve().parents[3]


def test_config_document_has_the_settings_issue_14_asks_for(tmp_path: Path) -> None:
    doc = config_document(settings=KueueSettings(), health_port=1234, webhook_port=2345, cert_dir=tmp_path)
    assert doc["apiVersion"] == "config.kueue.x-k8s.io/v1beta2" and doc["kind"] == "Configuration"
    assert doc["internalCertManagement"] == {"enable": False}
    assert doc["leaderElection"] == {"leaderElect": False}
    assert doc["metrics"] == {"bindAddress": "0"}
    assert doc["health"] == {"healthProbeBindAddress": "127.0.0.1:1234"}
    assert doc["webhook"] == {"host": "127.0.0.1", "port": 2345, "certDir": str(tmp_path)}
    assert doc["integrations"]["externalFrameworks"] == ["TrainingJob.v1alpha1.kubetrain.io"] == [EXTERNAL_FRAMEWORK]
    assert doc["waitForPodsReady"]["timeout"] == "30s"
    assert doc["waitForPodsReady"]["requeuingStrategy"]["backoffBaseSeconds"] == 5
    assert "recoveryTimeout" not in doc["waitForPodsReady"]
    assert doc["featureGates"] == {"VisibilityOnDemand": False, "UnadmittedWorkloadsObservability": True}


def test_settings_are_configurable(tmp_path: Path) -> None:
    settings = KueueSettings(pods_ready_timeout="12s", recovery_timeout="7s", backoff_base_seconds=1,
                             backoff_limit_count=2)
    wait = config_document(settings=settings, health_port=1, webhook_port=2, cert_dir=tmp_path)["waitForPodsReady"]
    assert wait["timeout"] == "12s" and wait["recoveryTimeout"] == "7s"
    assert wait["requeuingStrategy"]["backoffBaseSeconds"] == 1 and wait["requeuingStrategy"]["backoffLimitCount"] == 2
    assert KueueSettings.from_environ({"KUBETRAIN_TESTBED_KUEUE_PODS_READY_TIMEOUT": "45s"}).pods_ready_timeout == "45s"
    assert KueueSettings.from_environ({}) == KueueSettings()


def test_kueue_is_off_unless_asked() -> None:
    assert TestbedConfig.from_environ({}).kueue is False
    cfg = TestbedConfig.from_environ({"KUBETRAIN_TESTBED_KUEUE": "1",
                                      "KUBETRAIN_TESTBED_KUEUE_PODS_READY_TIMEOUT": "20s"})
    assert cfg.kueue is True and cfg.kueue_settings.pods_ready_timeout == "20s"


def test_component_command_line(tmp_path: Path) -> None:
    c = component(bin_dir=tmp_path, kubeconfig=tmp_path / "k", config_file=tmp_path / "c.yaml", health_port=99)
    assert c.argv[0] == str(tmp_path / "kueue")
    assert f"--config={tmp_path / 'c.yaml'}" in c.argv and f"--kubeconfig={tmp_path / 'k'}" in c.argv
    assert c.health.url == "http://127.0.0.1:99/readyz"


def test_rbac_binds_kueues_own_role_and_trainingjob_reads_to_its_identity() -> None:
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "manager-role"},
            "rules": [{"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["*"]}]}
    secrets = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "manager-secrets-role", "namespace": "system"},
               "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "update", "watch"]}]}
    objs = rbac_objects(role, secrets)
    roles = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ClusterRole"}
    assert roles["kubetrain-testbed:kueue-manager"]["rules"] == role["rules"]
    assert roles["kubetrain-testbed:kueue-trainingjobs"]["rules"] == [
        {"apiGroups": ["kubetrain.io"], "resources": ["trainingjobs"], "verbs": ["get", "list", "watch"]}]
    [ns_role] = [o for o in objs if o["kind"] == "Role"]
    assert ns_role["metadata"] == {"name": "kubetrain-testbed:kueue-manager", "namespace": "kueue-system"}
    assert ns_role["rules"] == secrets["rules"]
    bindings = [o for o in objs if o["kind"] == "ClusterRoleBinding"]
    assert {b["roleRef"]["name"] for b in bindings} == set(roles)
    [ns_binding] = [o for o in objs if o["kind"] == "RoleBinding"]
    assert ns_binding["metadata"]["namespace"] == "kueue-system" and ns_binding["roleRef"]["kind"] == "Role"
    bindings.append(ns_binding)
    assert all(b["subjects"] == [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": IDENTITY.user}]
               for b in bindings)


def test_kueue_builds_into_its_own_folder_and_leaves_the_control_plane_key_alone() -> None:
    def printed(*args: str) -> Path:
        out = subprocess.run(["bash", str(ROOT / "testbed" / "build.sh"), *args, "--print"], check=True,
                             capture_output=True, text=True)
        return Path(out.stdout.strip())

    versions = dict(line.split("=", 1) for line in (ROOT / "testbed" / "versions.env").read_text().splitlines()
                    if line and not line.startswith("#"))
    plane, kueue = printed(), printed("--kueue")
    assert plane.parent.name.startswith(f"k8s-{versions['K8S_VERSION']}_") and "kueue" not in plane.parent.name
    assert kueue.parent.name == f"kueue-{versions['KUEUE_VERSION']}" and kueue.parent.parent == plane.parent.parent
