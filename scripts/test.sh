#!/usr/bin/env bash
# The project's test command (the README names it; .ci/run calls it).
#
#   scripts/test.sh          every tier: unit, integration (real control plane
#                            + MinIO, started on demand), slow (2-process
#                            training), e2e (helm + operator + real training,
#                            on the process agent and on the real node)
#   scripts/test.sh fast     the unit tier only: no testbed, no network, seconds
#   scripts/test.sh -- ARGS  every tier with extra pytest arguments (e.g. -m integration)
#   scripts/test.sh fast -- ARGS   the unit tier with them (e.g. -k preemption)
#
# The testbed started by the run is stopped at the end unless it was already
# up before (then it is left as found).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# A leading `--` names no tier: `scripts/test.sh -- -m integration` is every tier
# with those pytest arguments (the README's tier table runs it so).
tier=all
if [[ $# -gt 0 && "$1" != "--" ]]; then tier=$1; shift; fi
if [[ "${1:-}" == "--" ]]; then shift; fi
# Refused before the setup and the linter, which take a while.
if [[ $tier != fast && $tier != all ]]; then
  echo "usage: scripts/test.sh [fast|all] [-- pytest args]" >&2; exit 2
fi
scripts/setup.sh
# shellcheck disable=SC1091
source .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The cached environment is shared by every clone on the machine; this
# clone's sources win over whichever clone installed itself last.
export PYTHONPATH="$root/operator:$root/trainer_image:$root/testbed${PYTHONPATH:+:$PYTHONPATH}"
# The linter first (seconds): pyproject.toml [tool.ruff] says what it checks.
ruff check --quiet operator trainer_image testbed tests benchmarks scripts
case "$tier" in
  fast)
    exec python -m pytest -q -m "not integration and not slow and not e2e" "$@" ;;
  all)
    # Build whatever testbed binary is missing first (cached by version: a
    # no-op when warm; about an hour cold on 2 cores, see testbed/README.md),
    # so no test's timeout ever covers a compile.
    testbed/build.sh >/dev/null
    # The CRD validators of each Kubernetes version (tests/integration/api/test_crd_kubernetes_versions.py):
    # cold, three versions of the API server's libraries to compile, which a test's 600 s must not cover.
    testbed/build.sh --crd-check >/dev/null
    # The real node (kubelet + containerd) and both images from their Dockerfiles, for the
    # realnode e2e tests: built (cached) here too. It needs root; elsewhere those tests skip.
    if [[ $(id -u) == 0 ]]; then
      testbed/build.sh --real-node >/dev/null
      log=${KUBETRAIN_CACHE:-$HOME/.cache/kubetrain}/images-build.log
      echo "[test] building the images (cached layers; the first build downloads torch: minutes) - $log" >&2
      python -m kubetrain_testbed images --build-only >"$log" 2>&1 || { tail -n 30 "$log" >&2; exit 1; }
    fi
    was_up=0
    python -m kubetrain_testbed status >/dev/null 2>&1 && was_up=1
    cleanup() { [[ $was_up == 1 ]] || python -m kubetrain_testbed down || true; }
    trap cleanup EXIT
    python -m pytest -q "$@" ;;
esac
