"""The start-up retry policy: which storage errors are retried, and for how long (pure, no S3).

Refused access and a missing bucket (S3 401/403/404) are retried at start for
KUBETRAIN_S3_AUTH_RETRY_SECONDS, because a Secret, an IAM policy or a bucket
may still be propagating; then the launcher exits 82 naming the location.
The same code against a real MinIO: tests/integration/trainer_storage/test_ckpt_access_window_minio.py.
"""

from __future__ import annotations

import pytest

from kubetrain_trainer.launch_config import ConfigError, LaunchConfig
from kubetrain_trainer.retry import Backoff, retrying, should_retry
from kubetrain_trainer.storage_errors import StorageAccessError, StoragePermanentError, StorageTemporaryError

ACCESS = StorageAccessError("list s3://b/p/: InvalidAccessKeyId")
TEMPORARY = StorageTemporaryError("list s3://b/p/: connection refused")
PERMANENT = StoragePermanentError("list s3://b/p/: InvalidBucketName")


@pytest.mark.parametrize(
    "error, now, delay, deadline, access_deadline, retry",
    [
        # temporary: until the restore deadline (None: forever)
        (TEMPORARY, 0.0, 5.0, 10.0, None, True),
        (TEMPORARY, 6.0, 5.0, 10.0, None, False),
        (TEMPORARY, 1e9, 5.0, None, None, True),
        # refused access: only inside its own window...
        (ACCESS, 0.0, 5.0, 600.0, 120.0, True),
        (ACCESS, 116.0, 5.0, 600.0, 120.0, False),
        (ACCESS, 0.0, 5.0, 600.0, None, False),  # no window: first sight is final (uploads, final model)
        # ...and never past the overall deadline
        (ACCESS, 0.0, 5.0, 3.0, 120.0, False),
        (ACCESS, 0.0, 5.0, None, 120.0, True),
        # other permanent errors: never
        (PERMANENT, 0.0, 0.1, 600.0, 120.0, False),
    ],
)
def test_should_retry(error, now, delay, deadline, access_deadline, retry):
    assert should_retry(error, now=now, delay=delay, deadline=deadline, access_deadline=access_deadline) is retry


def _failing(errors: list[Exception]):
    calls = []

    def fn():
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return "ok"

    return fn, calls


FAST = Backoff(initial_s=0.001, maximum_s=0.002)


def test_refused_access_is_retried_within_its_window_then_succeeds():
    fn, calls = _failing([ACCESS, ACCESS, TEMPORARY])
    assert retrying(fn, deadline=None, access_deadline=float("inf"), backoff=FAST, sleep=lambda _: None) == "ok"
    assert len(calls) == 4


def test_refused_access_without_a_window_is_raised_at_first_sight():
    fn, calls = _failing([ACCESS])
    with pytest.raises(StorageAccessError):
        retrying(fn, deadline=None, backoff=FAST, sleep=lambda _: None)
    assert len(calls) == 1


def test_refused_access_past_its_window_is_raised():
    fn, calls = _failing([ACCESS] * 1000)
    with pytest.raises(StorageAccessError):
        retrying(fn, deadline=None, access_deadline=0.0, backoff=FAST, sleep=lambda _: None)
    assert len(calls) == 1


def test_cancelled_stops_the_retries_with_the_last_error():
    fn, calls = _failing([TEMPORARY] * 1000)
    with pytest.raises(StorageTemporaryError):
        retrying(fn, deadline=None, backoff=FAST, sleep=lambda _: None, cancelled=lambda: len(calls) >= 3)
    assert len(calls) == 3


def test_the_access_window_is_read_from_the_environment():
    assert LaunchConfig.from_env({}, []).access_retry_s == 120.0
    assert LaunchConfig.from_env({"KUBETRAIN_S3_AUTH_RETRY_SECONDS": "7.5"}, []).access_retry_s == 7.5
    for bad in ("soon", "0", "-3"):
        with pytest.raises(ConfigError, match="^KUBETRAIN_S3_AUTH_RETRY_SECONDS:"):
            LaunchConfig.from_env({"KUBETRAIN_S3_AUTH_RETRY_SECONDS": bad}, [])


def test_a_backoff_polled_for_a_long_time_stays_at_its_cap() -> None:
    """The restore-decision poll counts its polls without limit (a rank waiting on rank 0's long download):
    `factor ** (polls - 1)` overflowed a float at poll 1025 and the launcher died with a traceback."""
    poll = Backoff(initial_s=0.05, maximum_s=1.0)
    for polls in (1, 5, 1025, 10**6):
        assert 0 < poll.delay(polls) <= 1.0
    assert poll.delay(10**6) >= 0.5  # full jitter over [cap / 2, cap]
    assert Backoff(initial_s=0.05, maximum_s=1.0, factor=1.0).delay(10**6) <= 0.05
