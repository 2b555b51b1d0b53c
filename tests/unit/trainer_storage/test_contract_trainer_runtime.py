"""The trainer side of docs/contract.md: what the document says is what the runtime does.

Parsed from the document itself, so a change there that the trainer does not
follow fails here. What both sides must agree on (the pod's environment, exit
codes, annotations) is checked from both at once in tests/unit/test_contract.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kubetrain_trainer import launch, launch_config
from kubetrain_trainer.layout import MANIFEST_NAME, checkpoint_dirname
from kubetrain_trainer.manifest import FileEntry, Manifest
from kubetrain_trainer.commit import CommittedCheckpoint

ROOT = Path(__file__).resolve().parents[3]
CONTRACT = (ROOT / "docs" / "contract.md").read_text()


def _section(title: str) -> str:
    start = CONTRACT.index(f"## {title}")
    end = CONTRACT.find("\n## ", start + 1)
    return CONTRACT[start:end if end > 0 else None]


def test_command_and_local_folder_match_the_contract():
    command = _section("Command")
    assert "python -m kubetrain_trainer.launch" in command and callable(launch.main)
    default_dir = re.search(r"default `([^`]+)`", command).group(1)
    cfg = launch_config.LaunchConfig.from_env({}, ["--", "true"])
    assert str(cfg.local_dir) == default_dir
    assert "KUBETRAIN_RESUME_FROM" in command
    env = launch.worker_env(cfg, 0, {}, cfg.local_dir / "checkpoint-3")
    assert env["KUBETRAIN_RESUME_FROM"] == str(cfg.local_dir / "checkpoint-3")


def test_the_documented_xxh128_snippet_gives_the_trainers_digest(tmp_path):
    # Whoever verifies a checkpoint outside kubetrain copies this line: it must agree with the trainer.
    import os

    import xxhash

    from kubetrain_trainer.hashing import file_digest

    snippet = re.search(r"`(xxh3_128_hexdigest\(.*?\))`", _section("Checkpoint layout in storage")).group(1)
    for size in (0, 5, 8 << 20, (8 << 20) + 1, 3 * (8 << 20) + 77):
        data = os.urandom(size)
        (tmp_path / "f").write_bytes(data)
        namespace = {"xxh3_128_hexdigest": xxhash.xxh3_128_hexdigest, "xxh3_128_digest": xxhash.xxh3_128_digest,
                     "data": data}
        assert eval(snippet, namespace) == file_digest(tmp_path / "f"), size  # our own doc, evaluated as written


def test_manifest_and_layout_match_the_contract():
    layout = _section("Checkpoint layout in storage")
    assert f"/{checkpoint_dirname(0).replace('0', '<step>')}/{MANIFEST_NAME}" in layout
    keys_doc = re.search(r"`manifest.json`: `(\{.*?\})`", layout, re.S).group(1)
    documented = set(re.findall(r'"(\w+)"', keys_doc)) - {"path", "size", "xxh128"}
    m = Manifest(step=1, attempt=1, world_size=1, strategy="ddp", files=(FileEntry("a", 1, "0" * 32),))
    written = json.loads(m.to_json())
    assert documented == set(written) and written["format"] == 1
    assert set(written["files"][0]) == {"path", "size", "xxh128"}


def test_last_checkpoint_report_matches_the_contract():
    report = _section("Reporting the last checkpoint")
    example = json.loads(re.search(r"`(\{\"kind\".*?\})`", report).group(1).replace("…", ""))
    text = CommittedCheckpoint(step=1200, uri="s3://b/p/checkpoint-1200", time="2026-01-01T00:00:00Z").to_json()
    ours = json.loads(text)
    assert set(ours) == set(example) and ours["kind"] == example["kind"]
