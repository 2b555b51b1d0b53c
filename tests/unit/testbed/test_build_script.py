"""testbed/build.sh with a stand-in `go` in a scratch cache: what a failed step leaves in the cache must not be
trusted by the next run. A failed `go mod download` once left an empty `replace ( )` in the k8s wrapper's go.mod
and every later build failed (k8s.io/api@v0.0.0: invalid version) until src/k8s was deleted by hand; a failed
copy of Kueue's CRDs went into place as empty folders and the build said "copied"; a helm checked for its
-ldflags in `go version -m` (which records none under -trimpath) was deleted and rebuilt on every run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
UPSTREAM = """module k8s.io/kubernetes
replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/apimachinery => ./staging/src/k8s.io/apimachinery
)
"""
# `mod download` fails while $FAKE/offline exists (its error as JSON on stdout, as the real one's); `get k8s.io/kubernetes` fails without the staging replaces,
# as the real one does; `build -o OUT` writes a program that answers `template` as a helm built with those
# -ldflags does (v1.20.0 without them), and logs the build to $FAKE/builds; `version -m` prints build info as
# the real one does under -trimpath: no -ldflags.
FAKE_GO = """#!/usr/bin/env bash
case "$1 $2" in
  "mod init") echo "module $3" > go.mod ;;
  "mod download")
    if [[ -e $FAKE/offline ]]; then
      printf '{\\n\\t"Path": "%s",\\n\\t"Error": "%s: dial tcp: i/o timeout"\\n}\\n' "${4%@*}" "$4"; exit 1
    fi
    case $4 in
      k8s.io/kubernetes@*) printf '{\\n\\t"GoMod": "%s",\\n}\\n' "$FAKE/upstream.mod" ;;
      sigs.k8s.io/kueue@*) printf '{\\n\\t"Dir": "%s",\\n}\\n' "$FAKE/kueue" ;;
      helm.sh/helm/v3@*) printf '{\\n\\t"GoMod": "%s",\\n}\\n' "$FAKE/helm.mod" ;;
    esac ;;
  "get k8s.io/kubernetes@"*) grep -q 'k8s.io/api =>' go.mod || { echo "k8s.io/api@v0.0.0: invalid version" >&2; exit 1; } ;;
  "get "*) ;;
  "build -tags")
    minor=$(grep -o 'chartutil.k8sVersionMinor=[0-9]*' <<<"$*" | cut -d= -f2)
    while [[ $1 != -o ]]; do shift; done
    printf '#!/bin/sh\\necho "kube: v1.%s.0"\\n' "${minor:-20}" >"$2"; chmod +x "$2"; echo "$2" >>"$FAKE/builds" ;;
  "version -m") printf '%s: go1.26\\n\\tpath\\thelm.sh/helm/v3/cmd/helm\\n\\tbuild\\t-trimpath=true\\n' "$3" ;;
  *) exit 1 ;;
esac
"""


def _fake(tmp_path: Path) -> Path:
    fake = tmp_path / "fake"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin" / "go").write_text(FAKE_GO)
    (fake / "bin" / "go").chmod(0o755)
    (fake / "upstream.mod").write_text(UPSTREAM)
    (fake / "helm.mod").write_text("module helm.sh/helm/v3\nrequire (\n\tk8s.io/client-go v0.34.2\n)\n")
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
    assert "i/o timeout" in failed.stderr  # the reason, which `go mod download -json` prints on stdout
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


def test_a_helm_with_the_charts_kubernetes_default_is_built_once(tmp_path: Path) -> None:
    """`helm template` without a cluster must assume the Kubernetes of helm's k8s.io modules (v1.34 for v3.19,
    the chart's kubeVersion refuses v1.20): set by -ldflags, checked by asking the binary, built once."""
    fake = _fake(tmp_path)
    for _ in range(3):
        built = _build(tmp_path, "helm")
        assert built.returncode == 0, built.stderr
    helm = _folder(tmp_path) / "bin" / "helm"
    assert subprocess.run([str(helm), "template"], capture_output=True, text=True).stdout == "kube: v1.34.0\n"
    assert (fake / "builds").read_text().splitlines() == [f"{helm}.tmp"]


def test_a_helm_that_assumes_another_kubernetes_is_rebuilt(tmp_path: Path) -> None:
    fake = _fake(tmp_path)
    helm = _folder(tmp_path) / "bin" / "helm"
    helm.parent.mkdir(parents=True)
    helm.write_text('#!/bin/sh\necho "kube: v1.20.0"\n')  # built before the -ldflags
    helm.chmod(0o755)
    built = _build(tmp_path, "helm")
    assert built.returncode == 0, built.stderr
    assert "assumes Kubernetes v1.20.0, not v1.34.0" in built.stderr
    assert subprocess.run([str(helm)], capture_output=True, text=True).stdout == "kube: v1.34.0\n"
    assert len((fake / "builds").read_text().splitlines()) == 1


def test_a_helm_whose_ldflags_set_nothing_fails_the_build(tmp_path: Path) -> None:
    """-X with a variable helm no longer has is ignored by the linker: the build says so instead."""
    fake = _fake(tmp_path)
    fake_go = fake / "bin" / "go"
    fake_go.write_text(fake_go.read_text().replace("chartutil.k8sVersionMinor=", "chartutil.moved="))
    built = _build(tmp_path, "helm")
    assert built.returncode != 0
    assert "the helm built assumes Kubernetes v1.20.0 without a cluster, not v1.34.0" in built.stderr
    assert not (_folder(tmp_path) / "bin" / "helm").exists()


@pytest.mark.parametrize(("components", "args", "module"), [("helm", (), "helm.sh/helm/v3"),
                                                             ("kueue", ("--kueue",), "sigs.k8s.io/kueue")])
def test_a_failed_download_says_so_and_why(tmp_path: Path, components: str, args: tuple[str, ...],
                                           module: str) -> None:
    """`go mod download -json` prints its error on stdout: piped into sed, it once ended the build in silence."""
    fake = _fake(tmp_path)
    (fake / "offline").touch()
    if components == "kueue":  # its download comes after the binary's build
        bin_dir = _folder(tmp_path, "--kueue") / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "kueue").write_text("#!/bin/sh\n")
        (bin_dir / "kueue").chmod(0o755)
    failed = _build(tmp_path, components, *args)
    assert failed.returncode != 0
    assert f"FAILED: go mod download {module}@" in failed.stderr and "dial tcp: i/o timeout" in failed.stderr
