#!/usr/bin/env bash
# Runs test tiers against another Kubernetes version than the testbed's: by default the chart's minimum
# (Chart.yaml kubeVersion, at the patch release named in testbed/versions.env CRD_CHECK_K8S_VERSIONS) and
# the API tier (tests/integration/api).
#
#   scripts/compat.sh                              the API tier on the chart's minimum
#   scripts/compat.sh v1.33.13                     ... on another version
#   scripts/compat.sh v1.30.14 tests/integration/operator   other tests (pytest arguments)
#   scripts/compat.sh --print-version              the version it would use, nothing else
#
# A scratch clone of the committed HEAD pins that version in its testbed/versions.env, so testbed/build.sh
# builds the control plane into a cache folder of its own (keyed by the versions: about 6 min with a warm Go
# cache, 20-30 cold; then seconds) and the repository's own testbed is never touched. Stop any running
# testbed first (scripts/testbed.sh down): two on a 2-core machine make both slow. Needs scripts/setup.sh's
# virtual environment.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
print_only=0
if [[ "${1:-}" == "--print-version" ]]; then print_only=1; shift; fi
version=${1:-}
[[ $# -gt 0 ]] && shift
if [[ -z "$version" ]]; then
  minimum=$(sed -n 's/^kubeVersion: ">=\([0-9]*\.[0-9]*\)\.0-0"$/\1/p' "$root/charts/kubetrain/Chart.yaml")
  [[ -n "$minimum" ]] || { echo "compat: no kubeVersion >=1.N.0-0 in charts/kubetrain/Chart.yaml" >&2; exit 2; }
  version=$(sed -n 's/^CRD_CHECK_K8S_VERSIONS="\(.*\)"$/\1/p' "$root/testbed/versions.env" | tr ' ' '\n' |
    grep -E "^v${minimum//./\\.}\.[0-9]+$" || true)
  [[ -n "$version" ]] || { echo "compat: CRD_CHECK_K8S_VERSIONS names no v$minimum.x" >&2; exit 2; }
fi
[[ "$version" =~ ^v1\.[0-9]+\.[0-9]+$ ]] || { echo "compat: $version is not a version like v1.30.14" >&2; exit 2; }
if (( print_only )); then echo "$version"; exit 0; fi
(( $# )) || set -- tests/integration/api
[[ -x "$root/.venv/bin/python" ]] || { echo "compat: no .venv (run scripts/setup.sh)" >&2; exit 2; }

# The scratch clone's own testbed folder (.testbed), never one named by the environment: `up` would reuse the
# testbed running there, on its own Kubernetes, and the cleanup's `down` would stop it.
unset KUBETRAIN_TESTBED_DIR
work=$(mktemp -d /tmp/kubetrain-compat.XXXXXX)
repo="$work/repo"
log="$work.build.log"  # beside the scratch folder: it stays when the build fails
cleanup() {
  if [[ -d "$repo" ]]; then
    (cd "$repo" && PYTHONPATH="$repo/testbed" "$root/.venv/bin/python" -m kubetrain_testbed down >/dev/null 2>&1) || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
git clone -q "$root" "$repo"
ln -s "$root/.venv" "$repo/.venv"
sed -i "s/^K8S_VERSION=.*/K8S_VERSION=$version/" "$repo/testbed/versions.env"
echo "compat: Kubernetes $version, commit $(git -C "$repo" rev-parse --short HEAD); building (log: $log)" >&2
TESTBED_WARM_KUEUE=0 bash "$repo/testbed/build.sh" >"$log" 2>&1 ||
  { tail -n 30 "$log" >&2; echo "compat: the build failed; its log: $log" >&2; exit 1; }
rm -f "$log"
cd "$repo"
export PYTHONPATH="$repo/operator:$repo/trainer_image:$repo/testbed:$repo/tests" OMP_NUM_THREADS=1
scripts/testbed.sh up >&2
"$root/.venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
