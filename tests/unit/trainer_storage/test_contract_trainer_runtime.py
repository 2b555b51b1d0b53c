"""The trainer side of docs/contract.md: what the document says is what the runtime does.

Parsed from the document itself, so a change there that the trainer does not
follow fails here (the operator side has its own contract tests).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kubetrain_trainer import launch
from kubetrain_trainer.manifest import MANIFEST_NAME, FileEntry, Manifest, checkpoint_dirname
from kubetrain_trainer.sync import CommittedCheckpoint

ROOT = Path(__file__).resolve().parents[3]
CONTRACT = (ROOT / "docs" / "contract.md").read_text()
RUNTIME = ROOT / "trainer_image" / "kubetrain_trainer"


def _section(title: str) -> str:
    start = CONTRACT.index(f"## {title}")
    end = CONTRACT.find("\n## ", start + 1)
    return CONTRACT[start:end if end > 0 else None]


def test_every_contract_variable_is_read_by_the_runtime():
    names = set()
    for row in _section("Environment of every training container").splitlines():
        if row.startswith("| `"):
            names.update(re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1]))
    assert {"NNODES", "NODE_RANK", "NPROC_PER_NODE", "KUBETRAIN_ATTEMPT", "KUBETRAIN_CHECKPOINT_URI"} <= names
    source = "\n".join(p.read_text() for p in RUNTIME.rglob("*.py"))
    # Credentials and the web identity: boto3's own default chain reads them.
    boto_reads_itself = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
                         "AWS_ROLE_SESSION_NAME"}
    unread = sorted(n for n in names - boto_reads_itself if f'"{n}"' not in source)
    assert unread == [], f"contract variables the trainer never reads: {unread}"


def test_exit_codes_match_the_contract():
    table = _section("Exit codes")
    codes = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| `(\d+)` \| (\w[\w ]*?) \|", table, re.M)}
    assert codes[0] == "success" and launch.EXIT_OK == 0
    assert codes[83] == "preempted" and launch.EXIT_PREEMPTED == 83
    assert codes[82] == "invalid configuration" and launch.EXIT_INVALID_CONFIG == 82


def test_command_and_local_folder_match_the_contract():
    command = _section("Command")
    assert "python -m kubetrain_trainer.launch" in command and callable(launch.main)
    default_dir = re.search(r"default `([^`]+)`", command).group(1)
    cfg = launch.LaunchConfig.from_env({}, ["--", "true"])
    assert str(cfg.local_dir) == default_dir
    assert "KUBETRAIN_RESUME_FROM" in command
    env = launch.worker_env(cfg, 0, {}, cfg.local_dir / "checkpoint-3")
    assert env["KUBETRAIN_RESUME_FROM"] == str(cfg.local_dir / "checkpoint-3")


def test_manifest_and_layout_match_the_contract():
    layout = _section("Checkpoint layout in storage")
    assert f"/{checkpoint_dirname(0).replace('0', '<step>')}/{MANIFEST_NAME}" in layout
    keys_doc = re.search(r"`manifest.json`: `(\{.*?\})`", layout, re.S).group(1)
    documented = set(re.findall(r'"(\w+)"', keys_doc)) - {"path", "size", "sha256"}
    m = Manifest(step=1, attempt=1, world_size=1, strategy="ddp", files=(FileEntry("a", 1, "0" * 64),))
    written = json.loads(m.to_json())
    assert documented == set(written) and written["format"] == 1
    assert set(written["files"][0]) == {"path", "size", "sha256"}


def test_last_checkpoint_report_matches_the_contract():
    report = _section("Reporting the last checkpoint")
    example = json.loads(re.search(r"`(\{\"kind\".*?\})`", report).group(1).replace("…", ""))
    text = CommittedCheckpoint(step=1200, uri="s3://b/p/checkpoint-1200", time="2026-01-01T00:00:00Z").to_json()
    ours = json.loads(text)
    assert set(ours) == set(example) and ours["kind"] == example["kind"]
    # The operator's parser reads exactly what the trainer writes.
    from kubetrain.plan import parse_checkpoint_record
    parsed = parse_checkpoint_record(text)
    assert parsed is not None and (parsed.step, parsed.uri) == (1200, "s3://b/p/checkpoint-1200")
    assert "kubetrain.io/last-checkpoint" in report and "kubetrain.io/last-checkpoint" in (RUNTIME / "launch.py").read_text()
