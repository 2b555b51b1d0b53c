"""Table tests of the pure commit decision (`decisions.plan_commit`): what the uploader does with one
local checkpoint, from the remote listing, the step, the writer and this node's files."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kubetrain_trainer.decisions import RemoteCheckpoint, plan_commit
from kubetrain_trainer.layout import MANIFEST_NAME
from kubetrain_trainer.manifest import FileEntry, Manifest

A = FileEntry("model.safetensors", 3, "a" * 32)
B = FileEntry("rng_state_1.pth", 1, "b" * 32)
A2 = FileEntry("model.safetensors", 3, "c" * 32)  # same path, other content


def committed(step: int, *files: FileEntry, attempt: int = 2, incarnation: int = 0,
              torn_file: bool = False) -> RemoteCheckpoint:
    """A folder in storage with a manifest; `torn_file`: its first file is not listed beside it."""
    manifest = Manifest(step=step, attempt=attempt, world_size=2, strategy="ddp", files=files, incarnation=incarnation)
    listing = {f.path: f.size for f in (files[1:] if torn_file else files)}
    return RemoteCheckpoint(step=step, manifest=manifest, listing={**listing, MANIFEST_NAME: 100})


def torn(step: int) -> RemoteCheckpoint:
    return RemoteCheckpoint(step=step, manifest=None, listing={"model.safetensors": 3})


@dataclass
class Case:
    id: str
    remote: list[RemoteCheckpoint]
    action: str
    uncommit_first: bool = False
    files: tuple[FileEntry, ...] = (A,)
    nnodes: int = 1
    attempt: int = 2
    incarnation: int = 0
    history: frozenset = frozenset()
    claims: tuple = ()
    reason: str = ""
    extra: dict = field(default_factory=dict)


CASES = [
    Case("nothing in storage: upload", [], "upload"),
    Case("other steps only: upload", [committed(5, A), torn(20)], "upload"),
    Case("a torn folder at this step is overwritten, nothing to uncommit", [torn(10)], "upload"),
    Case("this writer's commit of the same files: already committed (a retry after the commit)",
         [committed(10, A)], "committed"),
    Case("this writer's commit of other content: uncommit, then upload", [committed(10, A2)], "upload",
         uncommit_first=True),
    Case("single node: the manifest must list exactly these files", [committed(10, A, B)], "upload",
         uncommit_first=True),
    Case("multi-node: this node's files within the merged manifest are committed", [committed(10, A, B)],
         "committed", nnodes=2),
    Case("multi-node: a file of this node with other content is not", [committed(10, A2, B)], "upload",
         uncommit_first=True, nnodes=2),
    Case("this writer's manifest whose files are not all listed: incomplete, rewrite it",
         [committed(10, A, B, torn_file=True)], "upload", uncommit_first=True, nnodes=2),
    Case("an older attempt's commit at this step: uncommit, then upload", [committed(10, A, attempt=1)], "upload",
         uncommit_first=True),
    Case("an older incarnation's commit at this step, same attempt number", [committed(10, A, incarnation=100)],
         "upload", uncommit_first=True, incarnation=200),
    Case("a newer attempt's commit at this step: fenced", [committed(10, A, attempt=3)], "fenced",
         reason="checkpoint-10 is committed by attempt 3 > 2"),
    Case("a newer attempt committed another step while this one runs: fenced (a zombie)",
         [committed(12, A, attempt=3)], "fenced", reason="committed checkpoint-12 while this writer runs"),
    Case("a newer attempt's commit seen at start is history: upload", [committed(12, A, attempt=3)], "upload",
         history=frozenset({(12, 0, 3)})),
    Case("a newer attempt has claimed (started), nothing committed yet: fenced", [], "fenced",
         claims=((0, 3),), reason="attempt 3 > 2 has started"),
    Case("a newer incarnation has claimed: fenced", [committed(10, A)], "fenced", incarnation=100,
         claims=((200, 1),), reason="a newer incarnation"),
    Case("an older claim changes nothing", [committed(10, A)], "committed", claims=((0, 1),)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_plan_commit(case: Case) -> None:
    plan = plan_commit(case.remote, step=10, files=case.files, attempt=case.attempt, incarnation=case.incarnation,
                       nnodes=case.nnodes, history=case.history, claims=case.claims)
    assert (plan.action, plan.uncommit_first) == (case.action, case.uncommit_first), plan.reason
    assert case.reason in plan.reason
