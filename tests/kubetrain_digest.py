"""The `xxh128` digest of a checkpoint file, written from its definition in docs/contract.md.

An oracle beside the trainer's own (`hashing.file_digest`, `landing.PartHashingFile`): the XXH3-128 of
the concatenated XXH3-128 digests of the bytes' consecutive 8 MiB parts.
"""

from __future__ import annotations

import xxhash

PART = 8 * 1024 * 1024


def xxh128_of(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(b"".join(xxhash.xxh3_128_digest(data[i:i + PART])
                                              for i in range(0, len(data), PART)))
