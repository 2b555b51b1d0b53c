"""The Helm chart renders what the operator needs and nothing more: its CRD is
the repository's crds/ file (a symlink, never a twin), RBAC is exactly the
agreed rule set, the Deployment runs `kubetrain operator run` as non-root with
kopf's liveness endpoint, and values.schema.json rejects bad values.
Runs the real helm from the testbed's bin folder (skipped until it is built)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "kubetrain"
CRD_FILE = ROOT / "crds" / "trainingjob.yaml"


def _helm_binary() -> str | None:
    try:
        out = subprocess.run(["bash", str(ROOT / "testbed" / "build.sh"), "--print"],
                             capture_output=True, text=True, timeout=30, check=True)
        candidate = Path(out.stdout.strip()) / "helm"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    except (OSError, subprocess.SubprocessError):
        pass
    return shutil.which("helm")


HELM = _helm_binary()
needs_helm = pytest.mark.skipif(HELM is None, reason="helm not built yet (testbed/build.sh builds it)")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, HELM_CACHE_HOME="/tmp/kubetrain-helm/cache",
               HELM_CONFIG_HOME="/tmp/kubetrain-helm/config", HELM_DATA_HOME="/tmp/kubetrain-helm/data")
    proc = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def render(*sets: str, include_crds: bool = False) -> list[dict]:
    args = ["template", "kt", str(CHART), "--namespace", "kubetrain-system"]
    if include_crds:
        args.append("--include-crds")
    for s in sets:
        args += ["--set-json", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_chart_crds_is_a_symlink_to_the_single_source():
    link = CHART / "crds"
    assert link.is_symlink()
    assert link.resolve() == (ROOT / "crds").resolve()
    assert (link / "trainingjob.yaml").read_bytes() == CRD_FILE.read_bytes()


@needs_helm
def test_helm_lint_is_clean():
    proc = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in proc.stdout, proc.stdout


@needs_helm
def test_rendered_crd_is_the_repository_crd():
    crds = by_kind(render(include_crds=True), "CustomResourceDefinition")
    assert crds == [yaml.safe_load(CRD_FILE.read_text())]


@needs_helm
def test_packaged_chart_contains_the_crd_bytes(tmp_path):
    helm("package", str(CHART), "--destination", str(tmp_path))
    (tgz,) = tmp_path.glob("kubetrain-*.tgz")
    with tarfile.open(tgz) as tar:
        member = tar.extractfile("kubetrain/crds/trainingjob.yaml")
        assert member is not None and member.read() == CRD_FILE.read_bytes()


EXPECTED_RULES = {
    ("kubetrain.io", "trainingjobs"): {"get", "list", "watch", "patch", "update", "delete"},
    ("kubetrain.io", "trainingjobs/status"): {"get", "patch", "update"},
    ("", "pods"): {"get", "list", "watch", "create", "delete"},
    ("", "services"): {"get", "list", "watch", "create", "delete"},
    ("", "configmaps"): {"get", "list", "watch", "create", "delete", "patch"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
    ("", "nodes"): {"get", "list", "watch"},
    ("", "namespaces"): {"list", "watch"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    ("coordination.k8s.io", "leases"): {"get", "create", "update"},
}


def granted(docs: list[dict]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for role in by_kind(docs, "ClusterRole") + by_kind(docs, "Role"):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for res in rule["resources"]:
                    out.setdefault((group, res), set()).update(rule["verbs"])
    return out


@needs_helm
def test_rbac_is_exactly_what_the_operator_needs():
    docs = render()
    assert granted(docs) == EXPECTED_RULES
    (sa,) = by_kind(docs, "ServiceAccount")
    subjects = [s for b in by_kind(docs, "ClusterRoleBinding") for s in b["subjects"]]
    assert len(subjects) == 2  # cluster reads + jobs, cluster-wide by default
    assert all(s == {"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                     "namespace": "kubetrain-system"} for s in subjects)
    (lease_rb,) = by_kind(docs, "RoleBinding")  # Leases, in the release namespace only
    assert lease_rb["metadata"]["namespace"] == "kubetrain-system"
    assert lease_rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                   "name": "kt-kubetrain-leader-election"}
    (role,) = by_kind(docs, "Role")
    assert role["metadata"]["namespace"] == "kubetrain-system"


@needs_helm
def test_watched_namespaces_get_rolebindings_not_cluster_wide_jobs_access():
    docs = render('namespaces=["ml","research"]')
    rbs = [rb for rb in by_kind(docs, "RoleBinding") if rb["roleRef"]["kind"] == "ClusterRole"]
    assert sorted(rb["metadata"]["namespace"] for rb in rbs) == ["ml", "research"]
    assert all(rb["roleRef"]["name"].endswith("-jobs") for rb in rbs)
    crbs = by_kind(docs, "ClusterRoleBinding")
    assert [b["roleRef"]["name"] for b in crbs] == ["kt-kubetrain-cluster"]
    env = {e["name"]: e.get("value") for e in by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KUBETRAIN_NAMESPACES"] == "ml,research"


@needs_helm
def test_deployment_runs_the_operator_non_root_with_liveness():
    (dep,) = by_kind(render('logLevel="debug"', 'defaultTrainerImage="reg.local/trainer:9"',
                            'leaderElection={"enabled":false}'), "Deployment")
    spec = dep["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "kt-kubetrain"
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    assert c["command"] == ["kubetrain", "operator", "run", "--liveness=http://0.0.0.0:8080/healthz"]
    assert c["image"] == "kubetrain/operator:0.1.0"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env == {"KUBETRAIN_NAMESPACES": "", "KUBETRAIN_LOG_LEVEL": "debug",
                   "KUBETRAIN_DEFAULT_IMAGE": "reg.local/trainer:9"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"}]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


@needs_helm
def test_replicas_with_leader_election_stand_by_on_a_lease():
    docs = render("replicaCount=2", 'leaderElection={"enabled":true,"leaseDurationSeconds":20}')
    (dep,) = by_kind(docs, "Deployment")
    spec = dep["spec"]
    assert spec["replicas"] == 2
    # a rolling update starts the new pod as a standby before the old one hands the Lease over
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    env = {e["name"]: e for e in spec["template"]["spec"]["containers"][0]["env"]}
    assert env["KUBETRAIN_LEADER_ELECTION"]["value"] == "true"
    assert env["KUBETRAIN_LEADER_ELECTION_ID"]["value"] == "kt-kubetrain"
    assert env["KUBETRAIN_LEASE_DURATION_SECONDS"]["value"] == "20"
    assert env["KUBETRAIN_LEADER_ELECTION_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["KUBETRAIN_LEADER_ELECTION_IDENTITY"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # what the chart renders, the operator accepts
    from kubetrain.config import Settings

    settings = Settings.from_env({k: e["value"] for k, e in env.items() if "value" in e})
    assert settings.leader_election and settings.lease_duration_seconds == 20


@needs_helm
def test_several_replicas_without_leader_election_are_refused():
    proc = helm("template", "kt", str(CHART), "--set-json", "replicaCount=2",
                "--set-json", 'leaderElection={"enabled":false}', check=False)
    assert proc.returncode != 0
    assert "replicaCount > 1 needs leaderElection.enabled=true" in proc.stderr, proc.stderr


@needs_helm
@pytest.mark.parametrize("value, named", [
    ('logLevel="verbose"', "logLevel"),
    ('namespaces="ml"', "namespaces"),
    ('namespaces=["Not_A_Namespace"]', "namespaces"),
    ('image={"repository":"x","pullPolicy":"Sometimes"}', "pullPolicy"),
    ('healthPort=80', "healthPort"),
    ('replicaCount=0', "replicaCount"),
    ('replicas=3', "replicas"),
    ('leaderElection={"enabled":"yes"}', "enabled"),
    ('leaderElection={"leaseDurationSeconds":1}', "leaseDurationSeconds"),
    ('serviceAccount={"create":"yes"}', "create"),
    ('defaultTrainerImage=""', "defaultTrainerImage"),
])
def test_values_schema_rejects_bad_values(value, named):
    proc = helm("template", "kt", str(CHART), "--set-json", value, check=False)
    assert proc.returncode != 0, f"{value} was accepted"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert named in proc.stderr, proc.stderr
