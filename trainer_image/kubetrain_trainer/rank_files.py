"""Which files of a checkpoint only one rank loads: the record a strategy writes, and the restore's choice.

A sharded strategy's checkpoint holds files that only one rank reads back when the world size is
unchanged (its own shards), beside files every rank reads. The strategy says which in a
`layout.RANK_FILES_NAME` record in the folder it wrote (FSDP: `strategies/dcp_files.py`, one per
DCP folder). A node then restores the files private to its own ranks and every other file: with 2
nodes, about half the bytes. With another world size, or without a record, it restores everything.

Pure: no I/O, no torch (the launcher imports it before any worker starts).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Iterable, Mapping

from kubetrain_trainer.layout import RANK_FILES_NAME
from kubetrain_trainer.manifest import FileEntry, ManifestError, is_safe_relpath

log = logging.getLogger(__name__)

FORMAT = 1
SHARED_MARK = "shared"
"""DCP files named `__<rank>_shared.distcp` hold what every rank loads (`strategies/dcp_files.py`)."""


@dataclass(frozen=True)
class RankFiles:
    """Files (relative to the record's folder) that only one rank loads, at `world_size`."""

    world_size: int
    private: Mapping[int, tuple[str, ...]]

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT, "world_size": self.world_size,
                           "private": {str(r): list(p) for r, p in sorted(self.private.items())}},
                          indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> "RankFiles":
        try:
            raw = json.loads(data)
        except ValueError as e:
            raise ManifestError(f"{RANK_FILES_NAME}: not JSON: {e}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ManifestError(f"{RANK_FILES_NAME}: format must be {FORMAT}")
        world, private = raw.get("world_size"), raw.get("private")
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise ManifestError(f"{RANK_FILES_NAME}: world_size must be a positive integer")
        if not isinstance(private, dict):
            raise ManifestError(f"{RANK_FILES_NAME}: private must be an object of rank -> file names")
        out: dict[int, tuple[str, ...]] = {}
        for rank, names in private.items():
            if not (isinstance(rank, str) and rank.isdigit() and int(rank) < world):
                raise ManifestError(f"{RANK_FILES_NAME}: private: rank {rank!r} is not below world_size {world}")
            if not isinstance(names, list) or not all(isinstance(n, str) and is_safe_relpath(n) for n in names):
                raise ManifestError(f"{RANK_FILES_NAME}: private[{rank}] must be a list of relative file names")
            out[int(rank)] = tuple(names)
        return cls(world_size=world, private=out)


@dataclass(frozen=True)
class NodeRanks:
    """This node's workers' global ranks, and the gang's world size."""

    ranks: range
    world_size: int

    @classmethod
    def of(cls, *, node_rank: int, nnodes: int, world_size: int) -> "NodeRanks":
        """Node `node_rank` runs ranks node_rank * n .. node_rank * n + n - 1 (n = world_size / nnodes), as the launcher numbers them."""
        per_node = world_size // nnodes
        return cls(ranks=range(node_rank * per_node, (node_rank + 1) * per_node), world_size=world_size)

    def not_needed(self, files: Iterable[FileEntry], raw_records: Mapping[str, bytes]) -> set[str]:
        """`not_needed` for this node, from the records' bytes; an unreadable record makes every file needed."""
        try:
            records = {path: RankFiles.from_json(data) for path, data in raw_records.items()}
        except ManifestError as e:
            log.warning("restoring every file: %s", e)
            return set()
        return not_needed(files, records, ranks=self.ranks, world_size=self.world_size)


def is_rank_files_record(path: str) -> bool:
    return PurePosixPath(path).name == RANK_FILES_NAME


def not_needed(files: Iterable[FileEntry], records: Mapping[str, RankFiles], *, ranks: range,
               world_size: int) -> set[str]:
    """Paths of `files` that no rank in `ranks` loads: those private to other ranks.

    `records` maps each record's path (relative to the checkpoint folder) to its parsed content. A
    record written at another world size makes nothing skippable (a reshaped load reads other ranks'
    shards), and so does a file named private to two ranks. Anything not named by a record is needed."""
    if not records or any(r.world_size != world_size for r in records.values()):
        return set()
    owner: dict[str, int] = {}
    for where, record in records.items():
        folder = PurePosixPath(where).parent
        for rank, names in record.private.items():
            for name in names:
                path = str(folder / name)
                if owner.setdefault(path, rank) != rank:
                    return set()
    present = {f.path for f in files}
    return {path for path, rank in owner.items() if rank not in ranks and path in present}
