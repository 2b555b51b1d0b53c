"""DCP files laid out per rank, so that a restore on one node fetches only its own ranks' shards.

torch.distributed.checkpoint writes one file per rank, `__<rank>_0.distcp`, holding all that rank
saves: its shards and its share of the items every rank holds (optimizer step counts, param group
values, unsharded buffers), which DCP de-duplicates and spreads over the ranks. A rank loading at
the same world size reads its own file and pieces of every other one, so every node needed the
whole checkpoint.

`RankFilesWriter` puts the proper shards of a tensor (a chunk smaller than the tensor) into
`__<rank>_0.distcp` and everything else into `__<rank>_shared.distcp`. Its coordinator then writes
`layout.RANK_FILES_NAME` beside `.metadata`: which files are private to which rank
(`rank_files.RankFiles`). The launcher restores only its node's private files and every shared one
when the world size is unchanged (`storage.CheckpointStore.download_checkpoint`). The checkpoint
stays a standard DCP checkpoint, because `.metadata` names each item's file: `dcp.load` reads it as
before, at any world size.

A rank loads exactly the shards it saved only when a proper shard has one holder, and the world
size is the same. `FSDPStrategy` builds FSDP2 on a 1-D mesh, where both hold. A replicated
placement (HSDP) would break the first; this writer is not for such a mesh.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from kubetrain_trainer.layout import RANK_FILES_NAME
from kubetrain_trainer.rank_files import SHARED_MARK, RankFiles


def is_private(item: WriteItem) -> bool:
    """A proper shard of a tensor: a chunk smaller than the whole, which only its rank loads back."""
    if item.type != WriteItemType.SHARD or item.tensor_data is None:
        return False
    return tuple(item.tensor_data.chunk.sizes) != tuple(item.tensor_data.size)


class RankFilesWriter(FileSystemWriter):
    """A `FileSystemWriter` that keeps each rank's proper shards apart from what every rank loads."""

    def _splits(self) -> bool:
        # One file per item, or a save without collectives (each rank finishes alone): DCP's own
        # layout, and no record, so every node restores every file.
        return self.single_file_per_rank and getattr(self, "use_collectives", True)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        if not self._splits():
            return super().write_data(plan, planner)
        prefix = plan.storage_data.prefix  # "__<rank>_", given by prepare_global_plan
        files: queue.Queue = queue.Queue()
        split: dict[str, list[WriteItem]] = {f"{prefix}0{DEFAULT_SUFFIX}": [],
                                              f"{prefix}{SHARED_MARK}{DEFAULT_SUFFIX}": []}
        private, shared = split.values()
        for item in plan.items:
            (private if is_private(item) else shared).append(item)
        for name, items in split.items():
            if items:
                files.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, files)

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        # The coordinator, after every rank wrote: results[r] are rank r's WriteResults. The record goes
        # first, so a folder with `.metadata` always has it.
        if not self._splits():
            return super().finish(metadata, results)
        private: dict[int, set[str]] = {}
        for rank, written in enumerate(results):
            private[rank] = {r.storage_data.relative_path for r in written
                             if not r.storage_data.relative_path.startswith(f"__{rank}_{SHARED_MARK}")}
        record = RankFiles(world_size=len(results),
                           private={r: tuple(sorted(names)) for r, names in private.items() if names})
        (Path(self.path) / RANK_FILES_NAME).write_bytes(record.to_json())
        super().finish(metadata, results)
