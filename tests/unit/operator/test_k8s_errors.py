"""Which API refusals of a pod create can pass (wait) and which cannot (fail the job)."""

from __future__ import annotations

import pytest

from kubetrain.k8s import PermanentError, RejectedError, classify_forbidden

CASES = [
    ('pods "tj-a1-n0" is forbidden: exceeded quota: q, requested: pods=1, used: pods=4, limited: pods=4',
     RejectedError, "QuotaExceeded"),
    ('pods is forbidden: User "system:serviceaccount:kt:kubetrain" cannot create resource "pods" in API group "" '
     'in the namespace "team-a"', RejectedError, "Forbidden"),
    ('pods "tj-a1-n0" is forbidden: violates PodSecurity "restricted:latest": hostPath volumes (volume "data")',
     PermanentError, "PodSecurity"),
    ('pods "tj-a1-n0" is forbidden: maximum cpu usage per Container is 200m, but limit is 1',
     PermanentError, "PodRejected"),
]


@pytest.mark.parametrize("api_message,kind,reason", CASES, ids=[c[2] for c in CASES])
def test_forbidden_pod_creates_are_classified(api_message: str, kind: type, reason: str) -> None:
    err = classify_forbidden(api_message, f"create pod tj-a1-n0: {api_message}")
    assert isinstance(err, kind) and err.reason == reason and api_message in str(err)
