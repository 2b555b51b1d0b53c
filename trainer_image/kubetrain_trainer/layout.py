"""Where checkpoints live: every folder and file name of the checkpoint path, locally and in storage.

One home for the names that the Trainer's save, the launcher's watcher, the
uploader, storage and restore must agree on (docs/contract.md, "Checkpoint
layout in storage"):

    <output_dir>/tmp-checkpoint-<step>/          a save in progress (renamed when complete)
    <output_dir>/checkpoint-<step>/              a local checkpoint (HF Trainer layout inside)
    <uri>/checkpoint-<step>/<files...>
    <uri>/checkpoint-<step>/manifest.node-<r>.json   one node's part (multi-node)
    <uri>/checkpoint-<step>/manifest.json        the commit record, written last
    <uri>/checkpoint-<step>/corrupt.node-<r>.<inc>-<att>.json   node r found a file of that writer's commit corrupt
    <uri>/final/...                              the finished model
    <uri>/attempts/<incarnation>-<attempt>.json  one claim per attempt

It imports nothing of the trainer (an import-linter contract), so any module
may import it.
"""

from __future__ import annotations

import re
from typing import Iterable, TypeVar

T = TypeVar("T")

PREFIX = "checkpoint"
TMP_PREFIX = "tmp-checkpoint"
"""A save in progress: never discovered, never uploaded, removed at the next start."""
TRAINER_STATE = "trainer_state.json"
"""Written last into a checkpoint by the HF Trainer and by kubetrain's: a local folder with it is complete."""
KUBETRAIN_STATE = "kubetrain_state.json"
"""Beside `trainer_state.json` in kubetrain's checkpoints, written just before it: what an exact resume needs
beyond HF's `TrainerState` fields (the data position, the loss sums since the last log), so that
`trainer_state.json` holds HF's fields only and `transformers.TrainerState.load_from_json` reads it."""
MANIFEST_NAME = "manifest.json"
FINAL_FOLDER = "final"
CLAIMS_FOLDER = "attempts"
"""`<uri>/attempts/<incarnation>-<attempt>.json`: one claim per attempt, written by node rank 0 at start."""
RANK_FILES_NAME = "kubetrain-rank-files.json"
"""Beside a sharded strategy's files: which of them only one rank loads (`rank_files.py`), so a restore
on one node can leave the other nodes' shards in storage."""
EVAL_PREFIX = "eval_"

_CHECKPOINT_DIR = re.compile(rf"^{PREFIX}-(\d+)$")
_NODE_PART = re.compile(r"^manifest\.node-(\d+)\.json$")
_CORRUPT = re.compile(r"^corrupt\.node-(\d+)\.(\d+)-(\d+)\.json$")


def checkpoint_dirname(step: int) -> str:
    return f"{PREFIX}-{step}"


def tmp_dirname(step: int) -> str:
    return f"{TMP_PREFIX}-{step}"


def parse_checkpoint_dirname(name: str) -> int | None:
    """The step of a `checkpoint-<step>` folder name, None for any other name."""
    m = _CHECKPOINT_DIR.match(name)
    return int(m.group(1)) if m else None


def by_step(named: Iterable[tuple[str, T]]) -> list[tuple[int, T]]:
    """(step, item) of every `checkpoint-<step>` name, oldest first: steps compare as numbers
    (`checkpoint-10` after `checkpoint-9`); retention deletes from the front."""
    return sorted(((step, item) for name, item in named if (step := parse_checkpoint_dirname(name)) is not None),
                  key=lambda pair: pair[0])


def node_part_name(node_rank: int) -> str:
    return f"manifest.node-{node_rank}.json"


def corrupt_marker_name(node_rank: int, writer: tuple[int, int]) -> str:
    """`<uri>/checkpoint-<step>/corrupt.node-<r>.<incarnation>-<attempt>.json`: node r found a file of
    the checkpoint that writer (incarnation, attempt) committed there not matching its manifest (a file
    only its ranks load, which node rank 0 never read), so the next attempt's restore passes over it.
    Named after the writer: a later commit of the same step by another writer is not condemned by it."""
    return f"corrupt.node-{node_rank}.{writer[0]}-{writer[1]}.json"


def parse_corrupt_marker(name: str) -> tuple[int, int] | None:
    """The (incarnation, attempt) a corrupt marker condemns, None for any other name."""
    m = _CORRUPT.match(name)
    return (int(m.group(2)), int(m.group(3))) if m else None


def is_manifest_name(name: str) -> bool:
    """Commit records are never listed as checkpoint files themselves."""
    return name == MANIFEST_NAME or _NODE_PART.match(name) is not None


def claim_name(incarnation: int, attempt: int) -> str:
    return f"{incarnation}-{attempt}.json"


def parse_claim_name(name: str) -> tuple[int, int] | None:
    """(incarnation, attempt) from `<incarnation>-<attempt>.json`, None for anything else."""
    stem, dot, ext = name.partition(".")
    inc, dash, att = stem.partition("-")
    if not (dot and ext == "json" and dash and inc.isdigit() and att.isdigit()):
        return None
    return int(inc), int(att)


def metric_key(name: str) -> str:
    """The logged key of `metric_for_best_model`: evaluation metrics carry the `eval_` prefix (HF's rule)."""
    return name if name.startswith(EVAL_PREFIX) else f"{EVAL_PREFIX}{name}"
