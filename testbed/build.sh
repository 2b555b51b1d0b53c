#!/usr/bin/env bash
# Builds the testbed's server binaries from source through the Go module proxy
# into a cache folder keyed by the pinned versions (testbed/versions.env).
# Only missing binaries are built, so a warm machine returns at once.
#
#   testbed/build.sh            build what is missing, print the bin folder
#   testbed/build.sh --print    print the bin folder only (nothing is built)
#   testbed/build.sh --real-node [--print]   the real node's binaries (own cache folder)
#   testbed/build.sh --kueue [--print]       Kueue and its CRDs (own cache folder)
#   testbed/build.sh --crd-check [--print]   crdcheck-<version>: a CRD validator per Kubernetes version
#                                            in CRD_CHECK_K8S_VERSIONS (own cache folder)
#
# A plain run (no TESTBED_COMPONENTS) also warms Kueue's folder afterwards, unless
# TESTBED_WARM_KUEUE=0 (what `up` passes: a testbed without Kueue never compiles it).
#
# Each component gets its own tiny wrapper Go module under <cache>/src/<name>,
# because their dependency graphs disagree (etcd server vs. k8s' etcd client,
# MinIO's pins vs. kwok's). The Go build cache is shared between them.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

key="k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_minio-${MINIO_VERSION##*-}_helm-${HELM_VERSION}"
default_components="etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm minio"
real_node=0
if [[ "${1:-}" == "--real-node" ]]; then
  # The real node's binaries live in their own folder: adding them never
  # invalidates (rebuilds) the control plane's cache.
  shift
  real_node=1
  key="realnode-k8s-${K8S_VERSION}_containerd-${CONTAINERD_VERSION}_coredns-${COREDNS_VERSION}_registry-${REGISTRY_VERSION}"
  default_components="kubelet containerd coredns registry"
elif [[ "${1:-}" == "--kueue" ]]; then
  # Kueue (an optional component: `up --kueue`) and the CRDs of the same module, in a
  # folder keyed by its version alone (it builds against its own Kubernetes libraries).
  shift
  key="kueue-${KUEUE_VERSION}"
  default_components="kueue"
elif [[ "${1:-}" == "--crd-check" ]]; then
  # testbed/crdcheck (the API server's CRD validation, no server) once per version: keyed by
  # its source too, so an edit of main.go builds new binaries.
  shift
  key="crdcheck-$(sha256sum "$here/crdcheck/main.go" | cut -c1-12)"
  default_components="crdcheck"
fi
cache="${KUBETRAIN_CACHE:-$HOME/.cache/kubetrain}/testbed/$key"
bin="$cache/bin"
if [[ "${1:-}" == "--print" ]]; then echo "$bin"; exit 0; fi
mkdir -p "$bin" "$cache/src" "$cache/logs"

# One build per cache folder at a time: a second caller (another shell, a
# pytest session) waits here and then finds the binaries already built.
exec 9>"$cache/build.lock"
if ! flock -n 9; then
  printf '[testbed-build] another build of %s is running; waiting for it\n' "$cache" >&2
  flock 9
fi

# The real node's host programs come from Debian (runc, CNI plugins, buildah for the images,
# mmdebstrap for their base, iptables/iproute2 for the pod network): installed when missing.
if [[ $real_node == 1 ]]; then
  need=()
  for pair in runc:runc buildah:buildah mmdebstrap:mmdebstrap iptables:iptables ip:iproute2; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair##*:}")
  done
  [[ -x /usr/lib/cni/bridge ]] || need+=(containernetworking-plugins)
  if (( ${#need[@]} )); then
    if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
      printf '[testbed-build] the real node needs these Debian packages: %s\n' "${need[*]}" >&2; exit 1
    fi
    printf '[testbed-build] installing %s\n' "${need[*]}" >&2
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q "${need[@]}"; } \
      >"$cache/logs/apt.log" 2>&1 || { tail -n 20 "$cache/logs/apt.log" >&2; exit 1; }
  fi
fi

export GOFLAGS="-buildvcs=false -trimpath"
export CGO_ENABLED=0

minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
staging_version="v0.${K8S_VERSION#v1.}"

log() { printf '[testbed-build] %s\n' "$*" >&2; }

# wrapper NAME MODULE@VERSION: make <cache>/src/NAME a module requiring it.
wrapper() {
  local name=$1 req=$2 dir="$cache/src/$1"
  mkdir -p "$dir"
  if [[ ! -f "$dir/go.mod" ]]; then
    (cd "$dir" && go mod init "kubetrain.local/testbed/$name" >/dev/null 2>&1)
  fi
  echo "$dir"
}

# mod_path FIELD MODULE@VERSION: the path `go mod download -json` gives as FIELD (GoMod, Dir). Its errors
# come as JSON on stdout, never on stderr: logged here, not swallowed by a pipe into sed (under set -e
# such a pipe ended the build with no word at all).
mod_path() {
  local field=$1 req=$2 json path
  if ! json=$(go mod download -json "$req"); then
    log "FAILED: go mod download $req: $(sed -n 's/^[[:space:]]*"Error": "\(.*\)",\{0,1\}$/\1/p' <<<"$json" | head -n 1)"
    return 1
  fi
  path=$(sed -n "s/^[[:space:]]*\"$field\": \"\\(.*\\)\",\\{0,1\\}\$/\\1/p" <<<"$json")
  [[ -e "$path" ]] || { log "FAILED: go mod download $req named no $field"; return 1; }
  echo "$path"
}

# k8s_module: the k8s wrapper module, whose go.mod replaces every staging module
# upstream replaces with ./staging/... by its published twin: derived, never
# hand-copied. It runs inside $(...), where set -e does not hold, so each step is
# checked, and the go.mod is rewritten through a temporary file: a failed download
# once left an empty replace block there that every later build trusted.
k8s_module() {
  local dir upstream entry='^[[:space:]]*k8s\.io/[a-z0-9-]* => k8s\.io/'
  dir=$(wrapper k8s "k8s.io/kubernetes@$K8S_VERSION") || return 1
  # Guarded on an entry, not on the word: an empty block left by an older run is rebuilt.
  if grep -q "$entry" "$dir/go.mod"; then echo "$dir"; return 0; fi
  upstream=$(mod_path GoMod "k8s.io/kubernetes@$K8S_VERSION") || return 1
  {
    sed '/^replace (/,/^)/d' "$dir/go.mod"
    echo "replace ("
    sed -n 's#^\s*\(k8s\.io/[a-z0-9-]*\) => \./staging/.*#\1#p' "$upstream" |
      while read -r m; do echo "	$m => $m $staging_version"; done
    echo ")"
  } >"$dir/go.mod.tmp"
  if ! grep -q "$entry" "$dir/go.mod.tmp"; then
    log "FAILED: no staging module replaced in $upstream"; rm -f "$dir/go.mod.tmp"; return 1
  fi
  mv "$dir/go.mod.tmp" "$dir/go.mod" && echo "$dir"
}

# build NAME PACKAGE MODULE_DIR REQUIREMENT [LDFLAGS [TAGS]]
build() {
  local name=$1 pkg=$2 dir=$3 req=$4 ldflags=${5:-} tags=${6:-}
  if [[ -x "$bin/$name" ]]; then return 0; fi
  log "building $name ($req) — logs: $cache/logs/$name.log"
  local start=$SECONDS
  (
    cd "$dir"
    # "." is the wrapper module's own main.go (crdcheck): its imports come from the requirement.
    if [[ "$pkg" == . ]]; then go get "$req" && go mod tidy; else go get "$req" && go get -tool "$pkg@${req##*@}"; fi &&
      go build -tags "$tags" -ldflags "-s -w $ldflags" -o "$bin/$name.tmp" "$pkg" &&
      mv "$bin/$name.tmp" "$bin/$name"
  ) >"$cache/logs/$name.log" 2>&1 || {
    log "FAILED to build $name; last lines of its log:"
    tail -n 30 "$cache/logs/$name.log" >&2
    return 1
  }
  log "built $name in $((SECONDS - start)) s"
}

# verify NAME EXPECTED ARGS...: the built binary must report the pinned version
# (a stray `go get` upgrade would otherwise go unnoticed); removed if not.
verify() {
  local name=$1 expected=$2 said; shift 2
  said=$("$bin/$name" "$@" 2>&1 || true)
  if [[ "$said" != *"$expected"* ]]; then
    log "$name does not report '$expected' (it says: ${said%%$'\n'*}); removing it"
    rm -f "$bin/$name"
    return 1
  fi
}

# helm_assumes BINARY: the Kubernetes version (v1.N.0) a helm binary renders a chart for without a
# cluster, as `helm template` does; empty when it says none.
helm_assumes() {
  local probe said
  probe=$(mktemp -d) || return 1
  mkdir -p "$probe/chart/templates" "$probe/home"
  printf 'apiVersion: v2\nname: probe\nversion: 0.1.0\n' >"$probe/chart/Chart.yaml"
  printf 'kube: {{ .Capabilities.KubeVersion.Version }}\n' >"$probe/chart/templates/kube.yaml"
  said=$(HELM_CACHE_HOME="$probe/home" HELM_CONFIG_HOME="$probe/home" HELM_DATA_HOME="$probe/home" \
    "$1" template probe "$probe/chart" 2>/dev/null) || true
  rm -rf "$probe"
  sed -n 's/^kube: //p' <<<"$said"
}

k8s_ldflags() {
  local p=k8s.io/component-base/version
  echo "-X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean" \
    "-X $p.buildDate=1970-01-01T00:00:00Z" \
    "-X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$minor"
}

want=${TESTBED_COMPONENTS:-$default_components}
for c in $want; do
  case $c in
    etcd)
      build etcd go.etcd.io/etcd/server/v3 "$(wrapper etcd x)" "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
      verify etcd "etcd Version: ${ETCD_VERSION#v}" --version ;;
    kube-apiserver|kube-controller-manager|kube-scheduler|kubectl|kubelet)
      # Not inline in build's arguments: a failure there would go unnoticed.
      k8s_dir=$(k8s_module) || exit 1
      build "$c" "k8s.io/kubernetes/cmd/$c" "$k8s_dir" "k8s.io/kubernetes@$K8S_VERSION" "$(k8s_ldflags)" ;;
    kwok)
      build kwok sigs.k8s.io/kwok/cmd/kwok "$(wrapper kwok x)" "sigs.k8s.io/kwok@$KWOK_VERSION" \
        "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" ;;
    helm)
      # As helm's Makefile does: the Kubernetes version `helm template` and `helm lint` assume without a
      # cluster is the minor of the k8s.io modules helm builds against (v1.34 for v3.19); without these
      # flags it is v1.20, which the chart's kubeVersion refuses. Checked by asking the binary (its build
      # info records no -ldflags under -trimpath): a helm that assumes another version is rebuilt once.
      helm_mod=$(mod_path GoMod "helm.sh/helm/v3@$HELM_VERSION") || exit 1
      helm_k8s_minor=$(sed -n 's#^\s*k8s\.io/client-go v0\.\([0-9]*\)\..*#\1#p' "$helm_mod")
      [[ -n "$helm_k8s_minor" ]] || { log "FAILED: no k8s.io/client-go version in $helm_mod"; exit 1; }
      helm_kube="v1.$helm_k8s_minor.0"
      helm_k8s_flags=""
      for p in chartutil lint/rules; do
        helm_k8s_flags+=" -X helm.sh/helm/v3/pkg/$p.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/$p.k8sVersionMinor=$helm_k8s_minor"
      done
      if [[ -x "$bin/helm" ]]; then
        said=$(helm_assumes "$bin/helm")
        if [[ "$said" != "$helm_kube" ]]; then
          log "rebuilding helm: without a cluster it assumes Kubernetes ${said:-(nothing said)}, not $helm_kube"
          rm -f "$bin/helm"
        fi
      fi
      if [[ ! -x "$bin/helm" ]]; then
        build helm helm.sh/helm/v3/cmd/helm "$(wrapper helm x)" "helm.sh/helm/v3@$HELM_VERSION" \
          "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION$helm_k8s_flags"
        said=$(helm_assumes "$bin/helm")
        if [[ "$said" != "$helm_kube" ]]; then
          log "FAILED: the helm built assumes Kubernetes ${said:-(nothing said)} without a cluster, not $helm_kube" \
            "(no variable of its -X flags in helm $HELM_VERSION?); removing it"
          rm -f "$bin/helm"
          exit 1
        fi
      fi ;;
    minio)
      build minio github.com/minio/minio "$(wrapper minio x)" "github.com/minio/minio@$MINIO_VERSION" ;;
    containerd)
      # containerd 2.x (Kubernetes 1.36 dropped containerd 1.x), its runc shim and ctr; no
      # cgo, none of the storage drivers this node never uses.
      ctd_tags="no_btrfs no_devmapper no_zfs no_aufs"
      ctd_ldflags="-X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
      for p in containerd containerd-shim-runc-v2 ctr; do
        build "$p" "github.com/containerd/containerd/v2/cmd/$p" "$(wrapper containerd x)" \
          "github.com/containerd/containerd/v2@$CONTAINERD_VERSION" "$ctd_ldflags" "$ctd_tags"
      done ;;
    coredns)
      build coredns github.com/coredns/coredns "$(wrapper coredns x)" "github.com/coredns/coredns@$COREDNS_VERSION" ;;
    kueue)
      build kueue sigs.k8s.io/kueue/cmd/kueue "$(wrapper kueue x)" "sigs.k8s.io/kueue@$KUEUE_VERSION" \
        "-X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
      # The module's own CRDs (v1beta1 served, v1beta2 stored) and its manager's ClusterRole and
      # secrets Role, copied beside bin/ as <cache>/crds/*.yaml and <cache>/rbac/*.yaml.
      if [[ ! -f "$cache/crds/kueue.x-k8s.io_workloads.yaml" || ! -f "$cache/rbac/manager_secrets_role.yaml" ]]; then
        src=$(mod_path Dir "sigs.k8s.io/kueue@$KUEUE_VERSION") || exit 1
        # One step a line: set -e ignores a failure before the last `&&` of a list, and a
        # failed copy once went into place as empty folders with "copied" logged.
        rm -rf "$cache/crds.tmp" "$cache/rbac.tmp"
        mkdir -p "$cache/crds.tmp" "$cache/rbac.tmp"
        cp "$src"/config/components/crd/bases/*.yaml "$cache/crds.tmp/"
        cp "$src"/config/components/rbac/{role,manager_secrets_role}.yaml "$cache/rbac.tmp/"
        chmod 0644 "$cache/crds.tmp/"*.yaml "$cache/rbac.tmp/"*.yaml
        rm -rf "$cache/crds" "$cache/rbac"
        mv "$cache/crds.tmp" "$cache/crds"
        mv "$cache/rbac.tmp" "$cache/rbac"
        log "copied Kueue's CRDs to $cache/crds and its manager's roles to $cache/rbac"
      fi ;;
    crdcheck)
      for v in $CRD_CHECK_K8S_VERSIONS; do
        dir=$(wrapper "crdcheck-$v" x)
        cp "$here/crdcheck/main.go" "$dir/main.go"
        build "crdcheck-$v" . "$dir" "k8s.io/apiextensions-apiserver@v0.${v#v1.}"
      done ;;
    registry)
      build registry github.com/distribution/distribution/v3/cmd/registry "$(wrapper registry x)" \
        "github.com/distribution/distribution/v3@$REGISTRY_VERSION" ;;
    *) log "unknown component $c"; exit 2 ;;
  esac
done
if [[ $key == k8s-* && -z "${TESTBED_COMPONENTS:-}" && "${TESTBED_WARM_KUEUE:-1}" != 0 ]]; then
  # Kueue's folder is separate (its key never touches the control plane's); fd 9 (this
  # folder's lock) is not passed on.
  "$here/build.sh" --kueue >/dev/null 9>&-
fi
echo "$bin"
