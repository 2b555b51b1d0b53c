"""Issue 11's acceptance on the real node: what an operator of a shared cluster sees while jobs run.

The chart is installed from the operator image with progress read every 2 s. One demo-shaped
job (2 pods, checkpoints to MinIO) is followed from outside, as a user would:
- `kubectl get tj` shows the Step rising and the newest committed Checkpoint while rank 0 runs;
- a scrape of the trainer's /metrics (rank 0, :9410) and of the operator's /metrics (:9400),
  parsed with prometheus-client's parser, shows the step rising, samples/s > 0, the commits
  counted as MinIO holds them, and, after a forced preemption (the Eviction API), the operator's
  preemption and restart counters moved exactly as the job's status did;
- `kubectl wait --for=condition=Succeeded tj/<job>` returns;
- the training pods' ServiceAccount has no RBAC rules (SubjectAccessReviews and the bindings).
"""

from __future__ import annotations

import json
import secrets
import subprocess

import pytest

from .helpers import wait_for
from .operator_release import CHART, helm
from .test_real_node import REAL_OPERATOR_RESOURCES, REAL_PLACEMENT, _committed_steps, _demo_job, _kubectl, _s3_secret

pytestmark = [pytest.mark.e2e, pytest.mark.realnode, pytest.mark.timeout(1800)]
GROUP, VERSION, PLURAL = "kubetrain.io", "v1alpha1", "trainingjobs"


@pytest.fixture(scope="module")
def operator(real_node, images, testbed_env, core, tmp_path_factory):
    """The chart from the operator image on the real node, reading progress every 2 s."""
    from kubernetes import client

    suffix = secrets.token_hex(3)
    rel, ns, jobs_ns = f"kt-obs-{suffix}", f"kt-obs-op-{suffix}", f"kt-obs-jobs-{suffix}"
    for name in (ns, jobs_ns):
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={
            "kubetrain.io/test": "true", "pod-security.kubernetes.io/enforce": "restricted"})))
    wait_for(lambda: core.read_namespaced_service_account("default", jobs_ns), timeout=120, what="default SA",
             ignore=(client.ApiException,))
    repo, tag = images["operator"].rsplit(":", 1)
    values = {"image": {"repository": repo, "tag": tag}, "namespaces": [jobs_ns],
              "progress": {"intervalSeconds": 2, "timeoutSeconds": 1}, **REAL_PLACEMENT, **REAL_OPERATOR_RESOURCES}
    path = tmp_path_factory.mktemp("helm") / "values.json"
    path.write_text(json.dumps(values))
    helm(testbed_env, "upgrade", "--install", rel, str(CHART), "--namespace", ns, "--values", str(path),
         "--wait", "--timeout", "5m")
    pod = core.list_namespaced_pod(ns, label_selector="app.kubernetes.io/component=operator").items[0]
    yield {"release": rel, "namespace": ns, "jobs": jobs_ns, "metrics": (testbed_env, ns, pod.metadata.name, 9400)}
    subprocess.run(["helm", "uninstall", rel, "--namespace", ns, "--wait", "--timeout", "2m"], env=testbed_env,
                   capture_output=True, timeout=180)
    for name in (jobs_ns, ns):
        core.delete_namespace(name, propagation_policy="Background")


SCRAPE = "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


def scrape(target: tuple[dict, str, str, int]) -> dict[tuple[str, tuple], float]:
    """One Prometheus scrape of (env, namespace, pod, port), parsed with prometheus-client's own parser.
    It runs inside the pod (kubectl exec): the host has no route into the pod network, the pods do."""
    from prometheus_client.parser import text_string_to_metric_families

    env, ns, pod, port = target
    text = _kubectl(env, "exec", "-n", ns, pod, "--", "python", "-c", SCRAPE, f"http://127.0.0.1:{port}/metrics")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def get_tj(env: dict, ns: str, name: str) -> dict[str, str]:
    """`kubectl get tj <name>` as the user sees it: the table's columns by header."""
    header, row = _kubectl(env, "get", "tj", name, "-n", ns).splitlines()[:2]
    starts = [i for i, c in enumerate(header) if c != " " and (i == 0 or header[i - 1] == " ")]
    cells = [row[a:b].strip() for a, b in zip(starts, starts[1:] + [len(row) + 1])]
    return dict(zip(header.split(), cells))


def test_progress_metrics_preemption_counters_and_kubectl_wait_on_the_demo_job(
        real_node, operator, images, testbed_env, core, s3, s3_prefix, testbed):
    from kubernetes import client

    ns, name, hold = operator["jobs"], f"obs-{secrets.token_hex(2)}", 60
    _s3_secret(core, ns, testbed)
    job = _demo_job(name, images=images, real_node=real_node, testbed=testbed, prefix=s3_prefix,
                    args={"max_steps": 120, "save_steps": 20, "save_total_limit": None, "logging_steps": 5},
                    env=[{"name": "KUBETRAIN_TEST_HOLD_AT_STEP", "value": str(hold)}])
    _kubectl(testbed_env, "apply", "-n", ns, "-f", "-", input=json.dumps(job))
    waiter = subprocess.Popen(["kubectl", "wait", "-n", ns, "--for=condition=Succeeded", f"tj/{name}",
                               "--timeout=900s"], env=testbed_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    custom = client.CustomObjectsApi(core.api_client)
    prefix = f"{s3_prefix}{ns}/{name}/"
    seen: list[dict[str, str]] = []

    def watch_table(until) -> None:
        def step():
            row = get_tj(testbed_env, ns, name)
            if not seen or row != seen[-1]:
                seen.append(row)
            return until(row)
        wait_for(step, timeout=600, interval=1, what=f"{name}: {until.__doc__}",
                 on_timeout=lambda: f"{seen[-5:]}\n" + _kubectl(testbed_env, "describe", "pods", "-n", ns))

    def held(row: dict) -> bool:
        """Checkpoint column at the held step while the job runs"""
        return row.get("CHECKPOINT") == str(hold) and row.get("PHASE") == "Running"
    watch_table(held)

    # Attempt 1 holds after checkpoint-60: its uploads are done and nothing moves.
    trainer_url = (testbed_env, ns, f"{name}-a1-n0", 9410)
    def uploads_done():
        m = scrape(trainer_url)
        done = total(m, "kubetrain_checkpoint_pending_uploads") == 0 and total(m, "kubetrain_train_global_step") >= hold
        return m if done else None
    idle = wait_for(uploads_done, timeout=120, interval=1, what="rank 0's uploads done at the hold")
    committed = {s for s, m in _committed_steps(s3, testbed.bucket, prefix).items() if m["attempt"] == 1}
    assert total(idle, "kubetrain_checkpoint_uploads_total") == len(committed) == hold // 20, (idle, committed)
    assert total(idle, "kubetrain_train_samples_per_second") > 0, idle

    # A forced preemption: the operator's counters move as the job's status does.
    before = scrape(operator["metrics"])
    victim = f"{name}-a1-n1"
    core.create_namespaced_pod_eviction(victim, ns, client.V1Eviction(
        metadata=client.V1ObjectMeta(name=victim, namespace=ns)))

    def restarted():
        st = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name).get("status") or {}
        return st if st.get("attempt") == 2 and st.get("phase") == "Running" else None
    st = wait_for(restarted, timeout=420, interval=1, what="attempt 2 running")
    after = scrape(operator["metrics"])
    # Counters live in the operator process: a restart (e.g. a failed liveness probe) resets them.
    op_pod = core.read_namespaced_pod(operator["metrics"][2], operator["namespace"])
    assert op_pod.status.container_statuses[0].restart_count == 0, op_pod.status.container_statuses[0]
    key = ("kubetrain_job_preemptions_total", (("reason", "EvictionByEvictionAPI"),))
    assert after.get(key, 0) - before.get(key, 0) == st["preemptions"] == 1, (
        {k: v for k, v in before.items() if "preemptions" in k[0]}, {k: v for k, v in after.items() if "preemptions" in k[0]})
    key = ("kubetrain_job_restarts_total", (("reason", "Preempted"),))
    assert after.get(key, 0) - before.get(key, 0) == st["restarts"] == 1, (before, after)
    assert after[("kubetrain_leader", ())] == 1 and total(after, "kubetrain_api_writes_total") > 0

    # Attempt 2 trains on from the emergency checkpoint; rank 0's step rises between two scrapes.
    trainer_url = (testbed_env, ns, f"{name}-a2-n0", 9410)
    first = wait_for(lambda: total(scrape(trainer_url), "kubetrain_train_global_step") > hold or None,
                     timeout=300, interval=1, what="attempt 2 training past the hold")
    step1 = total(scrape(trainer_url), "kubetrain_train_global_step")
    wait_for(lambda: total(scrape(trainer_url), "kubetrain_train_global_step") > step1, timeout=300,
             interval=0.5, what="the step rising between scrapes")
    assert first

    def succeeded(row: dict) -> bool:
        """the job Succeeded"""
        return row.get("PHASE") == "Succeeded"
    watch_table(succeeded)  # the table through attempt 2 as well, not only up to the hold

    out, err = waiter.communicate(timeout=900)
    assert waiter.returncode == 0, err
    assert f"trainingjob.kubetrain.io/{name} condition met" in out, out
    final = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    conds = {c["type"]: c for c in final["status"]["conditions"]}
    assert conds["Succeeded"]["status"] == "True"
    assert conds["Succeeded"]["observedGeneration"] == final["metadata"]["generation"]
    assert {"type", "status", "reason", "message", "lastTransitionTime"} <= conds["Succeeded"].keys()
    # The finished job's progress is its last attempt's last reading, marked so, with no ETA or rate left.
    progress = final["status"]["progress"]
    assert (progress["reachable"], progress["reason"], progress["attempt"]) == (False, "AttemptEnded", 2), progress
    assert not {"etaSeconds", "samplesPerSecond"} & progress.keys(), progress

    steps = [int(r["STEP"].split("/")[0]) for r in seen if r.get("STEP", "<none>") not in ("", "<none>")]
    rises = sum(b > a for a, b in zip(steps, steps[1:]))
    # The column moves while the job runs: before the hold, and past it in attempt 2. (Each read of /progress
    # is 2 s apart and the demo trains 60 steps in a few seconds on a quiet machine: 3 rises before the hold
    # were not always there to see.)
    assert rises >= 2, seen
    # Attempt 2 restores the checkpoint at the hold: the column never drops back to 0 (or below the hold)
    # while it starts and restores; it shows attempt 1's last values until attempt 2 reports its own.
    after_hold = steps[next(i for i, s in enumerate(steps) if s >= hold):]
    assert min(after_hold) >= hold, seen
    assert max(steps) > hold, seen
    assert any(r.get("STEP", "").endswith("/120") for r in seen), seen
    print(f"\n[observability] kubectl get tj saw the step rise {rises} times: "
          f"{[r.get('STEP') for r in seen]}; checkpoints {[r.get('CHECKPOINT') for r in seen]}")


def test_the_training_pods_service_account_has_no_rbac_rules(operator, core):
    """No binding names the training pods' ServiceAccount, and its groups' bindings grant no resource;
    the API server's authorizer refuses it what a trainer could abuse."""
    from kubernetes import client

    ns = operator["jobs"]
    account = "default"  # the pods' serviceAccountName when the job sets none
    user = f"system:serviceaccount:{ns}:{account}"
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"]
    rbac = client.RbacAuthorizationV1Api(core.api_client)
    bindings = list(rbac.list_namespaced_role_binding(ns).items) + list(rbac.list_cluster_role_binding().items)
    named = [b.metadata.name for b in bindings for s in b.subjects or ()
             if (s.kind == "ServiceAccount" and s.name == account and (s.namespace or ns) == ns)
             or (s.kind == "User" and s.name == user)]
    assert named == [], f"bindings name the training pods' ServiceAccount: {named}"
    for b in bindings:
        if any(s.kind == "Group" and s.name in ("system:serviceaccounts", f"system:serviceaccounts:{ns}")
               for s in b.subjects or ()):
            role = (rbac.read_cluster_role(b.role_ref.name) if b.role_ref.kind == "ClusterRole"
                    else rbac.read_namespaced_role(b.role_ref.name, ns))
            assert all(not r.resources for r in role.rules or ()), (b.metadata.name, role.rules)
    authz = client.AuthorizationV1Api(core.api_client)
    for verb, resource, group, sub in [("get", "pods", "", ""), ("list", "pods", "", ""), ("patch", "pods", "", ""),
                                       ("create", "pods", "", ""), ("get", "secrets", "", ""),
                                       ("patch", "trainingjobs", GROUP, "status"), ("list", "trainingjobs", GROUP, ""),
                                       ("create", "events", "", ""), ("get", "configmaps", "", "")]:
        review = authz.create_subject_access_review(client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
            user=user, groups=groups, resource_attributes=client.V1ResourceAttributes(
                namespace=ns, verb=verb, resource=resource, group=group, subresource=sub or None))))
        assert not review.status.allowed, (verb, resource, sub, review.status)
    # The same question for the operator's own account is answered yes: the reviews can say yes.
    review = authz.create_subject_access_review(client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
        user=f"system:serviceaccount:{operator['namespace']}:{operator['release']}-kubetrain",
        resource_attributes=client.V1ResourceAttributes(namespace=ns, verb="create", resource="pods"))))
    assert review.status.allowed, review.status
