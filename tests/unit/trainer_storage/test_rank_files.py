"""Which files a node leaves in storage on restore (`rank_files.py`): pure rules, tables of cases.

The records here are the shape `strategies/dcp_files.RankFilesWriter` writes; that real FSDP
checkpoints restore from what these rules keep is tests/slow/strategies/test_sharded_strategies.py,
and against MinIO tests/integration/trainer_storage/test_ckpt_restore_agreement_minio.py.
"""

from __future__ import annotations

import json

import pytest

from kubetrain_trainer.decisions import RemoteCheckpoint
from kubetrain_trainer.layout import RANK_FILES_NAME, corrupt_marker_name
from kubetrain_trainer.manifest import FileEntry, Manifest, ManifestError
from kubetrain_trainer.rank_files import NodeRanks, RankFiles, not_needed

MODEL, OPTIM = "pytorch_model_fsdp_0", "optimizer_0"


def _entries(*paths: str) -> list[FileEntry]:
    return [FileEntry(path=p, size=10, digest="0" * 32) for p in paths]


def _fsdp_checkpoint(world: int) -> tuple[list[FileEntry], dict[str, RankFiles]]:
    files, records = ["trainer_state.json", "scheduler.pt"], {}
    for folder in (MODEL, OPTIM):
        files += [f"{folder}/.metadata", f"{folder}/{RANK_FILES_NAME}"]
        files += [f"{folder}/__{r}_0.distcp" for r in range(world)] + [f"{folder}/__{r}_shared.distcp" for r in range(world)]
        records[f"{folder}/{RANK_FILES_NAME}"] = RankFiles(
            world_size=world, private={r: (f"__{r}_0.distcp",) for r in range(world)})
    files += [f"rng_state_{r}.pth" for r in range(world)]
    return _entries(*files), records


@pytest.mark.parametrize("node_rank, nnodes, world, ranks", [
    (0, 1, 1, [0]), (0, 2, 2, [0]), (1, 2, 2, [1]), (1, 2, 4, [2, 3]), (3, 4, 8, [6, 7]),
])
def test_a_node_runs_the_ranks_the_launcher_numbers(node_rank, nnodes, world, ranks):
    assert list(NodeRanks.of(node_rank=node_rank, nnodes=nnodes, world_size=world).ranks) == ranks


def test_a_node_leaves_only_the_other_ranks_private_shards():
    files, records = _fsdp_checkpoint(world=4)
    skip = not_needed(files, records, ranks=range(2, 4), world_size=4)
    assert skip == {f"{folder}/__{r}_0.distcp" for folder in (MODEL, OPTIM) for r in (0, 1)}
    # Everything the ranks share stays wanted: metadata, the shared items of every rank, the records.
    wanted = {f.path for f in files} - skip
    assert f"{MODEL}/.metadata" in wanted and f"{OPTIM}/__0_shared.distcp" in wanted
    assert f"{MODEL}/{RANK_FILES_NAME}" in wanted and "rng_state_0.pth" in wanted


@pytest.mark.parametrize("case", ["other world size", "no record", "file private to two ranks"])
def test_every_file_is_needed_when_the_records_cannot_vouch(case):
    files, records = _fsdp_checkpoint(world=2)
    if case == "other world size":  # a reshaped load reads pieces of every rank's shards
        assert not_needed(files, records, ranks=range(0, 2), world_size=4) == set()
        return
    if case == "no record":
        records = {}
    else:
        records[f"{MODEL}/{RANK_FILES_NAME}"] = RankFiles(world_size=2, private={0: ("__0_0.distcp",),
                                                                                 1: ("__0_0.distcp",)})
    assert not_needed(files, records, ranks=range(1, 2), world_size=2) == set()


def test_a_file_named_but_not_in_the_manifest_is_not_reported():
    files, records = _fsdp_checkpoint(world=2)
    files = [f for f in files if f.path != f"{OPTIM}/__0_0.distcp"]
    assert not_needed(files, records, ranks=range(1, 2), world_size=2) == {f"{MODEL}/__0_0.distcp"}


def test_the_record_round_trips():
    record = RankFiles(world_size=2, private={0: ("__0_0.distcp",), 1: ("__1_0.distcp", "__1_1.distcp")})
    assert RankFiles.from_json(record.to_json()) == record


@pytest.mark.parametrize("raw, names", [
    (b"{not json", "not JSON"),
    ({"format": 2, "world_size": 2, "private": {}}, "format must be 1"),
    ({"format": 1, "world_size": 0, "private": {}}, "world_size must be a positive integer"),
    ({"format": 1, "world_size": 2, "private": []}, "private must be an object"),
    ({"format": 1, "world_size": 2, "private": {"2": ["__2_0.distcp"]}}, "rank '2' is not below world_size 2"),
    ({"format": 1, "world_size": 2, "private": {"0": ["../x"]}}, "private[0] must be a list of relative file names"),
])
def test_a_malformed_record_is_refused_naming_the_field(raw, names):
    data = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    with pytest.raises(ManifestError, match=names.replace("[", r"\[").replace("]", r"\]")):
        RankFiles.from_json(data)


def test_an_unreadable_record_makes_the_node_restore_everything(caplog):
    files, _ = _fsdp_checkpoint(world=2)
    node = NodeRanks.of(node_rank=1, nnodes=2, world_size=2)
    assert node.not_needed(files, {f"{MODEL}/{RANK_FILES_NAME}": b"{"}) == set()
    assert "restoring every file" in caplog.text


@pytest.mark.parametrize("marked_writer, complete", [
    (None, True),
    ((3, 2), False),  # a node found a file of this very commit corrupt
    ((3, 1), True),  # the mark condemned an earlier commit of the same step, since re-committed
    ((2, 2), True),
])
def test_a_corrupt_mark_condemns_only_the_commit_it_names(marked_writer, complete):
    files = _entries("a.bin")
    manifest = Manifest(step=5, attempt=2, incarnation=3, world_size=2, strategy="fsdp", files=tuple(files))
    listing = {"a.bin": 10, "manifest.json": 300, "corrupt.node-1.json": 80}  # an unknown name is no mark
    if marked_writer is not None:
        listing[corrupt_marker_name(1, marked_writer)] = 80
    assert RemoteCheckpoint(step=5, manifest=manifest, listing=listing).complete is complete
