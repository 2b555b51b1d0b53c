"""Each package writes times through one helper, in the forms the API server and the records expect.

Kubernetes stores `Time` to the second and a Lease's `MicroTime` to the
microsecond, both in UTC with a `Z`; the trainer's records (manifest `created`,
last-checkpoint `time`, `/progress` `updatedAt`) use the second form too.
"""

from __future__ import annotations

import datetime as dt
import re

from kubetrain.values import format_time, parse_time
from kubetrain_testbed.agent_api import now_str
from kubetrain_trainer.manifest import rfc3339

AT = dt.datetime(2026, 3, 4, 5, 6, 7, 890123, tzinfo=dt.timezone(dt.timedelta(hours=2)))
SECONDS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")
MICRO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


def test_operator_time_and_micro_time():
    assert format_time(AT) == "2026-03-04T03:06:07Z"
    assert format_time(AT, micro=True) == "2026-03-04T03:06:07.890123Z"
    assert parse_time(format_time(AT, micro=True)) == AT
    assert format_time(None) is None


def test_trainer_records_time_from_an_epoch_or_now():
    assert rfc3339(AT.timestamp()) == "2026-03-04T03:06:07Z"
    assert SECONDS.fullmatch(rfc3339())


def test_testbed_agent_time_and_micro_time():
    assert SECONDS.fullmatch(now_str()) and MICRO.fullmatch(now_str(micro=True))
