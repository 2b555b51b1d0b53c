"""The checkpoint commit record (manifest.py), hashed from a folder (hashing.py), and the pure rules that read
it (decisions.py): choosing, fencing, merging node parts, retention."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from kubetrain_trainer.decisions import (
    MissingPartsError,
    RemoteCheckpoint,
    RetentionPolicy,
    check_fence,
    merge_parts,
    rewrites,
    newest_complete,
    plan_retention,
)
from kubetrain_digest import PART, xxh128_of
from kubetrain_trainer.hashing import build_manifest, file_digest, verify_local
from kubetrain_trainer.manifest import BestCheckpoint, FileEntry, Manifest, ManifestError, NodePart

DIGEST = "a" * 32


def _m(step: int, *, attempt: int = 1, metrics=None, best=None, files=None, incarnation: int = 0) -> Manifest:
    return Manifest(
        step=step,
        attempt=attempt,
        incarnation=incarnation,
        world_size=2,
        strategy="ddp",
        files=files if files is not None else (FileEntry("model.safetensors", 10, DIGEST),),
        metrics=metrics or {},
        created="2026-01-01T00:00:00Z",
        best=best,
    )


def _c(step: int, *, complete: bool = True, **kw) -> RemoteCheckpoint:
    if not complete:
        return RemoteCheckpoint(step=step, manifest=None, listing={"model.safetensors": 3})
    m = _m(step, **kw)
    listing = {f.path: f.size for f in m.files} | {"manifest.json": 100}
    return RemoteCheckpoint(step=step, manifest=m, listing=listing)


def test_build_manifest_hashes_every_file_and_reads_trainer_state(tmp_path: Path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "sub" / "shard_0.pt").write_bytes(b"x" * 1000)
    (tmp_path / "manifest.json").write_text("{}")  # commit records are never checkpoint files
    (tmp_path / "manifest.node-1.json").write_text("{}")
    state = {
        "global_step": 20,
        "log_history": [{"step": 10, "loss": 2.0}, {"step": 20, "loss": 1.5}, {"step": 20, "eval_loss": 1.25}],
        "best_metric": 1.25,
        "best_model_checkpoint": "/out/checkpoint-20",
    }
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    m = build_manifest(tmp_path, step=20, attempt=3, world_size=4, strategy="fsdp")
    assert [f.path for f in m.files] == ["model.safetensors", "sub/shard_0.pt", "trainer_state.json"]
    by_path = {f.path: f for f in m.files}
    assert by_path["sub/shard_0.pt"].size == 1000
    assert (by_path["model.safetensors"].algorithm, by_path["model.safetensors"].digest) == ("xxh128", xxh128_of(b"weights"))
    assert m.metrics == {"loss": 1.5, "eval_loss": 1.25}
    assert m.best == BestCheckpoint(metric=None, value=1.25, step=20)
    assert (m.step, m.attempt, m.world_size, m.strategy) == (20, 3, 4, "fsdp")
    assert m.created.endswith("Z")


def test_manifest_round_trips_through_json():
    m = _m(7, attempt=2, metrics={"eval_loss": 0.5}, best=BestCheckpoint("eval_loss", 0.5, 7))
    again = Manifest.from_json(m.to_json())
    assert again == m
    raw = json.loads(m.to_json())
    assert {"format", "step", "attempt", "world_size", "strategy", "files", "metrics", "created"} <= set(raw)
    assert raw["format"] == 1


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.update(format=2), "format"),
        (lambda r: r.pop("step"), "step"),
        (lambda r: r.update(attempt=0), "attempt"),
        (lambda r: r.update(world_size="2"), "world_size"),
        (lambda r: r.update(strategy=""), "strategy"),
        (lambda r: r.update(files={}), "files"),
        (lambda r: r["files"].append(dict(r["files"][0])), "twice"),
        (lambda r: r["files"][0].update(path="../escape"), "unsafe"),
        (lambda r: r["files"][0].update(path="/abs"), "unsafe"),
        (lambda r: r["files"][0].update(path="manifest.json"), "commit record"),
        (lambda r: r["files"][0].update(size=-1), "size"),
        (lambda r: r["files"][0].update(xxh128="XYZ"), "xxh128 must be 32 lowercase hex"),
        (lambda r: r["files"][0].update(xxh128="a" * 64), "xxh128 must be 32 lowercase hex"),
        (lambda r: r["files"][0].update(sha256="a" * 64), "exactly one digest, xxh128 or sha256; got xxh128, sha256"),
        (lambda r: r["files"][0].pop("xxh128"), "exactly one digest, xxh128 or sha256; got none"),
        (lambda r: r.update(metrics=[1]), "metrics"),
    ],
)
def test_invalid_manifests_are_rejected_with_the_field_named(mutate, message):
    raw = json.loads(_m(5).to_json())
    mutate(raw)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(json.dumps(raw))


def test_not_json_is_a_manifest_error():
    with pytest.raises(ManifestError, match="JSON"):
        Manifest.from_json(b"{torn")


def test_completeness_needs_every_listed_file_with_its_size():
    m = _m(5, files=(FileEntry("a", 3, DIGEST), FileEntry("b/c", 4, DIGEST)))
    assert RemoteCheckpoint(5, m, {"a": 3, "b/c": 4, "stale-extra": 9}).complete
    assert not RemoteCheckpoint(5, m, {"a": 3}).complete
    assert not RemoteCheckpoint(5, m, {"a": 3, "b/c": 5}).complete
    assert not RemoteCheckpoint(6, m, {"a": 3, "b/c": 4}).complete  # manifest of another step
    assert m.mismatches({"a": 3}) == ["b/c: missing"]


def test_newest_complete_skips_torn_and_excluded():
    cps = [_c(10), _c(20), _c(30, complete=False)]
    assert newest_complete(cps).step == 20
    assert newest_complete(cps, exclude={20}).step == 10
    assert newest_complete([_c(5, complete=False)]) is None


def test_a_newer_attempts_claim_fences_before_it_commits_anything():
    cps = [_c(10, attempt=1)]
    assert not check_fence(cps, step=20, attempt=1, claims=[(0, 1), (0, 2)]).allowed
    assert check_fence(cps, step=20, attempt=2, claims=[(0, 1), (0, 2)]).allowed
    assert not check_fence(cps, step=20, incarnation=100, attempt=9, claims=[(200, 1)]).allowed
    assert check_fence(cps, step=20, incarnation=200, attempt=1, claims=[(100, 9)]).allowed


def test_attempt_claims_round_trip_and_names_parse():
    from kubetrain_trainer.layout import parse_claim_name
    from kubetrain_trainer.manifest import AttemptClaim
    c = AttemptClaim(incarnation=1796302800, attempt=3, decided=True, restore_step=40)
    assert AttemptClaim.from_json(c.to_json()) == c and parse_claim_name(c.name) == (1796302800, 3)
    assert parse_claim_name("notes.txt") is None and parse_claim_name("1-x.json") is None
    with pytest.raises(ManifestError):
        AttemptClaim.from_json(b'{"format": 1, "incarnation": 0, "attempt": 1, "restore_step": -4}')


@pytest.mark.parametrize(
    "existing, step, me, history, allowed",
    [
        ([(10, 0, 1)], 20, (0, 1), set(), True),  # same attempt
        ([(10, 0, 1)], 20, (0, 2), set(), True),  # newer attempt goes on
        ([(10, 0, 1)], 10, (0, 2), set(), True),  # newer attempt may overwrite an older one's step
        ([(10, 0, 2)], 10, (0, 1), {(10, 0, 2)}, False),  # never overwrite a higher attempt's step
        ([(10, 0, 2)], 20, (0, 1), set(), False),  # a higher attempt appeared while we run: zombie
        ([(10, 0, 2)], 20, (0, 1), {(10, 0, 2)}, True),  # higher attempt from history (before incarnations)
        # A job deleted and re-created under the same name (incarnation = creation time):
        ([(10, 100, 5)], 20, (200, 1), set(), True),  # the old job's late commit never fences the new one
        ([(10, 100, 5)], 10, (200, 1), set(), True),  # ...and the new one may replace its step
        ([(10, 200, 1)], 20, (100, 5), set(), False),  # the old job's zombie is fenced by the new job
        ([(10, 200, 1)], 10, (100, 5), {(10, 200, 1)}, False),  # and never overwrites its step
        ([(10, 100, 2)], 20, (100, 5), set(), True),  # same incarnation: attempts order as before
    ],
)
def test_write_fencing(existing, step, me, history, allowed):
    cps = [_c(s, incarnation=i, attempt=a) for s, i, a in existing]
    fence = check_fence(cps, step=step, incarnation=me[0], attempt=me[1], history=frozenset(history))
    assert fence.allowed is allowed, fence.reason


def _plan(cps, **policy):
    in_flight = policy.pop("in_flight", ())
    return plan_retention(cps, RetentionPolicy(**policy), in_flight=in_flight)


def test_retention_keeps_newest_up_to_limit():
    plan = _plan([_c(s) for s in (10, 20, 30, 40)], save_total_limit=2)
    assert plan.delete == (10, 20)
    assert plan.keep == (30, 40)


def test_retention_never_deletes_the_best_even_beyond_the_limit():
    cps = [_c(10, metrics={"eval_loss": 0.1}), _c(20, metrics={"eval_loss": 0.5}), _c(30, metrics={"eval_loss": 0.9}),
           _c(40)]
    plan = _plan(cps, save_total_limit=1, metric_for_best_model="loss")
    assert plan.keep == (10, 40)
    assert plan.protected == {40: "newest complete", 10: "best"}
    plan = _plan(cps, save_total_limit=2, metric_for_best_model="eval_loss")
    assert plan.keep == (10, 40)
    # accuracy-like metric: greater is better by default
    cps = [_c(10, metrics={"eval_acc": 0.9}), _c(20, metrics={"eval_acc": 0.5}), _c(30)]
    assert _plan(cps, save_total_limit=1, metric_for_best_model="acc").keep == (10, 30)
    assert _plan(cps, save_total_limit=1, metric_for_best_model="acc", greater_is_better=False).keep == (20, 30)


def test_retention_falls_back_to_the_best_step_recorded_by_the_trainer():
    cps = [_c(10), _c(20), _c(30, best=BestCheckpoint("eval_loss", 0.2, 10))]
    assert _plan(cps, save_total_limit=1).keep == (10, 30)


def test_retention_never_deletes_the_newest_complete_nor_an_upload_in_flight():
    cps = [_c(10), _c(20), _c(30, complete=False)]
    plan = _plan(cps, save_total_limit=1, in_flight=(30,))
    assert plan.keep == (20, 30)
    assert plan.delete == (10,)


def test_torn_folders_are_deleted_only_below_the_newest_complete():
    cps = [_c(10, complete=False), _c(20), _c(30, complete=False)]
    plan = _plan(cps)  # no limit: complete ones are all kept
    assert plan.delete == (10,)
    assert plan.keep == (20, 30)
    assert _plan([_c(10, complete=False)]).delete == ()


def test_no_limit_keeps_every_complete_checkpoint():
    assert _plan([_c(s) for s in (1, 2, 3)]).delete == ()
    assert _plan([_c(s) for s in (1, 2, 3)], save_total_limit=0).delete == ()


def test_merge_parts_needs_every_node_of_this_attempt():
    a = FileEntry("rng_state_0.pth", 1, "0" * 32)
    b = FileEntry("rng_state_1.pth", 1, "1" * 32)
    shared = FileEntry("trainer_state.json", 5, "2" * 32)
    parts = [NodePart(0, 10, 2, (a, shared)), NodePart(1, 10, 2, (b, shared))]
    assert [f.path for f in merge_parts(parts, step=10, attempt=2, nnodes=2)] == [
        "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"]
    with pytest.raises(MissingPartsError) as missing:
        merge_parts([parts[0], NodePart(1, 10, 1, (b,))], step=10, attempt=2, nnodes=2)  # zombie's part
    assert missing.value.ranks == (1,)  # typed: node rank 0 waits for these ranks, never parses the message
    with pytest.raises(MissingPartsError) as missing:
        merge_parts([], step=10, attempt=2, nnodes=3)
    assert missing.value.ranks == (0, 1, 2)
    # A path node rank 0 wrote too is its copy (HF save_on_each_node: every node writes trainer_state.json,
    # whose is_world_process_zero differs), and node rank 0 uploads it again before the manifest.
    theirs = NodePart(1, 10, 2, (b, FileEntry("trainer_state.json", 5, "3" * 32)))
    merged = merge_parts([parts[0], theirs], step=10, attempt=2, nnodes=2)
    assert dict((f.path, f.digest) for f in merged)["trainer_state.json"] == "2" * 32
    assert rewrites([parts[0], theirs], merged, step=10, attempt=2) == ("trainer_state.json",)
    assert rewrites(parts, merge_parts(parts, step=10, attempt=2, nnodes=2), step=10, attempt=2) == ()
    # Two other nodes disagreeing on a path node rank 0 lacks: which copy storage holds is a race.
    c = FileEntry("extra.bin", 1, "4" * 32)
    three = [NodePart(0, 10, 2, (a,)), NodePart(1, 10, 2, (c,)), NodePart(2, 10, 2, (FileEntry("extra.bin", 1, "5" * 32),))]
    with pytest.raises(ManifestError, match="different content") as conflict:
        merge_parts(three, step=10, attempt=2, nnodes=3)
    assert not isinstance(conflict.value, MissingPartsError)  # waiting cannot fix it: the step stays torn
    assert NodePart.from_json(parts[1].to_json()) == parts[1]


def test_merge_parts_ignores_a_part_of_the_same_attempt_from_another_incarnation():
    a = FileEntry("rng_state_0.pth", 1, "0" * 32)
    b = FileEntry("rng_state_1.pth", 1, "1" * 32)
    ours = [NodePart(0, 10, 1, (a,), incarnation=200), NodePart(1, 10, 1, (b,), incarnation=200)]
    assert len(merge_parts(ours, step=10, attempt=1, nnodes=2, incarnation=200)) == 2
    old_job = NodePart(1, 10, 1, (b,), incarnation=100)
    with pytest.raises(MissingPartsError, match="missing"):
        merge_parts([ours[0], old_job], step=10, attempt=1, nnodes=2, incarnation=200)
    assert NodePart.from_json(ours[1].to_json()) == ours[1]


def test_manifest_records_its_incarnation_and_reads_old_manifests_without_one():
    m = _m(10, attempt=3, incarnation=1796302800)
    assert Manifest.from_json(m.to_json()) == m and m.writer == (1796302800, 3)
    legacy = _m(10, attempt=3)
    assert "incarnation" not in legacy.for_storage() and Manifest.from_json(legacy.to_json()).writer == (0, 3)


def test_verify_local_detects_size_and_content_changes(tmp_path: Path):
    (tmp_path / "a").write_bytes(b"abc")
    good = FileEntry("a", 3, xxh128_of(b"abc"))
    assert verify_local(tmp_path, [good]) == []
    assert verify_local(tmp_path, [FileEntry("a", 3, DIGEST)]) == ["a: xxh128 mismatch"]
    assert verify_local(tmp_path, [FileEntry("a", 4, DIGEST)]) == ["a: size 3 != 4"]
    assert verify_local(tmp_path, [FileEntry("b", 1, DIGEST)]) == ["b: missing"]
    legacy = FileEntry("a", 3, hashlib.sha256(b"abc").hexdigest(), "sha256")
    assert verify_local(tmp_path, [legacy]) == []
    assert verify_local(tmp_path, [FileEntry("a", 3, "b" * 64, "sha256")]) == ["a: sha256 mismatch"]


def test_a_manifest_written_before_xxh128_is_read_and_written_back_with_its_sha256():
    raw = json.loads(_m(5).to_json())
    raw["files"] = [{"path": "model.safetensors", "size": 7, "sha256": hashlib.sha256(b"weights").hexdigest()}]
    legacy = Manifest.from_json(json.dumps(raw))
    entry = legacy.files[0]
    assert (entry.algorithm, entry.digest) == ("sha256", hashlib.sha256(b"weights").hexdigest())
    assert json.loads(legacy.to_json())["files"] == raw["files"]  # kept as it was, for a re-commit to compare
    assert json.loads(_m(5).to_json())["files"] == [{"path": "model.safetensors", "size": 10, "xxh128": DIGEST}]


@pytest.mark.parametrize("size", [0, 1, PART - 1, PART, PART + 1, 2 * PART, 3 * PART + 12345])
def test_the_xxh128_of_a_file_is_the_documented_tree_of_8_mib_parts(tmp_path: Path, size):
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert file_digest(tmp_path / "f") == xxh128_of(data)
    assert file_digest(tmp_path / "f", "sha256") == hashlib.sha256(data).hexdigest()


def test_a_checkpoint_without_the_eval_metric_is_never_the_best():
    # An emergency save at a logging step has the training `loss` but no `eval_loss`:
    # HF ranks only by the eval_-prefixed metric, so it must not win on its training loss.
    cps = [_c(100, metrics={"loss": 0.40, "eval_loss": 0.30}), _c(200, metrics={"loss": 0.35, "eval_loss": 0.45}),
           _c(250, metrics={"loss": 0.20}), _c(300, metrics={"loss": 0.25, "eval_loss": 0.50})]
    plan = _plan(cps, save_total_limit=1, metric_for_best_model="loss")
    assert plan.protected == {300: "newest complete", 100: "best"}
    assert plan.delete == (200, 250)


def test_the_manifest_s_best_step_is_a_saved_checkpoint_s(tmp_path):
    """best_global_step may be an evaluation at a step that saved nothing (eval every 30, save every 100):
    the manifest's best step is the best *checkpoint*'s, which retention protects, or none."""
    (tmp_path / "model.safetensors").write_bytes(b"w")
    for best_dir, expected in (("/out/checkpoint-100", 100), (None, None)):
        state = {"global_step": 200, "best_metric": 0.5, "best_global_step": 90, "best_model_checkpoint": best_dir}
        (tmp_path / "trainer_state.json").write_text(json.dumps(state))
        m = build_manifest(tmp_path, step=200, attempt=1, world_size=1, strategy="ddp")
        assert m.best.step == expected
