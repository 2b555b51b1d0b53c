"""What pods and the API server say is redacted before it reaches status or events."""

from __future__ import annotations

import pytest

from kubetrain.redact import redact

SECRETS = [
    ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "wJalrXUtnFEMI"),
    ("aws_access_key_id: AKIAIOSFODNN7EXAMPLE", "AKIAIOSFODNN7EXAMPLE"),
    ("key AKIAIOSFODNN7EXAMPLE in the middle", "AKIAIOSFODNN7EXAMPLE"),
    ('password="p4ss w0rd"', "p4ss w0rd"),
    ("HF_TOKEN=hf_abcdefghijklmnop", "hf_abcdefghijklmnop"),
    ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig", "eyJhbGciOiJIUzI1NiJ9"),
    ("failed to fetch https://alice:s3cr3t@registry.example/v2/", "s3cr3t"),
    ("X-Amz-Security-Token: FQoGZXIvYXdzEJr//////////", "FQoGZXIvYXdzEJr"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----", "MIIEow"),
]


@pytest.mark.parametrize("text,secret", SECRETS, ids=[s[1][:12] for s in SECRETS])
def test_secret_shaped_values_are_redacted(text: str, secret: str) -> None:
    out = redact(text)
    assert secret not in out
    assert "***" in out or "REDACTED" in out


@pytest.mark.parametrize("text", [
    'secret "s3-creds" not found',
    'Back-off pulling image "registry.local:30500/kubetrain/trainer:0.1.0"',
    "pods \"tj-a1-n0\" is forbidden: exceeded quota: q, requested: pods=1, used: pods=1, limited: pods=1",
    "The node was low on resource: memory. Threshold quantity: 100Mi, available: 80Mi.",
])
def test_ordinary_messages_are_kept_whole(text: str) -> None:
    assert redact(text) == text
