"""`landing.fetch_whole`: a small object read by one GET, hashed as it lands, a broken-off read started again.

The GET's streaming body is the unit boundary here (`_Body`: botocore's `StreamingBody` interface, reading
from bytes); the real GET against MinIO runs in the integration tier's restores.
"""

from __future__ import annotations

import hashlib
import os

import pytest
from botocore.exceptions import ResponseStreamingError

from kubetrain_digest import xxh128_of
from kubetrain_trainer.landing import fetch_whole
from kubetrain_trainer.manifest import SHA256, XXH128

CONTENT = os.urandom(5 * (1 << 20) + 12345)  # not a whole number of chunks or digest parts


class _Body:
    """A GET's body: `iter_chunks` of `data`, breaking off after `break_after` chunks if given."""

    def __init__(self, data: bytes, break_after: int | None = None) -> None:
        self.data, self.break_after, self.closed = data, break_after, False

    def iter_chunks(self, chunk_size: int):
        for n, start in enumerate(range(0, len(self.data), chunk_size)):
            if self.break_after is not None and n == self.break_after:
                raise ResponseStreamingError(error="Connection broken: IncompleteRead")
            yield self.data[start:start + chunk_size]

    def close(self) -> None:
        self.closed = True


def _gets(*bodies: _Body):
    sent = []

    def get_body() -> _Body:
        body = bodies[len(sent)]
        sent.append(body)
        return body

    return get_body, sent


@pytest.mark.parametrize("algorithm", [XXH128, SHA256])
def test_the_object_lands_whole_with_its_digest(tmp_path, algorithm):
    get_body, sent = _gets(_Body(CONTENT))
    size, digest = fetch_whole(get_body, tmp_path / "f", algorithm, lambda: None)
    expected = xxh128_of(CONTENT) if algorithm == XXH128 else hashlib.sha256(CONTENT).hexdigest()
    assert (size, digest) == (len(CONTENT), expected)
    assert (tmp_path / "f").read_bytes() == CONTENT
    assert len(sent) == 1 and sent[0].closed


def test_a_read_broken_off_starts_again_from_the_first_byte(tmp_path):
    get_body, sent = _gets(_Body(CONTENT, break_after=3), _Body(CONTENT, break_after=1), _Body(CONTENT))
    size, digest = fetch_whole(get_body, tmp_path / "f", XXH128, lambda: None)
    assert (size, digest) == (len(CONTENT), xxh128_of(CONTENT))  # nothing of the broken reads counted twice
    assert (tmp_path / "f").read_bytes() == CONTENT
    assert len(sent) == 3 and all(body.closed for body in sent)


def test_a_read_that_keeps_breaking_off_fails_after_its_attempts(tmp_path):
    get_body, sent = _gets(*[_Body(CONTENT, break_after=2) for _ in range(5)])
    with pytest.raises(ResponseStreamingError):
        fetch_whole(get_body, tmp_path / "f", XXH128, lambda: None, attempts=5)
    assert len(sent) == 5


def test_a_stop_between_chunks_is_not_retried(tmp_path):
    class Stopped(Exception):
        pass

    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise Stopped("SIGTERM")

    get_body, sent = _gets(_Body(CONTENT), _Body(CONTENT))
    with pytest.raises(Stopped):
        fetch_whole(get_body, tmp_path / "f", XXH128, check)
    assert len(sent) == 1 and sent[0].closed
