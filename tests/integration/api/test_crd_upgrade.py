"""A rule added to the CRD must not lock jobs stored before it: the real API server, a CRD upgraded in place.

spec.env may not set AWS_ENDPOINT_URL_S3 or AWS_IGNORE_CONFIGURED_ENDPOINT_URLS beside spec.checkpoint
(since 2026-12-06). A job stored earlier with one of them must stay editable, suspend included; once its env
has none, the rule holds for it too. The rules need no `optionalOldSelf` (Kubernetes 1.30): a new job is
checked at the root while it has no status, an edit by a transition rule on spec. The test serves a copy of the CRD under a
group of its own (the shared kubetrain.io CRD stays as it is for the other tests): first without the rule, as
the CRD was, then as it is now.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml


pytestmark = pytest.mark.integration

CRD_FILE = Path(__file__).resolve().parents[3] / "crds" / "trainingjob.yaml"
GROUP, VERSION, PLURAL = "upgrade.kubetrain.io", "v1alpha1", "trainingjobs"
NEW_NAMES = ("'AWS_ENDPOINT_URL_S3'", "'AWS_IGNORE_CONFIGURED_ENDPOINT_URLS'")


def _crd(*, before: bool) -> dict:
    crd = yaml.safe_load(CRD_FILE.read_text())
    crd["metadata"] = {"name": f"{PLURAL}.{GROUP}"}
    crd["spec"]["group"] = GROUP
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for schema in (root, root["properties"]["spec"]):  # the create rule at the root, the edit rule on spec
        rules = schema["x-kubernetes-validations"]
        assert any(all(n in r["rule"] for n in NEW_NAMES) for r in rules), "a rule this test is about is gone"
        if before:  # the CRD as it was: the rules not there yet
            schema["x-kubernetes-validations"] = [r for r in rules if not all(n in r["rule"] for n in NEW_NAMES)]
    return crd


def _serve(ext, custom, namespace: str, crd: dict, *, refuses_new_jobs: bool) -> None:
    """Create or replace the CRD, then wait until the API server validates with it (it picks a new schema up
    asynchronously): a dry-run create of a job with AWS_ENDPOINT_URL_S3 is refused or not, as the rule says."""
    from kubernetes import client

    name = crd["metadata"]["name"]
    try:
        current = ext.read_custom_resource_definition(name)
        crd = {**crd, "metadata": {**crd["metadata"], "resourceVersion": current.metadata.resource_version}}
        ext.replace_custom_resource_definition(name, crd)
    except client.ApiException as exc:
        if exc.status != 404:
            raise
        ext.create_custom_resource_definition(crd)
    probe = _job("upgrade-probe", [{"name": "AWS_ENDPOINT_URL_S3", "value": "http://data:9000"}])
    deadline = time.monotonic() + 120
    while True:
        try:
            custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, probe, dry_run="All")
            refused = False
        except client.ApiException as exc:
            if exc.status == 404:  # not served yet
                refused = None
            elif exc.status == 422:
                refused = True
            else:
                raise
        if refused is refuses_new_jobs:
            return
        assert time.monotonic() < deadline, f"the API server did not take the CRD up (refused: {refused})"
        time.sleep(0.3)


def _job(name: str, env: list[dict]) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"image": "kubetrain/trainer:0.1.0",
                     "trainer": {"builtin": {"task": "causal-lm", "args": {"max_steps": 10}}},
                     "checkpoint": {"uri": "s3://kubetrain-test/jobs", "credentialsSecret": {"name": "s3"}},
                     "env": env}}


def test_a_job_stored_before_the_endpoint_rule_stays_editable(kube_api, api_namespace):
    from kubernetes import client

    ext = client.ApiextensionsV1Api(kube_api)
    custom = client.CustomObjectsApi(kube_api)
    env = [{"name": "AWS_ENDPOINT_URL_S3", "value": "http://data:9000"}, {"name": "LOG", "value": "1"}]

    def patch(body: dict) -> dict:
        return custom.patch_namespaced_custom_object(GROUP, VERSION, api_namespace, PLURAL, "stored", body)

    try:
        _serve(ext, custom, api_namespace, _crd(before=True), refuses_new_jobs=False)
        custom.create_namespaced_custom_object(GROUP, VERSION, api_namespace, PLURAL, _job("stored", env))
        # As the operator does at once: a stored job has a status (a new one has none, and is checked as new).
        custom.patch_namespaced_custom_object_status(GROUP, VERSION, api_namespace, PLURAL, "stored",
                                                     {"status": {"phase": "Running"}})
        _serve(ext, custom, api_namespace, _crd(before=False), refuses_new_jobs=True)

        # Suspend, resume and other edits go through; so does an edit of the env that keeps the variable.
        assert patch({"spec": {"runPolicy": {"suspend": True}}})["spec"]["runPolicy"]["suspend"] is True
        patch({"spec": {"runPolicy": {"suspend": False, "backoffLimit": 5}}})
        patch({"metadata": {"labels": {"team": "ml"}}})
        patch({"spec": {"env": [*env, {"name": "MORE", "value": "2"}]}})

        # Once the job has none, the rule holds for it too: adding one back is refused, naming the field.
        patch({"spec": {"env": env[1:]}})
        with pytest.raises(client.ApiException) as err:
            patch({"spec": {"env": [*env[1:], {"name": "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "value": "true"}]}})
        body = json.loads(err.value.body)
        assert err.value.status == 422 and "spec.env" in err.value.body
        assert "must not set AWS_ENDPOINT_URL_S3 or AWS_IGNORE_CONFIGURED_ENDPOINT_URLS" in body["message"]

        # A new job with the variable is refused under the new CRD (what _serve waited for), a job without
        # checkpoint may set it (it is then the job's own S3 endpoint).
        custom.create_namespaced_custom_object(GROUP, VERSION, api_namespace, PLURAL, {
            **_job("no-checkpoint", env), "spec": {k: v for k, v in _job("x", env)["spec"].items()
                                                   if k != "checkpoint"}}, dry_run="All")
    finally:
        try:
            ext.delete_custom_resource_definition(f"{PLURAL}.{GROUP}")
        except client.ApiException as exc:
            if exc.status != 404:
                raise



def test_a_job_without_checkpoint_that_adds_one_cannot_keep_the_endpoint_variables(submit, kube_api, api_namespace):
    """Without spec.checkpoint, AWS_ENDPOINT_URL_S3 is the job's own S3 endpoint (allowed); adding a checkpoint
    without spec.checkpoint.endpoint would send the checkpoints there: only a job that had both may keep it."""
    from kubernetes import client

    custom = client.CustomObjectsApi(kube_api)
    job = _job("adds-checkpoint", [{"name": "AWS_ENDPOINT_URL_S3", "value": "http://data:9000"}])
    job["apiVersion"] = "kubetrain.io/v1alpha1"
    checkpoint = job["spec"].pop("checkpoint")
    submit(job, dry_run=False)
    custom.patch_namespaced_custom_object_status("kubetrain.io", "v1alpha1", api_namespace, "trainingjobs",
                                                 "adds-checkpoint", {"status": {"phase": "Running"}})
    try:
        with pytest.raises(client.ApiException) as err:
            custom.patch_namespaced_custom_object("kubetrain.io", "v1alpha1", api_namespace, "trainingjobs",
                                                  "adds-checkpoint", {"spec": {"checkpoint": checkpoint}})
        assert err.value.status == 422
        assert "must not set AWS_ENDPOINT_URL_S3 or AWS_IGNORE_CONFIGURED_ENDPOINT_URLS" in err.value.body
    finally:
        custom.delete_namespaced_custom_object("kubetrain.io", "v1alpha1", api_namespace, "trainingjobs",
                                               "adds-checkpoint")
