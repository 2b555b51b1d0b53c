"""The Helm chart renders what the operator needs and nothing more: its CRD is
the repository's crds/ file (a symlink, never a twin), RBAC grants exactly what
the operator's code calls (derived from the code by tests/kubetrain_rbac.py) and
only in the namespaces it manages, the Deployment runs `kubetrain operator run`
as non-root with kopf's liveness endpoint (also its readiness probe, which a
standby passes), and values.schema.json rejects bad values.
Runs the real helm from the testbed's bin folder (skipped until it is built)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

import kubetrain_rbac

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


def render(*sets: str, include_crds: bool = False, api_versions: tuple[str, ...] = ()) -> list[dict]:
    args = ["template", "kt", str(CHART), "--namespace", "kubetrain-system"]
    if include_crds:
        args.append("--include-crds")
    for v in api_versions:
        args += ["--api-versions", v]
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


RELEASE_NS = "kubetrain-system"


def expected_grants(*, managed: list[str] | None, leader_election: bool = True) -> dict:
    """What the chart must grant, from what the code calls (tests/kubetrain_rbac.py):
    `managed` namespaces get the namespaced uses (None: cluster-wide), the release
    namespace the Lease, the cluster the cluster-scoped reads."""
    use = kubetrain_rbac.used()
    out: dict = {None: {k: set(v) for k, v in use[kubetrain_rbac.CLUSTER].items()}}
    for ns in managed if managed is not None else [None]:
        for key, verbs in use[kubetrain_rbac.WATCHED].items():
            out.setdefault(ns, {}).setdefault(key, set()).update(verbs)
    if leader_election:
        for key, verbs in use[kubetrain_rbac.OWN].items():
            out.setdefault(RELEASE_NS, {}).setdefault(key, set()).update(verbs)
    return out


def assert_same_grants(docs: list[dict], expected: dict) -> None:
    got = kubetrain_rbac.granted(docs)
    problems = []
    for where in sorted(set(got) | set(expected), key=str):
        scope = where or "cluster-wide"
        have, need = got.get(where, {}), expected.get(where, {})
        for (group, res) in sorted(set(have) | set(need)):
            extra = have.get((group, res), set()) - need.get((group, res), set())
            missing = need.get((group, res), set()) - have.get((group, res), set())
            if extra:
                problems.append(f"{scope}: {group or 'core'}/{res} {sorted(extra)} granted, never called by the code")
            if missing:
                problems.append(f"{scope}: {group or 'core'}/{res} {sorted(missing)} called by the code, not granted")
    assert not problems, "\n".join(problems)


def test_the_derived_uses_cover_every_part_of_the_operator():
    """The derivation found the calls of each module that talks to the API (a broken
    parser that finds nothing would make the chart comparison meaningless)."""
    where = {u.where.split(":")[0].split(" ")[0] for u in kubetrain_rbac.uses()}
    assert {"k8s", "informer", "leader", "handlers", "builders"} <= where, where
    use = kubetrain_rbac.used()
    assert "create" in use[kubetrain_rbac.WATCHED][("", "pods")]
    cluster = dict(use[kubetrain_rbac.CLUSTER])
    assert cluster.pop(("", "nodes")) == {"list", "watch"}
    # Besides the nodes, only reads of Kueue's cluster-scoped objects (issue 14); kopf scanning stays off.
    assert cluster == {("kueue.x-k8s.io", "resourceflavors"): {"get"}, ("kueue.x-k8s.io", "workloadpriorityclasses"):
                       {"get"}, ("scheduling.k8s.io", "priorityclasses"): {"get"}}, "kopf scanning must stay off"


@pytest.mark.parametrize("snippet, expected", [
    ("api.core.patch_namespaced_pod(name, ns, body)", [("managed namespaces", "", "pods", "patch")]),
    ("api.call('x', api.core.read_namespaced_secret, name, ns)", [("managed namespaces", "", "secrets", "get")]),
    ("api.call('x', api.custom.list_namespaced_custom_object, GROUP, VERSION, ns, PLURAL)",
     [("managed namespaces", "kubetrain.io", "trainingjobs", "list")]),
    ("def f(**kw):\n    return core.list_config_map_for_all_namespaces(**kw)\nf(watch=True)",
     [("managed namespaces", "", "configmaps", "list"), ("managed namespaces", "", "configmaps", "watch")]),
    ("api.core.delete_collection_namespaced_pod(ns)", [("managed namespaces", "", "pods", "deletecollection")]),
    ("api.core.read_node(name)", [("cluster", "", "nodes", "get")]),
])
def test_the_derivation_reads_calls_from_code(snippet, expected):
    import ast

    from kubernetes import client

    tree = ast.parse(snippet)
    found = kubetrain_rbac._client_uses("k8s", tree, [client.CoreV1Api, client.CustomObjectsApi])
    assert sorted(u.key for u in found) == sorted(expected)


@needs_helm
@pytest.mark.parametrize("sets, managed, leader_election", [
    ((), [RELEASE_NS], True),
    (('namespaces=["ml","research"]',), ["ml", "research"], True),
    (('namespaces=["ml"]', 'leaderElection={"enabled":false}'), ["ml"], False),
    (("clusterWide=true",), None, True),
], ids=["default: the release namespace", "listed namespaces", "no leader election", "cluster-wide"])
def test_rbac_grants_exactly_what_the_code_calls(sets, managed, leader_election):
    """Both ways: every (resource, verb) the operator's code calls is granted where it calls it,
    and every granted verb is one the code calls. No rights in namespaces it does not manage."""
    docs = render(*sets)
    assert_same_grants(docs, expected_grants(managed=managed, leader_election=leader_election))
    (dep,) = by_kind(docs, "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KUBETRAIN_NAMESPACES"] == ",".join(managed or [])
    from kubetrain.config import Settings

    assert Settings.from_env({"KUBETRAIN_NAMESPACES": env["KUBETRAIN_NAMESPACES"]}).namespaces == tuple(managed or ())


@needs_helm
def test_only_the_release_lease_can_be_read_or_written():
    docs = render()
    (role,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"].endswith("-leader-election")]
    assert role["metadata"]["namespace"] == RELEASE_NS
    (dep,) = by_kind(docs, "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    for rule in role["rules"]:
        assert rule["verbs"] == ["create"] or rule["resourceNames"] == [env["KUBETRAIN_LEADER_ELECTION_ID"]], rule


@needs_helm
def test_all_bindings_name_the_chart_serviceaccount_only():
    docs = render('namespaces=["ml"]')
    (sa,) = by_kind(docs, "ServiceAccount")
    subjects = [s for b in by_kind(docs, "ClusterRoleBinding") + by_kind(docs, "RoleBinding") for s in b["subjects"]]
    assert subjects and all(s == {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": RELEASE_NS}
                            for s in subjects)


@needs_helm
def test_cluster_wide_with_listed_namespaces_is_refused():
    proc = helm("template", "kt", str(CHART), "--set-json", "clusterWide=true", "--set-json", 'namespaces=["ml"]',
                check=False)
    assert proc.returncode != 0
    assert "clusterWide=true manages every namespace" in proc.stderr, proc.stderr


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
    assert env == {"KUBETRAIN_NAMESPACES": "kubetrain-system", "KUBETRAIN_LOG_LEVEL": "debug",
                   "KUBETRAIN_DEFAULT_IMAGE": "reg.local/trainer:9", "KUBETRAIN_METRICS_PORT": "9400",
                   "KUBETRAIN_PROGRESS_INTERVAL_SECONDS": "30", "KUBETRAIN_PROGRESS_TIMEOUT_SECONDS": "3",
                   "KUBETRAIN_PROGRESS_CONCURRENCY": "16"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"},
                          {"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
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
@pytest.mark.parametrize("values", [(), ("replicaCount=3",), ('leaderElection={"enabled":false}',), ("healthPort=9090",)],
                         ids=["default", "standbys", "no leader election", "another port"])
def test_the_readiness_probe_asks_what_a_standby_answers_too(values):
    """Ready means: started, settings valid, answering the health endpoint, as the leader or as a standby.
    Before: no readinessProbe, so a new pod counted as Ready (and a rolling update with maxUnavailable 0 went on
    to stop the old leader) as soon as its container started, even one about to exit on a bad setting."""
    (dep,) = by_kind(render(*values), "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    probe = c["readinessProbe"]
    # The one path both servers answer: the standby's own (cli._standby_health answers 200 whoever leads: a
    # probe that needed leadership would hold a rolling update and `helm install --wait` with replicaCount > 1
    # forever) and kopf's once this replica leads. Any other path answers 404 from both.
    liveness_url = next(a for a in c["command"] if a.startswith("--liveness="))
    assert probe["httpGet"] == {"path": "/healthz", "port": "health"} == c["livenessProbe"]["httpGet"]
    assert liveness_url.endswith(f":{c['ports'][0]['containerPort']}/healthz") and c["ports"][0]["name"] == "health"
    # A standby that takes over stops its server before kopf binds the port (a second or two): not NotReady for it.
    assert probe["periodSeconds"] * (probe["failureThreshold"] - 1) >= 10
    assert "initialDelaySeconds" not in probe  # Ready as soon as it answers


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
    ('healthBindAddress="::"', "healthBindAddress"),
    ('replicaCount=0', "replicaCount"),
    ('replicas=3', "replicas"),
    ('clusterWide="yes"', "clusterWide"),
    ('leaderElection={"enabled":"yes"}', "enabled"),
    ('leaderElection={"leaseDurationSeconds":1}', "leaseDurationSeconds"),
    ('serviceAccount={"create":"yes"}', "create"),
    ('defaultTrainerImage=""', "defaultTrainerImage"),
    ('image={"repository":"x","digest":"sha256:abc"}', "digest"),
    ('image={"repository":"x","digest":"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}', "digest"),
    ('metrics={"port":80}', "port"),
    ('podSecurityContext="restricted"', "podSecurityContext"),
    ('securityContext=[]', "securityContext"),
])
def test_values_schema_rejects_bad_values(value, named):
    proc = helm("template", "kt", str(CHART), "--set-json", value, check=False)
    assert proc.returncode != 0, f"{value} was accepted"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert named in proc.stderr, proc.stderr


@needs_helm
@pytest.mark.parametrize("address", ["0.0.0.0", "[::]"])
def test_the_liveness_endpoint_binds_the_address_the_clusters_ip_family_needs(address):
    docs = render(f"healthBindAddress={json.dumps(address)}")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert f"--liveness=http://{address}:8080/healthz" in command


@needs_helm
def test_kueue_admission_policy_is_shipped_unless_turned_off():
    kinds = {d["kind"] for d in render()}
    assert {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "Deployment"} <= kinds
    assert not {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} & {
        d["kind"] for d in render("kueue={\"admissionPolicy\":false}")}


@needs_helm
@pytest.mark.parametrize("kube_version, installs", [("1.29.15", False), ("1.30.0", True), ("1.37.2", True)])
def test_the_chart_refuses_a_cluster_older_than_its_crd_needs(kube_version, installs):
    """The API server of 1.29 and older refuses the CRD (tests/integration/api/test_crd_kubernetes_versions.py):
    helm says so, naming the version needed, before it installs anything."""
    proc = helm("template", "kt", str(CHART), "--kube-version", kube_version, check=False)
    if installs:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode != 0
        assert f"chart requires kubeVersion: >=1.30.0-0 which is incompatible with Kubernetes v{kube_version}" \
            in proc.stderr, proc.stderr


@needs_helm
@pytest.mark.parametrize("sets, env, message", [
    (('leaderElection={"leaseDurationSeconds":10}',), {"KUBETRAIN_LEASE_DURATION_SECONDS": "10"},
     "leaderElection.renewDeadlineSeconds (10) must be below leaderElection.leaseDurationSeconds (10)"),
    (('leaderElection={"leaseDurationSeconds":20,"renewDeadlineSeconds":25}',),
     {"KUBETRAIN_LEASE_DURATION_SECONDS": "20", "KUBETRAIN_RENEW_DEADLINE_SECONDS": "25"},
     "leaderElection.renewDeadlineSeconds (25) must be below leaderElection.leaseDurationSeconds (20)"),
    (('leaderElection={"retryPeriodSeconds":10}',), {"KUBETRAIN_RETRY_PERIOD_SECONDS": "10"},
     "leaderElection.retryPeriodSeconds (10) must be below leaderElection.renewDeadlineSeconds (10)"),
    (('progress={"timeoutSeconds":16}',), {"KUBETRAIN_PROGRESS_TIMEOUT_SECONDS": "16"},
     "progress.timeoutSeconds (16) must be at most half of progress.intervalSeconds (30)"),
    (('progress={"intervalSeconds":5,"timeoutSeconds":2.6}',),
     {"KUBETRAIN_PROGRESS_INTERVAL_SECONDS": "5", "KUBETRAIN_PROGRESS_TIMEOUT_SECONDS": "2.6"},
     "progress.timeoutSeconds (2.6) must be at most half of progress.intervalSeconds (5)"),
], ids=["renew = lease", "renew > lease", "retry = renew", "timeout > interval/2 (default interval)",
        "timeout > interval/2"])
def test_settings_the_operator_refuses_at_start_are_refused_at_install(sets, env, message):
    """The operator's start-up checks (kubetrain/config.py) that the schema cannot express: refused by
    the chart, naming the values, instead of a pod that crash-loops."""
    from kubetrain.config import ConfigError, Settings

    with pytest.raises(ConfigError):
        Settings.from_env({"KUBETRAIN_LEADER_ELECTION": "true", **env})
    proc = helm("template", "kt", str(CHART), *[a for s in sets for a in ("--set-json", s)], check=False)
    assert proc.returncode != 0, f"{sets} was accepted"
    assert message in proc.stderr, proc.stderr


@needs_helm
@pytest.mark.parametrize("sets", [
    ('leaderElection={"leaseDurationSeconds":2.5,"renewDeadlineSeconds":2,"retryPeriodSeconds":0.5}',),
    ('leaderElection={"enabled":false,"leaseDurationSeconds":10}',),  # not used without leader election
    ('progress={"intervalSeconds":6,"timeoutSeconds":3}',),  # exactly half
    ('progress={"intervalSeconds":0,"timeoutSeconds":60}',),  # reading off: the timeout is unused
], ids=["fractions", "leader election off", "timeout = interval/2", "progress off"])
def test_settings_at_the_limits_render_and_the_operator_accepts_them(sets):
    from kubetrain.config import Settings

    (dep,) = by_kind(render(*sets), "Deployment")
    env = {e["name"]: e["value"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}
    Settings.from_env(env)


@needs_helm
@pytest.mark.parametrize("sets, message", [
    (("metrics={\"port\":8080}",), "metrics.port and healthPort are both 8080"),
    (("healthPort=9400",), "metrics.port and healthPort are both 9400"),
    (('serviceAccount={"create":false}',), "serviceAccount.create=false needs serviceAccount.name"),
], ids=["metrics.port = healthPort", "healthPort = metrics.port", "no ServiceAccount to run as"])
def test_values_that_cannot_run_are_refused(sets, message):
    proc = helm("template", "kt", str(CHART), *[a for s in sets for a in ("--set-json", s)], check=False)
    assert proc.returncode != 0, f"{sets} was accepted"
    assert message in proc.stderr, proc.stderr


@needs_helm
def test_an_existing_serviceaccount_is_used_and_not_created():
    docs = render('serviceAccount={"create":false,"name":"ops"}')
    assert not by_kind(docs, "ServiceAccount")
    (dep,) = by_kind(docs, "Deployment")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    subjects = [s for b in by_kind(docs, "ClusterRoleBinding") + by_kind(docs, "RoleBinding") for s in b["subjects"]]
    assert subjects and all(s["name"] == "ops" for s in subjects)


DIGEST = "sha256:" + "0123456789abcdef" * 4


@needs_helm
def test_image_digest_pins_the_image_and_replaces_the_tag():
    (dep,) = by_kind(render(f'image={{"repository":"reg.local/op","tag":"9","digest":"{DIGEST}"}}'), "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == f"reg.local/op@{DIGEST}"
    (dep,) = by_kind(render('image={"repository":"reg.local/op","tag":"9"}'), "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "reg.local/op:9"


@needs_helm
def test_security_contexts_default_to_restricted_and_can_be_overridden():
    (dep,) = by_kind(render(), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["containers"][0]["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                       "capabilities": {"drop": ["ALL"]}}
    # Values merge into the defaults; null drops a key.
    (dep,) = by_kind(render('podSecurityContext={"runAsUser":1000,"runAsGroup":null,"fsGroup":2000}',
                            'securityContext={"readOnlyRootFilesystem":false}'), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 2000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["containers"][0]["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False,
                                                       "capabilities": {"drop": ["ALL"]}}


def render_notes(tmp_path: Path, *sets: str) -> str:
    """NOTES.txt is not rendered by `helm template`: render it from a copy of the chart as a comment."""
    chart = tmp_path / "kubetrain"
    shutil.copytree(CHART, chart, ignore=shutil.ignore_patterns("crds"))
    (chart / "templates" / "notes-as-comment.yaml").write_text(
        '{{ include "kubetrain/templates/NOTES.txt" . | replace "\\n" "\\n# " | printf "# %s" }}\n')
    args = ["template", "kt", str(chart), "--namespace", RELEASE_NS, "--show-only", "templates/notes-as-comment.yaml"]
    return helm(*args, *[a for s in sets for a in ("--set-json", s)]).stdout


@needs_helm
@pytest.mark.parametrize("sets, ns", [((), RELEASE_NS), (('namespaces=["ml","research"]',), "ml"),
                                      (("clusterWide=true",), "<namespace>")])
def test_notes_watch_the_namespace_the_example_went_to(tmp_path, sets, ns):
    notes = render_notes(tmp_path, *sets)
    assert f"kubectl apply -n {ns} -f examples/trainingjob.yaml" in notes
    assert f"kubectl get trainingjobs -n {ns} -w" in notes


@needs_helm
def test_notes_say_what_the_example_needs_changed_on_a_real_cluster(tmp_path):
    """The example is the testbed's (its MinIO, its Secret, an image named without a registry):
    NOTES says what to change before it runs elsewhere (spec.image is required: no default applies)."""
    example = yaml.safe_load((ROOT / "examples" / "trainingjob.yaml").read_text())["spec"]
    assert example["image"] and example["checkpoint"]["endpoint"] and example["checkpoint"]["credentialsSecret"]
    notes = render_notes(tmp_path)
    assert f"set its\n# spec.image to the trainer image your nodes pull (it names {example['image']})" in notes
    assert f"credentialsSecret: a Secret in {RELEASE_NS}" in notes
