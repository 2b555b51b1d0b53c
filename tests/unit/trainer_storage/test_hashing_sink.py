"""HashingSink: the stream a restore downloads into, hashing the bytes on their way to the file."""

from __future__ import annotations

import hashlib
import io
import os

from s3transfer.compat import seekable
from s3transfer.download import DeferQueue

from kubetrain_trainer.hashing import HashingSink


def test_s3transfer_sees_a_stream_so_it_writes_every_part_in_order():
    # The property the restore relies on: without seek, s3transfer picks its in-order (DeferQueue) writer.
    assert not seekable(HashingSink(io.BytesIO()))


def test_parts_arriving_out_of_order_reach_file_and_hash_in_order():
    data = os.urandom(10_000)
    parts = [(offset, data[offset:offset + 1024]) for offset in range(0, len(data), 1024)]
    order = parts[3:] + parts[1:3] + parts[:1]  # the first part lands last
    out = io.BytesIO()
    sink, queue = HashingSink(out), DeferQueue()
    for offset, chunk in order + parts[5:6]:  # and one part arrives twice (a retried range)
        for write in queue.request_writes(offset, chunk):
            sink.write(write["data"])
    assert out.getvalue() == data
    assert sink.size == len(data)
    assert sink.hexdigest() == hashlib.sha256(data).hexdigest()
