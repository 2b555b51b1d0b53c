"""The testbed's STS roles' policies are created through MinIO's admin API as the testbed starts. MinIO
reports itself live a moment before its admin API answers (503 until its IAM subsystem is up; it failed a
full test run once), so a 503 is waited out for a bounded time and anything else fails at once. The HTTP
exchange is replaced by a recorder: what is tested is the retry decision."""

import pytest

from kubetrain_testbed import sts


class Admin:
    def __init__(self, answers):
        self.answers, self.calls, self.now, self.slept = list(answers), [], 0.0, 0.0

    def send(self, method, url, body, headers):
        self.calls.append((method, url, headers.get("Authorization", "")))
        return self.answers.pop(0) if self.answers else 200

    def clock(self):
        return self.now

    def sleep(self, s):
        self.slept += s
        self.now += s


def _create(admin, timeout=60.0):
    sts.create_policies(endpoint="http://127.0.0.1:9000", access_key="k", secret_key="s", region="us-east-1",
                        bucket="b", send=admin.send, timeout=timeout, clock=admin.clock, sleep=admin.sleep)


def test_a_503_is_retried_until_the_admin_api_answers_and_every_role_gets_its_policy():
    admin = Admin([503, 503, 503])
    _create(admin)
    urls = [u for _, u, _ in admin.calls]
    assert len(urls) == 3 + len(sts.ROLES)
    assert {u.rsplit("=", 1)[1] for u in urls} == {r.policy for r in sts.ROLES}
    assert all(auth.startswith("AWS4-HMAC-SHA256") for _, _, auth in admin.calls)
    assert admin.slept == pytest.approx(1.5)


def test_a_503_that_lasts_past_the_timeout_fails_naming_the_policy():
    admin = Admin([503] * 1000)
    with pytest.raises(RuntimeError, match=rf"{sts.ROLES[0].policy}: HTTP 503 \(still after 5 s\)"):
        _create(admin, timeout=5)
    assert admin.now >= 5 and len(admin.calls) <= 12


@pytest.mark.parametrize("status", [400, 403])
def test_other_refusals_fail_at_once(status):
    admin = Admin([status])
    with pytest.raises(RuntimeError, match=f"HTTP {status}$"):
        _create(admin)
    assert len(admin.calls) == 1 and admin.slept == 0
