"""The whole product, end to end: helm install, kubectl apply, real training, real preemption.

The operator runs from the Helm chart with the chart's ServiceAccount (through
the test node agent), the TrainingJob is examples/trainingjob.yaml pointed at
the testbed's MinIO, and both pods of the gang are real trainer processes
(DDP over gloo on CPU). The preemption test evicts one worker mid-run and
checks that the whole gang restarts as attempt 2 and resumes from the newest
committed checkpoint instead of step 0.
"""

from __future__ import annotations

import json
import secrets
import threading
import time

import pytest

from .helpers import wait_events, wait_for
from .operator_release import CHART, EXAMPLE, free_port, install, training_job, uninstall

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GROUP, VERSION, PLURAL = "kubetrain.io", "v1alpha1", "trainingjobs"


def _require_pieces() -> None:
    missing = [str(p) for p in (CHART / "Chart.yaml", EXAMPLE) if not p.exists()]
    try:
        import kubetrain_trainer.builtin  # noqa: F401
    except ImportError as exc:
        missing.append(f"kubetrain_trainer.builtin ({exc})")
    if missing:
        pytest.skip(f"not in the tree yet: {', '.join(missing)}")


@pytest.fixture(scope="module")
def jobs_ns(core):
    from kubernetes import client

    name = f"kt-e2e-jobs-{secrets.token_hex(3)}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"kubetrain.io/test": "true"})))
    wait_for(lambda: core.read_namespaced_service_account("default", name), timeout=120, what="default SA",
             ignore=(client.ApiException,))
    yield name
    core.delete_namespace(name, propagation_policy="Background")


@pytest.fixture(scope="module")
def operator(agent, testbed, testbed_env, core, jobs_ns, tmp_path_factory):
    """The chart installed with the operator pod on the agent's node, watching `jobs_ns`."""
    _require_pieces()
    suffix = secrets.token_hex(3)
    rel = install(testbed_env, release=f"kt-e2e-{suffix}", namespace=f"kt-e2e-op-{suffix}",
                  watch_namespaces=[jobs_ns], values_dir=tmp_path_factory.mktemp("helm"))
    pods = core.list_namespaced_pod(rel.namespace, label_selector="app.kubernetes.io/component=operator").items
    assert len(pods) == 1, [p.metadata.name for p in pods]
    pod = pods[0]
    assert pod.spec.node_name == agent.node_name and pod.status.phase == "Running"
    assert pod.spec.service_account_name == rel.service_account
    yield rel
    uninstall(testbed_env, rel)
    core.delete_namespace(rel.namespace, propagation_policy="Background")


@pytest.fixture
def s3_secret(core, jobs_ns, testbed):
    from kubernetes import client

    body = client.V1Secret(metadata=client.V1ObjectMeta(name="kubetrain-s3"),
                           string_data={"accessKeyId": testbed.access_key, "secretAccessKey": testbed.secret_key})
    try:
        core.create_namespaced_secret(jobs_ns, body)
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    return "kubetrain-s3"


def _job(kube_api, ns: str, name: str) -> dict:
    from kubernetes import client

    return client.CustomObjectsApi(kube_api).get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)


def _diagnostics(agent, core, ns: str, job: dict | None) -> str:
    lines = [f"job status: {json.dumps((job or {}).get('status'), indent=1)}"]
    for ev in core.list_namespaced_event(ns).items[-30:]:
        lines.append(f"event {ev.involved_object.name}: {ev.reason}: {ev.message}")
    for log in sorted(agent.state_dir.glob(f"pods/{ns}_*/*.log")):
        tail = log.read_text(errors="replace").splitlines()[-25:]
        lines += [f"--- {log.parent.name}/{log.name}", *tail]
    return "\n".join(lines)


def _wait_finished(kube_api, agent, core, ns: str, name: str, timeout: float) -> dict:
    def finished():
        job = _job(kube_api, ns, name)
        return job if (job.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None

    job = wait_for(finished, timeout=timeout, interval=2, what=f"TrainingJob {name} to finish",
                   on_timeout=lambda: _diagnostics(agent, core, ns, _job(kube_api, ns, name)))
    assert job["status"]["phase"] == "Succeeded", _diagnostics(agent, core, ns, job)
    return job


def _manifests(s3, bucket: str, prefix: str, *, folder: str = "checkpoint-") -> dict[int, dict]:
    """step -> manifest.json of every committed `checkpoint-<step>/` (or other ``folder``) under prefix."""
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):]
            if rel.startswith(folder) and rel.endswith("/manifest.json") and rel.count("/") == 1:
                m = json.loads(s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
                out[int(m["step"])] = m
    return out


def _apply(testbed_env, ns: str, job: dict) -> None:
    import subprocess

    out = subprocess.run(["kubectl", "apply", "-n", ns, "-f", "-"], input=json.dumps(job), env=testbed_env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_trainingjob_succeeds_with_checkpoints_in_s3(operator, agent, kube_api, core, jobs_ns, s3, s3_prefix,
                                                       s3_secret, testbed, testbed_env):
    name = f"ddp-{secrets.token_hex(2)}"
    job = training_job(name=name, bucket=testbed.bucket, prefix=s3_prefix, endpoint=testbed.s3_endpoint,
                       master_port=free_port(), secret=s3_secret,
                       args={"max_steps": 20, "save_steps": 10, "logging_steps": 5})
    t0 = time.monotonic()
    _apply(testbed_env, jobs_ns, job)
    done = _wait_finished(kube_api, agent, core, jobs_ns, name, timeout=480)
    st = done["status"]
    assert (st["attempt"], st.get("preemptions", 0), st.get("failures", 0)) == (1, 0, 0), st
    manifests = _manifests(s3, testbed.bucket, f"{s3_prefix}{jobs_ns}/{name}/")
    assert 20 in manifests, sorted(manifests)
    final = manifests[20]
    assert (final["attempt"], final["world_size"], final["strategy"]) == (1, 2, "ddp"), final
    files = {f["path"]: f["size"] for f in final["files"]}
    assert "trainer_state.json" in files and any(p.endswith(".safetensors") for p in files), files
    final_model = _manifests(s3, testbed.bucket, f"{s3_prefix}{jobs_ns}/{name}/", folder="final/")
    assert {f["path"] for f in final_model[20]["files"]} >= {"config.json", "model.safetensors"}, final_model
    key = f"{s3_prefix}{jobs_ns}/{name}/checkpoint-20/trainer_state.json"
    state = json.loads(s3.get_object(Bucket=testbed.bucket, Key=key)["Body"].read())
    assert state["global_step"] == 20
    assert st["lastCheckpoint"]["step"] == 20, st
    assert st["lastCheckpoint"]["uri"].endswith(f"{jobs_ns}/{name}/checkpoint-20"), st
    events = wait_events(core, jobs_ns, name, lambda evs: "Succeeded" in {e.reason for e in evs},
                         what=f"the Succeeded event of {name}")
    reasons = {e.reason for e in events}
    assert {"Created", "Succeeded"} <= reasons, reasons
    print(f"\n[e2e] 2-node DDP job, 20 steps: apply -> Succeeded in {time.monotonic() - t0:.1f}s")


class PodTimeline:
    """(monotonic time, event type, pod name) of every pod event in a namespace."""

    def __init__(self, kube_api, ns: str) -> None:
        from kubernetes import client, watch

        self.events: list[tuple[float, str, str]] = []
        self.errors: list[str] = []
        self._stopped = threading.Event()
        core = client.CoreV1Api(kube_api)
        rv = core.list_namespaced_pod(ns).metadata.resource_version

        def run():
            nonlocal rv
            while not self._stopped.is_set():
                self._w = watch.Watch()
                try:
                    for ev in self._w.stream(core.list_namespaced_pod, ns, resource_version=rv, timeout_seconds=120):
                        obj = ev["raw_object"]
                        if ev["type"] == "ERROR":
                            raise RuntimeError(f"watch error: {obj}")
                        rv = obj["metadata"]["resourceVersion"]
                        self.events.append((time.monotonic(), ev["type"], obj["metadata"]["name"]))
                except Exception as exc:  # noqa: BLE001 - reconnect from the last resourceVersion
                    if not self._stopped.is_set():
                        self.errors.append(repr(exc))
                        time.sleep(0.5)

        self._w = watch.Watch()
        threading.Thread(target=run, daemon=True).start()

    def first(self, type_: str, prefix: str) -> float | None:
        times = [t for t, ty, n in self.events if ty == type_ and n.startswith(prefix)]
        return min(times) if times else None

    def last(self, type_: str, prefix: str) -> float | None:
        times = [t for t, ty, n in self.events if ty == type_ and n.startswith(prefix)]
        return max(times) if times else None

    def stop(self) -> None:
        self._stopped.set()
        self._w.stop()


def test_evicted_worker_restarts_the_gang_and_resumes(operator, agent, kube_api, core, jobs_ns, s3, s3_prefix,
                                                      s3_secret, testbed, testbed_env):
    from kubernetes import client

    name = f"preempt-{secrets.token_hex(2)}"
    max_steps, hold = 60, 20
    job = training_job(name=name, bucket=testbed.bucket, prefix=s3_prefix, endpoint=testbed.s3_endpoint,
                       master_port=free_port(), secret=s3_secret,
                       args={"max_steps": max_steps, "save_steps": 10, "logging_steps": 10, "save_total_limit": None})
    # The test hook holds the gang after saving step `hold` until a SIGTERM: the eviction lands at a step
    # the test chose, however fast this machine trains (docs/contract.md, "Test hooks").
    job["spec"]["env"] = [{"name": "KUBETRAIN_TEST_HOLD_AT_STEP", "value": str(hold)}]
    ckpt_prefix = f"{s3_prefix}{jobs_ns}/{name}/"
    timeline = PodTimeline(kube_api, jobs_ns)
    _apply(testbed_env, jobs_ns, job)
    committed = wait_for(lambda: hold in (m := _manifests(s3, testbed.bucket, ckpt_prefix)) and m, timeout=420,
                         interval=1, what=f"checkpoint-{hold} of attempt 1 committed",
                         on_timeout=lambda: _diagnostics(agent, core, jobs_ns, _job(kube_api, jobs_ns, name)))
    assert max(committed) == hold, f"the hold at step {hold} did not hold: {sorted(committed)}"
    victim = f"{name}-a1-n1"
    core.create_namespaced_pod_eviction(victim, jobs_ns, client.V1Eviction(
        metadata=client.V1ObjectMeta(name=victim, namespace=jobs_ns)))
    evicted_at = time.monotonic()

    done = _wait_finished(kube_api, agent, core, jobs_ns, name, timeout=600)
    timeline.stop()
    st = done["status"]
    assert st["attempt"] == 2 and st["preemptions"] == 1 and st.get("failures", 0) == 0, st
    assert st["lastCheckpoint"]["step"] == max_steps, st

    manifests = _manifests(s3, testbed.bucket, ckpt_prefix)
    first_attempt = {s for s, m in manifests.items() if m["attempt"] == 1}
    second_attempt = {s for s, m in manifests.items() if m["attempt"] == 2}
    assert first_attempt and second_attempt, manifests
    # Released by the SIGTERM, the gang trained one more step and committed it as its emergency checkpoint.
    assert max(first_attempt) == hold + 1, sorted(first_attempt)
    # Resumed, not restarted: attempt 2 never rewrote a step attempt 1 had committed.
    assert min(second_attempt) > max(first_attempt), (sorted(first_attempt), sorted(second_attempt))
    key = f"{ckpt_prefix}checkpoint-{max_steps}/trainer_state.json"
    state = json.loads(s3.get_object(Bucket=testbed.bucket, Key=key)["Body"].read())
    assert state["global_step"] == max_steps
    rank0_logs = [p.read_text(errors="replace") for p in agent.state_dir.glob(f"pods/{jobs_ns}_{name}-a2-n0_*/trainer.log")]
    assert rank0_logs and f"checkpoint-{max(first_attempt)}" in rank0_logs[0], (
        "attempt 2 must say which checkpoint it resumed from:\n" + (rank0_logs[0][-3000:] if rank0_logs else "no log"))

    # Attempts never overlap: every attempt-1 pod was gone before the first attempt-2 pod existed.
    gone = timeline.last("DELETED", f"{name}-a1-")
    born = timeline.first("ADDED", f"{name}-a2-")
    assert gone is not None and born is not None and gone <= born, (timeline.events, timeline.errors)
    reasons = [e.reason for e in core.list_namespaced_event(jobs_ns, field_selector=f"involvedObject.name={name}").items]
    assert "Preempted" in reasons, reasons
    print(f"\n[e2e] preempted at checkpoint {max(first_attempt)}; restart took {born - evicted_at:.1f}s;"
          f" attempt 2 committed {sorted(second_attempt)[:3]}...")


STATIC_KEYS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"}


def _assert_only_web_identity(pod: dict, *, account: str, role) -> None:
    """The pod as the API stores it: a role, a projected token for the role's audience, no key anywhere."""
    spec, name = pod["spec"], pod["metadata"]["name"]
    assert spec.get("serviceAccountName") == account, name
    for c in spec["containers"] + spec.get("initContainers", []):
        env = c.get("env") or []
        assert not {e["name"] for e in env} & STATIC_KEYS, (name, c["name"], env)
        assert not [e for e in env if "secretKeyRef" in (e.get("valueFrom") or {})], (name, c["name"], env)
        assert not [s for s in c.get("envFrom") or [] if "secretRef" in s], (name, c["name"], c.get("envFrom"))
    volumes = spec.get("volumes") or []
    assert not [v for v in volumes if "secret" in v], (name, volumes)
    sources = [s for v in volumes for s in (v.get("projected") or {}).get("sources") or []]
    assert not [s for s in sources if "secret" in s], (name, sources)
    tokens = [(v["name"], s["serviceAccountToken"]) for v in volumes for s in (v.get("projected") or {}).get("sources")
              or [] if "serviceAccountToken" in s]
    assert [t for _, t in tokens] == [{"audience": role.audience, "expirationSeconds": 3600, "path": "token"}], tokens
    trainer = next(c for c in spec["containers"] if c["name"] == "trainer")
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["AWS_ROLE_ARN"] == role.role_arn and env["AWS_ROLE_SESSION_NAME"] == name, env
    assert env["AWS_WEB_IDENTITY_TOKEN_FILE"] == "/etc/kubetrain/aws-web-identity/token", env
    assert {"name": tokens[0][0], "mountPath": "/etc/kubetrain/aws-web-identity", "readOnly": True} in \
        trainer["volumeMounts"], trainer["volumeMounts"]


def _process_envs(pod_name: str) -> list[dict[str, str]]:
    """The environment of every running process of a pod (the agent runs them on this machine)."""
    from .helpers import pids_with_env

    envs = []
    for pid in pids_with_env(f"KUBETRAIN_POD_NAME={pod_name}"):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                raw = f.read().split(b"\0")
        except OSError:
            continue
        envs.append(dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e))
    return envs


def _jwt_claims(token: str) -> dict:
    import base64

    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def test_web_identity_job_without_a_secret_trains_survives_a_preemption_and_resumes(
        operator, agent, kube_api, core, jobs_ns, s3, testbed, testbed_env):
    """Issue 16, acceptance 1: the demo job with spec.checkpoint.webIdentity and no Secret. Its pods get a
    projected ServiceAccount token for the testbed STS role's audience, exchange it at MinIO's STS for
    temporary credentials limited to sts-jobs/, checkpoint there, and a preempted gang resumes from the
    emergency checkpoint. No key reaches a pod: neither its spec nor its processes' environment has one."""
    from kubernetes import client

    from kubetrain_testbed.sts import JOBS_ROLE

    account = "trainer"
    try:
        core.create_namespaced_service_account(jobs_ns, client.V1ServiceAccount(
            metadata=client.V1ObjectMeta(name=account)))
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    name = f"wid-{secrets.token_hex(2)}"
    prefix = f"{JOBS_ROLE.prefix}/e2e-{secrets.token_hex(4)}"
    max_steps, hold = 40, 20
    identity = {"webIdentity": {"roleArn": JOBS_ROLE.role_arn, "audience": JOBS_ROLE.audience,
                                "serviceAccountName": account}}
    job = training_job(name=name, bucket=testbed.bucket, prefix=prefix, endpoint=testbed.s3_endpoint,
                       master_port=free_port(), identity=identity,
                       args={"max_steps": max_steps, "save_steps": 10, "logging_steps": 10, "save_total_limit": None})
    job["spec"]["env"] = [{"name": "KUBETRAIN_TEST_HOLD_AT_STEP", "value": str(hold)}]
    assert set(job["spec"]["checkpoint"]) == {"uri", "endpoint", "webIdentity"}, job["spec"]["checkpoint"]
    ckpt_prefix = f"{prefix}/{jobs_ns}/{name}/"
    try:
        _apply(testbed_env, jobs_ns, job)
        committed = wait_for(lambda: hold in (m := _manifests(s3, testbed.bucket, ckpt_prefix)) and m, timeout=420,
                             interval=1, what=f"checkpoint-{hold} of attempt 1 committed under {ckpt_prefix}",
                             on_timeout=lambda: _diagnostics(agent, core, jobs_ns, _job(kube_api, jobs_ns, name)))
        assert max(committed) == hold, f"the hold at step {hold} did not hold: {sorted(committed)}"

        # The gang holds at step `hold`: what reached its pods, in the API and in their processes.
        for rank in (0, 1):
            pod = kube_api.sanitize_for_serialization(core.read_namespaced_pod(f"{name}-a1-n{rank}", jobs_ns))
            _assert_only_web_identity(pod, account=account, role=JOBS_ROLE)
            envs = _process_envs(f"{name}-a1-n{rank}")
            assert envs, f"no process of pod {name}-a1-n{rank} found"
            for env in envs:
                assert not STATIC_KEYS & set(env), sorted(STATIC_KEYS & set(env))
                assert env["AWS_ROLE_ARN"] == JOBS_ROLE.role_arn and env["AWS_ENDPOINT_URL"] == testbed.s3_endpoint
                claims = _jwt_claims(open(env["AWS_WEB_IDENTITY_TOKEN_FILE"]).read().strip())
                assert claims["aud"] == [JOBS_ROLE.audience], claims
                assert claims["sub"] == f"system:serviceaccount:{jobs_ns}:{account}", claims
                assert claims["exp"] - claims["iat"] <= 3600, claims  # a short-lived token, not a key

        victim = f"{name}-a1-n1"
        core.create_namespaced_pod_eviction(victim, jobs_ns, client.V1Eviction(
            metadata=client.V1ObjectMeta(name=victim, namespace=jobs_ns)))
        done = _wait_finished(kube_api, agent, core, jobs_ns, name, timeout=600)
        st = done["status"]
        assert st["phase"] == "Succeeded" and st["attempt"] == 2 and st["preemptions"] == 1, st
        assert st.get("failures", 0) == 0, st
        assert st["lastCheckpoint"]["step"] == max_steps, st
        assert st["lastCheckpoint"]["uri"] == f"s3://{testbed.bucket}/{ckpt_prefix}checkpoint-{max_steps}", st

        manifests = _manifests(s3, testbed.bucket, ckpt_prefix)
        first_attempt = {s for s, m in manifests.items() if m["attempt"] == 1}
        second_attempt = {s for s, m in manifests.items() if m["attempt"] == 2}
        # Attempt 1 committed its periodic checkpoints and, released by the SIGTERM, one more step as its
        # emergency checkpoint; attempt 2 resumed from that one and never rewrote a step attempt 1 committed.
        assert {10, hold, hold + 1} <= first_attempt and max(first_attempt) == hold + 1, sorted(manifests)
        assert second_attempt and min(second_attempt) > hold + 1 and max_steps in second_attempt, sorted(manifests)
        assert all(m["world_size"] == 2 for m in manifests.values()), manifests
        rank0_logs = [p.read_text(errors="replace")
                      for p in agent.state_dir.glob(f"pods/{jobs_ns}_{name}-a2-n0_*/trainer.log")]
        assert rank0_logs and f"restored checkpoint-{hold + 1}" in rank0_logs[0], (
            "attempt 2 must resume from the emergency checkpoint:\n" + (rank0_logs[0][-3000:] if rank0_logs else "no log"))

        for rank in (0, 1):  # the new gang got the same identity, and nothing else
            pod = kube_api.sanitize_for_serialization(core.read_namespaced_pod(f"{name}-a2-n{rank}", jobs_ns))
            _assert_only_web_identity(pod, account=account, role=JOBS_ROLE)

        mode = (f"checkpoint identity: webIdentity (role {JOBS_ROLE.role_arn}, ServiceAccount {account}, "
                f"audience {JOBS_ROLE.audience})")
        created = next(c for c in st["conditions"] if c["type"] == "Created")
        assert mode in created["message"], created
        events = wait_events(core, jobs_ns, name, lambda evs: "Succeeded" in {e.reason for e in evs},
                             what=f"the Succeeded event of {name}")
        created_events = [e.message for e in events if e.reason == "Created"]
        assert created_events and all(mode in m for m in created_events), created_events
        assert {"Preempted", "Restarting", "Succeeded"} <= {e.reason for e in events}, [e.reason for e in events]
        shown = json.dumps(done) + "".join(e.message or "" for e in events)
        assert testbed.secret_key not in shown and testbed.access_key not in shown
    finally:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=testbed.bucket, Prefix=f"{prefix}/"):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=testbed.bucket, Delete={"Objects": keys, "Quiet": True})
