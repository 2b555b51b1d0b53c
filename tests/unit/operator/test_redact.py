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
    ("GET https://b.s3.example/k?X-Amz-Signature=0a1b2c3d4e5f&X-Amz-Date=20261205", "0a1b2c3d4e5f"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----", "MIIEow"),
    ('config: {"password": "hunter2", "user": "x"}', "hunter2"),  # quoted keys: JSON, a Python dict's repr
    ("{'aws_secret_access_key': 'wJalrXUtnFEMIK7MDENG'}", "wJalrXUtnFEMIK7MDENG"),
    ('{"api_key":"sk-live-0123456789"}', "sk-live-0123456789"),
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



def test_an_excerpt_of_a_huge_message_is_cut_before_it_is_redacted() -> None:
    """A pod writes its annotations and termination message: 100 kB of one word made the redaction of the
    whole text take minutes of the operator's CPU (the key pattern backtracked at every position). The
    excerpt now redacts only what it keeps (plus a margin), and a secret at the cut is still caught."""
    from kubetrain.draft import MESSAGE_LIMIT, excerpt

    text = "y" * (MESSAGE_LIMIT - 12) + " token=SECRET123456789 " + "z" * 200_000
    out = excerpt(text)
    assert len(out) == MESSAGE_LIMIT and "SECRET" not in out and out.startswith("y" * 100)


def test_a_key_name_longer_than_the_bound_still_has_its_value_redacted() -> None:
    assert "SECRET1" not in redact("x" * 500 + "_token=SECRET1")


def test_a_long_token_in_a_url_and_a_long_key_name_are_still_redacted() -> None:
    from kubetrain.draft import excerpt

    url = "pull failed: https://oauth2:" + "eyJ" + "a" * 700 + "@registry.example/v2/"
    assert "eyJ" not in excerpt(url) and "https://***@" in excerpt(url)
    long_key = "DB_PASSWORD_FOR_THE_PRODUCTION_READ_REPLICA_IN_EU_WEST_1_AND_US_EAST_1_FAILOVER=hunter2"
    assert "hunter2" not in redact(long_key)


@pytest.mark.parametrize("text, secret", [
    ('failed: Get "https://acr.example/v2/?sv=2020&sig=AbCdEf0123456789%2B&se=2030": EOF', "AbCdEf0123456789"),
    ("clone https://ghp_abcdefghijklmnopqrstuvwxyz0123456789@github.com/org/repo.git", "ghp_abcdef"),
    ("run.py --password hunter22 --lr 0.1", "hunter22"),
    ("run.py --hub_token hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567", "hf_AbCdEf"),
    ("auth failed for eyJhbGciOiJSUzI1NiIsImtpZCI6IjEifQ.eyJzdWIiOiJzeXN0ZW0ifQ.c2lnbmF0dXJlc2ln", "eyJhbGci"),
    ("token hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567 refused", "hf_AbCdEf"),
])
def test_more_secret_shapes_are_redacted(text: str, secret: str) -> None:
    assert secret not in redact(text), redact(text)


def test_flags_that_only_look_like_secrets_are_kept() -> None:
    text = "run.py --tokenizer_name gpt2 --max_tokens 5 --design x"
    assert redact(text) == text


def test_masked_secrets_before_the_cut_do_not_pull_a_split_one_into_view() -> None:
    """The excerpt was cut at limit + margin, then redacted: masking a long value before the cut shortened the
    text, and the start of a secret split at the cut (no longer recognisable) moved into the excerpt."""
    from kubetrain.draft import excerpt

    text = "failed to pull: token=" + "x" * 1370 + " retry via https://deploy:Sup3rS3cretPassw0rd@registry/v2/"
    assert "Sup3r" not in excerpt(text) and "https://***@registry" in excerpt(text)
    text = "Secret password=" + "y" * 1395 + " key AKIAIOSFODNN7EXAMPLE is invalid"
    assert "AKIA" not in excerpt(text)


def test_every_line_the_operator_logs_is_redacted(capsys) -> None:
    """The API server's refusal, quoting a pod's env, went to the operator's log as it came (status and events
    had it redacted)."""
    import logging

    from kubetrain.cli import configure_logging

    configure_logging("INFO")
    logging.getLogger("kubetrain.reconciler").error("job %s/%s cannot run: %s", "ml", "train",
                                                    "denied: env AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG")
    err = capsys.readouterr().err
    assert "cannot run: denied: env AWS_SECRET_ACCESS_KEY=***" in err and "wJalr" not in err, err


def test_a_logged_traceback_is_redacted_and_a_bad_log_call_does_not_raise(capsys) -> None:
    import logging

    from kubetrain.cli import configure_logging

    configure_logging("INFO")
    log = logging.getLogger("kubetrain.reconciler")
    try:
        raise RuntimeError("admission webhook denied: env AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMIK7MDENG")
    except RuntimeError:
        log.exception("reconcile of %s crashed", "ns/j")
    err = capsys.readouterr().err
    assert "Traceback" in err and "AWS_SECRET_ACCESS_KEY=***" in err and "wJalr" not in err, err
    # A call whose arguments do not fit its format: the filter lets logging report it ("--- Logging error ---")
    # instead of raising into the caller (a filter's exception is not caught by logging).
    from kubetrain.redact import RedactFilter

    bad = logging.LogRecord("kubetrain", logging.ERROR, __file__, 1, "mismatched %s %s", ("one",), None)
    assert RedactFilter().filter(bad) is True
