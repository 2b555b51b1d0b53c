"""The real node's files (pure renderers): the settings this machine needs, and the network rules."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

from kubetrain_testbed.realnode_config import (REAL_NODE_TAINT, RealNodeLayout, cni_conflist, containerd_toml, corefile,
                                               kubelet_config, runc_wrapper)

N = RealNodeLayout(state=Path("/state/realnode"), bin_dir=Path("/cache/bin"))


def test_containerd_keeps_everything_under_the_state_folder_and_pins_the_local_sandbox_image():
    cfg = tomllib.loads(containerd_toml(N))
    assert cfg["version"] == 3
    assert cfg["root"] == "/cache/containerd-root", "the image store is a cache shared by checkouts"
    assert cfg["state"].startswith("/state/realnode/")
    assert cfg["grpc"]["address"] == str(N.containerd_sock)
    images = cfg["plugins"]["io.containerd.cri.v1.images"]
    assert images["pinned_images"]["sandbox"] == f"127.0.0.1:{N.registry_port}/kubetrain/pause:1"
    runtime = cfg["plugins"]["io.containerd.cri.v1.runtime"]
    assert runtime["cni"]["conf_dir"] == str(N.cni_conf_dir)
    # Nothing in the host-wide paths a host's own containerd uses: runc state, netns, NRI.
    assert runtime["containerd"]["runtimes"]["runc"]["options"]["Root"].startswith("/state/realnode/")
    assert runtime["netns_mounts_under_state_dir"] is True
    assert cfg["plugins"]["io.containerd.nri.v1.nri"]["disable"] is True


def test_images_outside_the_loopback_registry_are_never_fetched_from_outside():
    from kubetrain_testbed.realnode_config import NO_OUTSIDE_REGISTRY

    assert tomllib.loads(NO_OUTSIDE_REGISTRY)["server"] == "http://127.0.0.1:1"


def test_pods_get_no_default_route_and_no_masquerade():
    bridge = json.loads(cni_conflist(N))["plugins"][0]
    assert bridge["ipMasq"] is False and bridge["isDefaultGateway"] is False
    # Only the bridge subnet (implicit) and the service range (to reach the API server) are routed.
    assert bridge["ipam"]["routes"] == [{"dst": N.service_cidr, "gw": N.gateway}]
    assert bridge["ipam"]["dataDir"].startswith("/state/realnode/")


def test_kubelet_runs_on_cgroup_v1_with_cgroupfs_serves_on_the_gateway_and_is_tainted():
    cfg = json.loads(kubelet_config(N, resolv_conf=Path("/state/realnode/resolv.conf")))
    assert (cfg["failCgroupV1"], cfg["cgroupDriver"]) == (False, "cgroupfs")
    assert cfg["address"] == N.gateway and cfg["clusterDNS"] == [N.gateway]
    assert cfg["cgroupRoot"] == N.cgroup_root and cfg["podLogsDir"].startswith("/state/realnode/")
    assert {"key": REAL_NODE_TAINT, "value": "true", "effect": "NoSchedule"} in cfg["registerWithTaints"]


def test_coredns_serves_the_cluster_domain_on_the_gateway_and_nothing_outside():
    text = corefile(N, kubeconfig=Path("/kc"))
    assert text.count(f"bind {N.gateway}") == 2
    assert "kubeconfig /kc" in text and "forward" not in text
    assert "rcode NXDOMAIN" in text


def test_runc_wrapper_clamps_negative_oom_scores_and_execs_the_real_runc(tmp_path):
    fake = tmp_path / "runc"
    fake.write_text("#!/bin/sh\necho \"$@\" > \"$(dirname \"$0\")/args\"\n")
    fake.chmod(0o755)
    wrapper = tmp_path / "wrapper"
    wrapper.write_text(runc_wrapper(str(fake)))
    wrapper.chmod(0o755)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    for given, expected in ((-998, 0), (-997, 0), (500, 500)):
        (bundle / "config.json").write_text(json.dumps({"process": {"oomScoreAdj": given}}, separators=(",", ":")))
        subprocess.run([str(wrapper), "create", "--bundle", str(bundle), "ctr1"], check=True)
        assert json.loads((bundle / "config.json").read_text())["process"]["oomScoreAdj"] == expected
        assert (tmp_path / "args").read_text().split() == ["create", "--bundle", str(bundle), "ctr1"]
