"""The real node's configuration files, as pure text: containerd, CNI, kubelet, CoreDNS, registry.

The real node is one kubelet + containerd (runc) node of the testbed whose
pods run as containers in network namespaces on a private bridge. Nothing
here starts anything: each function renders one file from a `RealNodeLayout`,
so every setting can be read, reviewed and unit-tested in one place.

Network rules (tests only, see testbed/README.md "The real node"):
- pods live on `bridge` (`subnet`), the node's own address is `gateway`;
- pods have a route to the bridge subnet and to the service range only (no
  default route): nothing leaves the machine, and nothing is masqueraded;
- the `kubernetes` Service, MinIO and the registry are reached on addresses
  the host answers itself (DNAT to their 127.0.0.1 ports).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

REAL_NODE_TAINT = "kubetrain.io/real-node"
"""Registered as `<taint>=true:NoSchedule`: kwok-tier pods never land on the real node."""
REAL_NODE_LABEL = "kubetrain.io/real-node"
CLUSTER_DOMAIN = "cluster.local"
MINIO_POD_PORT = 9000
"""MinIO as pods see it: http://<gateway>:9000."""
REGISTRY_POD_PORT = 5000


@dataclass(frozen=True)
class RealNodeLayout:
    """Paths, addresses and ports of one real node (derived once from the testbed config)."""

    state: Path
    """Everything the node writes: containerd root/state, kubelet root, logs, CNI state."""
    bin_dir: Path
    """kubelet, containerd, containerd-shim-runc-v2, ctr, coredns, registry."""
    node_name: str = "real-node-0"
    bridge: str = "kt-br0"
    subnet: str = "10.89.0.0/24"
    gateway: str = "10.89.0.1"
    service_cidr: str = "10.96.0.0/16"
    service_ip: str = "10.96.0.1"
    cni_bin_dir: Path = Path("/usr/lib/cni")
    registry_port: int = 30500
    """On 127.0.0.1, fixed so that image references (and containerd's image store) survive restarts;
    below the ephemeral port range, where the testbed's other (random) ports come from."""
    kubelet_port: int = 10250
    kubelet_healthz_port: int = 10248
    coredns_health_port: int = 10253
    containerd_metrics_port: int = 10257

    @property
    def registry(self) -> str:
        """The image registry host as containerd (and image references) name it."""
        return f"127.0.0.1:{self.registry_port}"

    @property
    def containerd_sock(self) -> Path:
        return self.state / "containerd" / "containerd.sock"

    @property
    def containerd_root(self) -> Path:
        # Beside the binaries and kept across `down`/`up` and clones: the image store is a cache (the
        # 5.6 GB trainer image is pulled and unpacked once per machine, not once per checkout).
        return self.bin_dir.parent / "containerd-root"

    @property
    def containerd_state(self) -> Path:
        return self.state / "containerd"

    @property
    def kubelet_root(self) -> Path:
        return self.state / "kubelet"

    @property
    def cgroup_root(self) -> str:
        """Every pod cgroup lives under this subtree of each v1 hierarchy; `down` removes it."""
        return "/kubetrain-testbed"

    @property
    def wrapper_dir(self) -> Path:
        return self.state / "wrappers"

    @property
    def cni_conf_dir(self) -> Path:
        return self.state / "cni" / "net.d"

    @property
    def pause_image(self) -> str:
        return f"{self.registry}/kubetrain/pause:1"


def containerd_toml(n: RealNodeLayout) -> str:
    """containerd 2.x config (version 3): everything under the node's state folder."""
    return f"""version = 3
root = "{n.containerd_root}"
state = "{n.containerd_state}"

[grpc]
  address = "{n.containerd_sock}"

[ttrpc]
  address = "{n.containerd_sock}.ttrpc"

[metrics]
  address = "127.0.0.1:{n.containerd_metrics_port}"

[plugins.'io.containerd.cri.v1.runtime']
  enable_selinux = false
  # Pod network namespaces under our state folder, not /run/netns (the host's).
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = false
        # runc's state under ours, not /run/containerd/runc (a host containerd's).
        Root = "{n.state / 'runc'}"
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{n.cni_bin_dir}"]
    conf_dir = "{n.cni_conf_dir}"
    max_conf_num = 1

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{n.pause_image}"
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = "{n.state / 'certs.d'}"

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true

# No NRI: its socket and plugin folder are host-wide paths.
[plugins.'io.containerd.nri.v1.nri']
  disable = true
"""


NO_OUTSIDE_REGISTRY = """# kubetrain testbed: an image outside the loopback registry is never fetched from outside.
server = "http://127.0.0.1:1"
"""


def registry_hosts_toml(n: RealNodeLayout) -> str:
    """certs.d/<registry>/hosts.toml: the loopback registry speaks plain HTTP."""
    return f"""server = "http://{n.registry}"

[host."http://{n.registry}"]
  capabilities = ["pull", "resolve", "push"]
  skip_verify = true
"""


def cni_conflist(n: RealNodeLayout) -> str:
    """bridge + host-local + loopback; no masquerade, no default route (only the subnet and services)."""
    return json.dumps({
        "cniVersion": "1.0.0",
        "name": "kubetrain-testbed",
        "plugins": [
            {
                "type": "bridge",
                "bridge": n.bridge,
                "isGateway": True,
                "isDefaultGateway": False,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": n.subnet, "gateway": n.gateway}]],
                    "routes": [{"dst": n.service_cidr, "gw": n.gateway}],
                    "dataDir": str(n.state / "cni" / "ipam"),
                },
            },
            {"type": "loopback"},
        ],
    }, indent=2)


def kubelet_config(n: RealNodeLayout, *, resolv_conf: Path) -> str:
    """KubeletConfiguration for cgroup v1 with the cgroupfs driver, served on the gateway address."""
    cfg = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # this machine mounts only v1 controllers
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": n.cgroup_root,
        "cgroupsPerQOS": True,
        "containerRuntimeEndpoint": f"unix://{n.containerd_sock}",
        "address": n.gateway,
        "port": n.kubelet_port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": n.kubelet_healthz_port,
        # Tests only: the API server's client certificate is not checked, every request is allowed.
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDomain": CLUSTER_DOMAIN,
        "clusterDNS": [n.gateway],
        "resolvConf": str(resolv_conf),
        "failSwapOn": False,
        "enforceNodeAllocatable": [],
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "podLogsDir": str(n.state / "pod-logs"),
        "registerWithTaints": [{"key": REAL_NODE_TAINT, "value": "true", "effect": "NoSchedule"}],
        "serializeImagePulls": False,
        "maxPods": 30,
        "nodeStatusUpdateFrequency": "4s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "volumeStatsAggPeriod": "1m",
        "localStorageCapacityIsolation": True,
        "protectKernelDefaults": False,
        "makeIPTablesUtilChains": False,
        "oomScoreAdj": 0,
    }
    return json.dumps(cfg, indent=2)


def corefile(n: RealNodeLayout, *, kubeconfig: Path) -> str:
    """CoreDNS: the cluster domain from the API server, NXDOMAIN for everything else (no outside)."""
    return f"""{CLUSTER_DOMAIN}:53 in-addr.arpa:53 ip6.arpa:53 {{
    bind {n.gateway}
    errors
    health 127.0.0.1:{n.coredns_health_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
}}
.:53 {{
    bind {n.gateway}
    template ANY ANY {{
        rcode NXDOMAIN
    }}
}}
"""


def registry_yaml(n: RealNodeLayout, *, storage: Path) -> str:
    return f"""version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{n.registry_port}
"""


def pod_resolv_conf() -> str:
    """The base resolv.conf for pods: no outside nameserver (ClusterFirst pods get the cluster DNS)."""
    return "# kubetrain testbed real node: no resolver outside the cluster\noptions ndots:5\n"


RUNC_WRAPPER = """#!/bin/sh
# kubetrain testbed: runc as containerd calls it, with negative OOM scores clamped to 0.
#
# Why: CRI asks for oom_score_adj -998 on every pod sandbox and the kubelet for
# -997 on Guaranteed pods. Lowering an OOM score needs CAP_SYS_RESOURCE, which
# root lacks on this kind of VM, so runc fails every such container with
# "nsexec: failed to update /proc/self/oom_score_adj: Permission denied".
# containerd's restrict_oom_score_adj does not reach sandboxes, and a runtime
# BinaryName is not used for them. The testbed installs this wrapper first on
# containerd's PATH only where CAP_SYS_RESOURCE is missing; elsewhere runc runs
# as it is. The value is raised, never lowered: no process gets more than asked.
real=@REAL_RUNC@
bundle=""
prev=""
for a in "$@"; do
  case "$prev" in --bundle|-b) bundle=$a ;; esac
  case "$a" in --bundle=*) bundle=${a#--bundle=} ;; esac
  prev=$a
done
if [ -n "$bundle" ] && [ -f "$bundle/config.json" ] && grep -q '"oomScoreAdj": *-' "$bundle/config.json"; then
  sed -i 's/"oomScoreAdj": *-[0-9]*/"oomScoreAdj":0/' "$bundle/config.json"
fi
exec "$real" "$@"
"""


def runc_wrapper(real_runc: str) -> str:
    return RUNC_WRAPPER.replace("@REAL_RUNC@", real_runc)


PAUSE_GO = """// The pod sandbox's process: sleeps until SIGTERM/SIGINT, reaps orphans (PID 1 of the pod).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for s := range sigs {
		if s == syscall.SIGCHLD {
			for {
				pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
			continue
		}
		os.Exit(0)
	}
}
"""
