"""HF's process properties of `TrainingArguments` (a mixin: it adds no fields).

HF scripts ask the arguments about the process they run in (`args.world_size`,
`args.should_save`, `args.device`, `with args.main_process_first():`) before a
Trainer exists. Ranks come from the environment (`workerenv.py`); torch is
imported only when a property needs it.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .loglevels import ProcessLogLevels
from .workerenv import WorkerEnv


class ProcessArguments(ProcessLogLevels):
    """`world_size`, `should_save`, `n_gpu`, `device`, the batch sizes and `main_process_first` of HF's arguments
    (process_index, local_process_index and should_log come with ProcessLogLevels)."""

    use_cpu: bool
    ddp_timeout: int
    per_device_train_batch_size: int
    per_device_eval_batch_size: int

    @property
    def world_size(self) -> int:
        """Processes in the run (WORLD_SIZE), as HF's `args.world_size`."""
        return WorkerEnv.from_environ().world_size

    @property
    def should_save(self) -> bool:
        """Whether this process writes what one process writes (the world's main one), as in HF."""
        return self.process_index == 0

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: one (its local rank's) or none; HF's data-parallel-in-one-process is not done."""
        import torch

        return int(torch.cuda.is_available() and not self.use_cpu)

    @property
    def device(self) -> Any:
        from .distributed import device_for

        return device_for(self.use_cpu)

    @property
    def train_batch_size(self) -> int:
        """One process's micro-batch, as HF's `args.train_batch_size`."""
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        return self.per_device_eval_batch_size

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Any:
        """As HF's: the main process (of the node with `local`, else of the world) runs the block first, then the
        others (a dataset's map cached by the first). HF scripts call it before the Trainer exists: the process
        group is joined here then, as HF's arguments do (the Trainer reuses it)."""
        import torch.distributed as dist

        from .distributed import init_process_group

        if self.world_size > 1:
            init_process_group(use_cpu=self.use_cpu, timeout_s=self.ddp_timeout)
        together = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        main = (self.local_process_index if local else self.process_index) == 0
        if together and not main:
            dist.barrier()
        yield
        if together and main:
            dist.barrier()
