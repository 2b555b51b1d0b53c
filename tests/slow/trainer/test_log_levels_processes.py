"""log_level / log_level_replica / log_on_each_node across real processes and (simulated) nodes.

Two gloo processes either as 2 nodes x 1 process (each is its node's local main process: RANK 0 and 1,
LOCAL_RANK 0) or as 1 node x 2 processes (LOCAL_RANK 0 and 1). Each rank trains one real step per
configuration and then logs a probe at every level through the trainer's logger; the records each rank
printed must be exactly the levels the HF rules give it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kubetrain_testbed import free_port

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("log_levels_worker.py")
ALL = ["DEBUG", "INFO", "WARNING", "ERROR"]
FROM = {level: ALL[ALL.index(level):] for level in ALL}


def run_ranks(configs: list[dict], *, nodes: int) -> dict[int, str]:
    """Both ranks' stdout; `nodes`=2: one process per node, 1: both processes on one node."""
    port, procs = free_port(), []
    for rank in (0, 1):
        local_rank = 0 if nodes == 2 else rank
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": str(2 // nodes), "NODE_RANK": str(rank if nodes == 2 else 0),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(configs)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = {}
    try:
        for rank, proc in enumerate(procs):
            outputs[rank], _ = proc.communicate(timeout=300)
            assert proc.returncode == 0, outputs[rank][-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return outputs


def seen(output: str, rank: int, name: str) -> list[str]:
    return re.findall(rf"^rank={rank} (\w+) probe {name}$", output, re.M)


def asked(output: str, rank: int, name: str) -> str:
    return re.search(rf"^rank={rank} ASKED {name} (\w+)$", output, re.M).group(1)


def config(name, log_level, log_level_replica, log_on_each_node, app_level="WARNING"):
    return dict(name=name, log_level=log_level, log_level_replica=log_level_replica,
                log_on_each_node=log_on_each_node, app_level=app_level)


# name -> config, and the lowest level each rank logs at
TWO_NODES = {
    "each_node": (config("each_node", "debug", "error", True), ("DEBUG", "DEBUG")),
    "node0_only": (config("node0_only", "debug", "error", False), ("DEBUG", "ERROR")),
    "passive_main": (config("passive_main", "passive", "error", False, app_level="INFO"), ("INFO", "ERROR")),
}
ONE_NODE = {
    "replica": (config("replica", "debug", "error", True), ("DEBUG", "ERROR")),
    "passive_replica": (config("passive_replica", "info", "passive", True, app_level="DEBUG"), ("INFO", "DEBUG")),
}


@pytest.mark.parametrize("nodes,table", [(2, TWO_NODES), (1, ONE_NODE)], ids=["2x1", "1x2"])
def test_each_rank_logs_at_its_level(nodes, table):
    outputs = run_ranks([c for c, _ in table.values()], nodes=nodes)
    for name, (_, lowest) in table.items():
        for rank in (0, 1):
            assert seen(outputs[rank], rank, name) == FROM[lowest[rank]], (name, rank, outputs[rank][-2000:])
            assert asked(outputs[rank], rank, name) == lowest[rank], (name, rank)
