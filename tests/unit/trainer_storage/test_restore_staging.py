"""What a retried restore keeps of the staging folder an earlier try filled (`landing.keep_verified`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kubetrain_trainer.hashing import HashCancelled, file_digest
from kubetrain_trainer.landing import keep_verified
from kubetrain_trainer.manifest import FileEntry


def _entry(path: Path, rel: str) -> FileEntry:
    return FileEntry(rel, path.stat().st_size, file_digest(path))


def test_whole_files_stay_partial_and_foreign_ones_go(tmp_path: Path):
    src = tmp_path / "src"
    (src / "shards").mkdir(parents=True)
    for rel, data in (("a.bin", os.urandom(3000)), ("shards/b.bin", os.urandom(5000)), ("c.bin", os.urandom(4000))):
        (src / rel).write_bytes(data)
    files = [_entry(src / rel, rel) for rel in ("a.bin", "shards/b.bin", "c.bin")]
    staging = tmp_path / ".checkpoint-9.restoring"
    (staging / "shards").mkdir(parents=True)
    (staging / "old" / "deep").mkdir(parents=True)
    (staging / "a.bin").write_bytes((src / "a.bin").read_bytes())  # landed whole
    with open(staging / "shards" / "b.bin", "wb") as fh:  # full size, but a ranged GET never landed: a hole
        fh.seek(4999)
        fh.write((src / "shards" / "b.bin").read_bytes()[-1:])
    (staging / "c.bin").write_bytes((src / "c.bin").read_bytes()[:100])  # cut short
    (staging / "old" / "deep" / "x.bin").write_bytes(b"another manifest's file")
    (staging / "manifest.json").write_bytes(b"{}")
    assert keep_verified(staging, files) == {"a.bin"}
    assert sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*")) == ["a.bin"]  # empty folders go too


def test_a_staging_symlink_is_removed_not_followed(tmp_path: Path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_bytes(b"keep me")
    staging = tmp_path / ".checkpoint-9.restoring"
    staging.symlink_to(elsewhere)
    assert keep_verified(staging, []) == set()
    assert staging.is_dir() and not staging.is_symlink()
    assert (elsewhere / "precious").read_bytes() == b"keep me"


def test_checking_stops_on_sigterm(tmp_path: Path):
    staging = tmp_path / "s"
    staging.mkdir()
    (staging / "big.bin").write_bytes(os.urandom(1 << 20))
    with pytest.raises(HashCancelled):
        keep_verified(staging, [_entry(staging / "big.bin", "big.bin")], cancelled=lambda: True)
