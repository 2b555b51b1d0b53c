"""testbed/build.sh with a stand-in `go` in a scratch cache: what a failed step leaves in the cache must not be
trusted by the next run. A failed `go mod download` once left an empty `replace ( )` in the k8s wrapper's go.mod
and every later build failed (k8s.io/api@v0.0.0: invalid version) until src/k8s was deleted by hand; a failed
copy of Kueue's CRDs went into place as empty folders and the build said "copied"."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
UPSTREAM = """module k8s.io/kubernetes
replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/apimachinery => ./staging/src/k8s.io/apimachinery
)
"""
# `mod download` fails while $FAKE/offline exists; `get k8s.io/kubernetes` fails without the staging replaces,
# as the real one does; `build -o OUT` writes an empty program.
FAKE_GO = """#!/usr/bin/env bash
case "$1 $2" in
  "mod init") echo "module $3" > go.mod ;;
  "mod download")
    if [[ -e $FAKE/offline ]]; then echo "dial tcp: i/o timeout" >&2; exit 1; fi
    case $4 in
      k8s.io/kubernetes@*) printf '{\\n\\t"GoMod": "%s",\\n}\\n' "$FAKE/upstream.mod" ;;
      sigs.k8s.io/kueue@*) printf '{\\n\\t"Dir": "%s",\\n}\\n' "$FAKE/kueue" ;;
    esac ;;
  "get k8s.io/kubernetes@"*) grep -q 'k8s.io/api =>' go.mod || { echo "k8s.io/api@v0.0.0: invalid version" >&2; exit 1; } ;;
  "get "*) ;;
  "build -tags") while [[ $1 != -o ]]; do shift; done; printf '#!/bin/sh\\n' >"$2"; chmod +x "$2" ;;
  *) exit 1 ;;
esac
"""


def _fake(tmp_path: Path) -> Path:
    fake = tmp_path / "fake"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin" / "go").write_text(FAKE_GO)
    (fake / "bin" / "go").chmod(0o755)
    (fake / "upstream.mod").write_text(UPSTREAM)
    return fake


def _build(tmp_path: Path, components: str, *args: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "fake"
    env = {"PATH": f"{fake / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "FAKE": str(fake),
           "KUBETRAIN_CACHE": str(tmp_path / "cache"), "TESTBED_COMPONENTS": components}
    return subprocess.run(["bash", str(ROOT / "testbed" / "build.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=60)


def _folder(tmp_path: Path, *args: str) -> Path:
    return Path(_build(tmp_path, "", *args, "--print").stdout.strip()).parent


def test_a_failed_download_fails_the_build_and_leaves_nothing_the_next_run_trusts(tmp_path: Path) -> None:
    fake = _fake(tmp_path)
    (fake / "offline").touch()
    failed = _build(tmp_path, "kube-apiserver")
    assert failed.returncode != 0 and "go mod download k8s.io/kubernetes" in failed.stderr
    go_mod = _folder(tmp_path) / "src" / "k8s" / "go.mod"
    assert "replace" not in go_mod.read_text()
    (fake / "offline").unlink()
    built = _build(tmp_path, "kube-apiserver")
    assert built.returncode == 0, built.stderr
    assert (_folder(tmp_path) / "bin" / "kube-apiserver").exists()
    assert "\tk8s.io/api => k8s.io/api v0." in go_mod.read_text()


def test_an_empty_replace_block_left_by_an_older_run_is_rebuilt(tmp_path: Path) -> None:
    _fake(tmp_path)
    go_mod = _folder(tmp_path) / "src" / "k8s" / "go.mod"
    go_mod.parent.mkdir(parents=True)
    go_mod.write_text("module kubetrain.local/testbed/k8s\nreplace (\n)\n")
    built = _build(tmp_path, "kube-apiserver")
    assert built.returncode == 0, built.stderr
    text = go_mod.read_text()
    assert text.count("replace (") == 1 and "\tk8s.io/apimachinery => k8s.io/apimachinery v0." in text


def test_kueues_crds_go_into_place_only_when_every_copy_worked(tmp_path: Path) -> None:
    fake = _fake(tmp_path)
    (fake / "kueue").mkdir()  # a module folder without config/components
    failed = _build(tmp_path, "kueue", "--kueue")
    assert failed.returncode != 0 and "copied" not in failed.stderr
    folder = _folder(tmp_path, "--kueue")
    assert not (folder / "crds").exists() and not (folder / "rbac").exists()
    for name in ("crd/bases/kueue.x-k8s.io_workloads.yaml", "rbac/role.yaml", "rbac/manager_secrets_role.yaml"):
        (fake / "kueue" / "config" / "components" / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / "kueue" / "config" / "components" / name).write_text("kind: x\n")
    built = _build(tmp_path, "kueue", "--kueue")
    assert built.returncode == 0, built.stderr
    assert sorted(p.name for p in (folder / "rbac").iterdir()) == ["manager_secrets_role.yaml", "role.yaml"]
    assert [p.name for p in (folder / "crds").iterdir()] == ["kueue.x-k8s.io_workloads.yaml"]
