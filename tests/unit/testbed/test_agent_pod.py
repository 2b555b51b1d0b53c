"""Table tests of the node agent's pure pod logic (env resolution, paths, exit codes, phases).

The agent itself is exercised against the real testbed in tests/e2e; these
pin the kubelet-like rules it follows, without a cluster.
"""

from pathlib import Path

import pytest

from kubetrain_testbed.agent_pod import ContainerConfigError, expand, resolve_env, rewrite_path
from kubetrain_testbed.agent_status import CState, exit_code_of, phase_of, termination_message

POD = {"metadata": {"name": "job-a1-n0", "namespace": "ml", "uid": "u1", "labels": {"rank": "0"}},
       "spec": {"nodeName": "agent-0", "serviceAccountName": "trainer"}}
SECRETS = {("ml", "s3"): {"accessKeyId": "AKIA", "secretAccessKey": "shh"}}
CONFIGMAPS = {("ml", "cfg"): {"LR": "0.1", "MODE": "fast"}}


def _env(container, base=None):
    return resolve_env(POD, container, base=base or {}, secrets=lambda ns, n: SECRETS.get((ns, n)),
                       configmaps=lambda ns, n: CONFIGMAPS.get((ns, n)))


@pytest.mark.parametrize("text, env, out", [
    ("$(A)/x", {"A": "a"}, "a/x"),
    ("$(MISSING)", {}, "$(MISSING)"),
    ("$$(A)", {"A": "a"}, "$(A)"),
    ("plain", {"A": "a"}, "plain"),
])
def test_expand_follows_kubernetes_rules(text, env, out):
    assert expand(text, env) == out


def test_env_sources_in_kubernetes_order():
    container = {
        "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
        "env": [
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "RANK", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['rank']"}}},
            {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s3", "key": "accessKeyId"}}},
            {"name": "DERIVED", "value": "$(POD)-$(CFG_MODE)"},
            {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "MODE"}}},
        ],
    }
    env = _env(container, base={"PATH": "/bin"})
    assert env["PATH"] == "/bin" and env["CFG_LR"] == "0.1"
    assert (env["POD"], env["RANK"], env["KEY"], env["MODE"]) == ("job-a1-n0", "0", "AKIA", "fast")
    assert env["DERIVED"] == "job-a1-n0-fast"


@pytest.mark.parametrize("item, message", [
    ({"name": "K", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k"}}}, "Secret ml/nope not found"),
    ({"name": "K", "valueFrom": {"secretKeyRef": {"name": "s3", "key": "k"}}}, "key 'k' in Secret ml/s3"),
    ({"name": "K", "valueFrom": {"fieldRef": {"fieldPath": "spec.hostname"}}}, "not supported"),
])
def test_unresolvable_env_is_a_container_config_error(item, message):
    with pytest.raises(ContainerConfigError, match=message):
        _env({"env": [item]})


def test_optional_missing_ref_is_skipped():
    env = _env({"env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}}]})
    assert "K" not in env


@pytest.mark.parametrize("value, out", [
    ("/etc/kubetrain/deepspeed/ds.json", "/tmp/pod/ds/ds.json"),
    ("/etc/kubetrain/deepspeed", "/tmp/pod/ds"),
    ("/etc/kubetrain/deepspeedX", "/etc/kubetrain/deepspeedX"),
    ("/data/x", "/tmp/pod/data/x"),
    ("relative", "relative"),
])
def test_rewrite_path_uses_the_longest_mount(value, out):
    mapping = {"/etc/kubetrain/deepspeed": Path("/tmp/pod/ds"), "/data": Path("/tmp/pod/data")}
    assert rewrite_path(value, mapping) == out


@pytest.mark.parametrize("returncode, code", [(0, 0), (3, 3), (-15, 143), (-9, 137)])
def test_exit_code_like_a_container_runtime(returncode, code):
    assert exit_code_of(returncode) == code


def test_termination_message_falls_back_to_logs_only_on_error():
    assert termination_message("File", 1, "", "tail") == ""
    assert termination_message("FallbackToLogsOnError", 1, "", "tail") == "tail"
    assert termination_message("FallbackToLogsOnError", 0, "", "tail") == ""
    assert termination_message("File", 0, "msg", "tail") == "msg"


def _state(**kw):
    return CState(name="c", **kw)


@pytest.mark.parametrize("policy, states, terminal, phase", [
    ("Never", [dict(state="terminated", exit_code=0, started_at="t")], False, "Succeeded"),
    ("Never", [dict(state="terminated", exit_code=83, started_at="t")], False, "Failed"),
    ("Always", [dict(state="terminated", exit_code=0, started_at="t")], False, "Running"),
    ("Never", [dict(state="running", started_at="t")], True, "Failed"),
    ("Never", [dict(state="waiting")], False, "Pending"),
])
def test_phase_like_a_kubelet(policy, states, terminal, phase):
    assert phase_of(policy, [_state(**s) for s in states], terminal=terminal) == phase


def test_projected_service_account_token_has_its_own_audience_and_lifetime(tmp_path):
    """Like a kubelet: a projected serviceAccountToken source gets a token for its audience and
    expirationSeconds, also when automountServiceAccountToken is false (web identity pods)."""
    from kubetrain_testbed.agent_pod import plan_pod, projected_token_seconds

    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"},
           "spec": {"automountServiceAccountToken": False, "serviceAccountName": "trainer",
                    "volumes": [{"name": "tok", "projected": {"sources": [{"serviceAccountToken": {
                        "audience": "kubetrain-testbed-sts", "expirationSeconds": 600, "path": "token"}}]}}],
                    "containers": [{"name": "c", "command": ["true"], "env": [
                        {"name": "AWS_WEB_IDENTITY_TOKEN_FILE", "value": "/etc/kubetrain/aws-web-identity/token"}],
                        "volumeMounts": [{"name": "tok", "mountPath": "/etc/kubetrain/aws-web-identity"}]}]}}
    asked = []

    def token_for(audience: str, seconds: int) -> bytes:
        asked.append((audience, seconds))
        return b"jwt-for-" + audience.encode()

    plan = plan_pod(pod, pod_dir=tmp_path, node_name="n", python_bin=tmp_path, secrets=lambda *_: None,
                    configmaps=lambda *_: None, kubeconfig=None, sa_files={"token": b""}, token_for=token_for)
    assert asked == [("kubetrain-testbed-sts", 600)]
    token_file = Path(plan.containers[0].env["AWS_WEB_IDENTITY_TOKEN_FILE"])
    assert [f.content for f in plan.files if f.path == token_file] == [b"jwt-for-kubetrain-testbed-sts"]
    assert projected_token_seconds(pod) == [600]
