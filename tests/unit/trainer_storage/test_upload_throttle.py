"""The KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND test hook: all of a store's transfer threads share one
clock, so the cap holds for the pod, not per thread (a fake clock; the hook's real effect on a MinIO upload
is what the real-node grace test measures)."""

import threading

import pytest

from kubetrain_trainer.storage import StorageConfig, _Throttle


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []
        self.lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        with self.lock:
            self.slept.append(s)


def test_chunks_reserve_time_one_after_another_at_the_rate():
    clock = FakeClock()
    throttle = _Throttle(1000, clock=clock, sleep=clock.sleep)
    for _ in range(3):
        throttle(500)
    # 1500 bytes at 1000 B/s, reserved back to back from t=100: each chunk waits for its slot's end.
    assert clock.slept == pytest.approx([0.5, 1.0, 1.5])


def test_idle_time_is_not_saved_up_for_a_burst():
    clock = FakeClock()
    throttle = _Throttle(1000, clock=clock, sleep=clock.sleep)
    throttle(1000)
    clock.now += 60  # a minute without uploads
    throttle(1000)
    assert clock.slept == pytest.approx([1.0, 1.0])


def test_threads_share_the_cap():
    clock = FakeClock()
    throttle = _Throttle(1000, clock=clock, sleep=clock.sleep)
    threads = [threading.Thread(target=throttle, args=(1000,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Four 1000-byte chunks at once take 4 s together, whichever thread goes first.
    assert sorted(clock.slept) == pytest.approx([1.0, 2.0, 3.0, 4.0])


def test_the_hook_is_read_from_the_environment_and_off_by_default():
    base = {"KUBETRAIN_CHECKPOINT_URI": "s3://b/p"}
    assert StorageConfig.from_env(base).test_upload_bytes_per_second == 0
    assert StorageConfig.from_env(base | {"KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND": "250000"}
                                  ).test_upload_bytes_per_second == 250000
    with pytest.raises(ValueError, match="KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND"):
        StorageConfig.from_env(base | {"KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND": "fast"})


def test_the_storage_reads_every_value_the_launchers_check_accepts():
    """The launcher checks the hook first (exit 82 when it is wrong); a value it accepted ("+5", " 7 ") made the
    storage raise later, and the launcher exit 1."""
    from kubetrain_trainer.launch_config import ConfigError, LaunchConfig

    base = {"KUBETRAIN_CHECKPOINT_URI": "s3://b/p"}
    launch_env = {"KUBETRAIN_CHECKPOINT_URI": "s3://b/p", "KUBETRAIN_JOB_NAME": "j", "KUBETRAIN_NAMESPACE": "ns"}
    for raw, expected in (("+5", 5), (" 7 ", 7), ("0", 0)):
        LaunchConfig.from_env(launch_env | {"KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND": raw}, [])
        assert StorageConfig.from_env(base | {"KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND": raw}
                                      ).test_upload_bytes_per_second == expected
    for raw in ("-5", "1e3"):
        with pytest.raises(ConfigError, match="^KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND:"):
            LaunchConfig.from_env(launch_env | {"KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND": raw}, [])
        with pytest.raises(ValueError, match="KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND"):
            StorageConfig.from_env(base | {"KUBETRAIN_TEST_UPLOAD_BYTES_PER_SECOND": raw})
