"""The files of a DeepSpeed ZeRO-3 checkpoint: the CPU-copy checkpoint engine of an async save, and
the record of which files only one rank loads.

A ZeRO-3 save writes `<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt` and
`<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt` for every data-parallel rank r. At the
same world size, rank r loads only its own two (DeepSpeed reads the other ranks' partitions only
with `elastic_checkpoint`, which ZeRO-3 no longer supports). `write_rank_files` names them in
`<tag>/kubetrain-rank-files.json` (`rank_files.RankFiles`), so the restore on one node leaves the
other nodes' partitions in storage.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from kubetrain_trainer.layout import RANK_FILES_NAME
from kubetrain_trainer.rank_files import RankFiles
from kubetrain_trainer.strategies.base import CpuStager

log = logging.getLogger(__name__)


class Staging:
    """A DeepSpeed checkpoint engine that keeps a CPU copy of what it is asked to save (for `stage_checkpoint`)."""

    def __init__(self, real: Any, staged: list[tuple[Any, str]], stage: CpuStager) -> None:
        self._real, self._staged, self._stage = real, staged, stage

    def save(self, state_dict: Any, path: str) -> None:
        self._staged.append((self._stage(state_dict), path))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def write_rank_files(engine: Any, directory: Path) -> None:
    """Global rank 0, after its files of the save into `directory` are written: the record of each
    rank's own partition files, in the folder `latest` names. Nothing (every node restores every file)
    when the data-parallel group is not the whole world, with an elastic checkpoint, or when rank 0's
    own files are not where DeepSpeed's naming says."""
    if dist.get_rank() != 0 or engine.zero_elastic_checkpoint():
        return
    world = dist.get_world_size()
    if dist.get_world_size(group=engine.optimizer.dp_process_group) != world or not (directory / "latest").is_file():
        return
    tag = (directory / "latest").read_text().strip()
    folder, bf16 = directory / tag, engine.bfloat16_enabled()
    private = {r: (Path(engine._get_ckpt_name(str(directory), tag, pp_placeholder=r)).name,
                   Path(engine._get_rank_zero_ckpt_name(str(directory), tag, engine.checkpoint_mp_rank, r, bf16)).name)
               for r in range(world)}
    missing = [name for name in private[0] if not (folder / name).is_file()]
    if missing:
        log.warning("%s: no %s there: every node will restore every file of this checkpoint", folder, missing)
        return
    (folder / RANK_FILES_NAME).write_bytes(RankFiles(world_size=world, private=private).to_json())
