"""Process-group facts the loop needs: who am I, how many are we, which device.

The launcher (or torchrun) starts one process per device and sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (read by `workerenv.py`).
Everything else reads them through here so that a world size of one never
touches torch.distributed.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import time
from typing import Any

import torch
import torch.distributed as dist

from kubetrain_trainer.args_values import ConfigError
from kubetrain_trainer.workerenv import WorkerEnv


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return WorkerEnv.from_environ().world_size


def rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return WorkerEnv.from_environ().rank


def local_rank() -> int:
    return WorkerEnv.from_environ().local_rank


def is_main_process() -> bool:
    return rank() == 0


def is_local_main_process() -> bool:
    return local_rank() == 0


def device_for(use_cpu: bool) -> torch.device:
    """The device of this process: its local GPU, or the CPU."""
    if torch.cuda.is_available() and not use_cpu:
        rank, count = local_rank(), torch.cuda.device_count()
        if rank >= count:  # else torch's "invalid device ordinal", naming nothing the user set
            raise ConfigError(f"NPROC_PER_NODE (spec.procsPerNode): local rank {rank} has no GPU of its own; this "
                              f"pod sees {count} GPU(s): at most one process per GPU (or use_cpu)")
        return torch.device("cuda", rank)
    return torch.device("cpu")


def init_process_group(*, use_cpu: bool, timeout_s: int) -> None:
    """Join the process group described by the environment (no-op for one process)."""
    if WorkerEnv.from_environ().world_size <= 1 or dist.is_initialized():
        return
    device = device_for(use_cpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    if backend == "gloo":
        settle_gloo_at_exit()


GLOO_EXIT_PAUSE_S = 0.1
"""How long a process that joined a gloo group waits at exit, once the group is destroyed, before finalizing."""


@functools.cache  # once per process
def settle_gloo_at_exit() -> None:
    """Once per process, for a gloo group joined here or by the script (an HF script's): at exit, destroy it while
    the interpreter is whole, then pause `GLOO_EXIT_PAUSE_S`. Without the pause, torch 2.13's gloo aborted about one
    2-rank run in three as it finalized (SIGABRT, "terminate called without an active exception"; a plain
    all_reduce script too, with or without destroy_process_group), which the launcher counts as a failed run;
    measured here: 8 of 30 runs aborted, 0 of 30 with the pause. NCCL's teardown needs the peers (it can hang),
    so an NCCL group is left to the script, as in HF."""
    atexit.register(_destroy_gloo_group)


def _destroy_gloo_group() -> None:
    try:
        if dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (exiting: never turn a finished run into a traceback)
        pass
    time.sleep(GLOO_EXIT_PAUSE_S)  # the group's threads wind down before finalization frees what they hold


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def any_rank(flag: bool, device: torch.device) -> bool:
    """*Collective.* True on every rank when `flag` is true on at least one."""
    if world_size() <= 1:
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_object(obj: Any) -> Any:
    """*Collective.* Rank 0's `obj` on every rank."""
    if world_size() <= 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """*Collective.* Every rank's `obj`, in rank order, on every rank."""
    if world_size() <= 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out
