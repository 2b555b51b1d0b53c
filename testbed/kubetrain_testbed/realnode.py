"""The real node: a kubelet + containerd node whose pods run as containers, started and removed cleanly.

`up` adds it to a running control plane (`scripts/testbed.sh up --nodes real`):
the bridge network and its few iptables rules, a loopback image registry,
containerd (runc, CNI), the kubelet, and CoreDNS for the cluster domain. `down`
removes every container, network namespace, mount, cgroup and rule it made,
and restores what it changed on the host (`HOST_SETTINGS`). The files come
from the pure renderers in `realnode_config`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from . import procs, prune
from .components import Component, Health
from .procs import Running, TestbedError
from .realnode_config import (MINIO_POD_PORT, NO_OUTSIDE_REGISTRY, PAUSE_GO, REGISTRY_POD_PORT, RealNodeLayout, cni_conflist,
                              containerd_toml, corefile, kubelet_config, pod_resolv_conf, registry_hosts_toml,
                              registry_yaml, runc_wrapper)

NAT_CHAIN = "KT-TESTBED-DNAT"
FWD_CHAIN = "KT-TESTBED-FWD"
IN_CHAIN = "KT-TESTBED-IN"
CAP_SYS_RESOURCE = 24

HOST_SETTINGS = ("net/ipv4/ip_forward", "vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic",
                 "kernel/panic_on_oops", "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
"""Host settings the node changes: the CNI bridge plugin switches forwarding on, and the kubelet
(protectKernelDefaults false) sets its six kernel defaults. `down` writes the originals back."""
HOST_SETTINGS_FILE = Path("/run/kubetrain-testbed/host-settings.json")
"""The originals, written once per boot (a killed run's `up` must not take its changes for originals)."""


def save_host_settings() -> None:
    if HOST_SETTINGS_FILE.exists():
        return
    HOST_SETTINGS_FILE.parent.mkdir(parents=True, exist_ok=True)
    values = {k: Path("/proc/sys", k).read_text().strip() for k in HOST_SETTINGS if Path("/proc/sys", k).exists()}
    tmp = HOST_SETTINGS_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(values, indent=1))
    tmp.replace(HOST_SETTINGS_FILE)


def restore_host_settings() -> None:
    try:
        values = json.loads(HOST_SETTINGS_FILE.read_text())
    except (OSError, ValueError):
        return
    for key, value in values.items():
        try:
            Path("/proc/sys", key).write_text(value + "\n")
        except OSError:
            pass
    HOST_SETTINGS_FILE.unlink(missing_ok=True)


def real_node_bin_dir(build_script: Path) -> Path:
    out = subprocess.run(["bash", str(build_script), "--real-node", "--print"], check=True, capture_output=True,
                         text=True)
    return Path(out.stdout.strip())


def ensure_binaries(build_script: Path) -> Path:
    proc = subprocess.run(["bash", str(build_script), "--real-node"], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise TestbedError(f"{build_script} --real-node failed (exit {proc.returncode}); its output is above")
    return Path(proc.stdout.strip().splitlines()[-1])


def missing_prerequisites() -> list[str]:
    """Host programs the real node needs (Debian packages: runc, containernetworking-plugins, buildah, iptables)."""
    out = []
    if os.geteuid() != 0:
        out.append("root (network namespaces, mounts, cgroups)")
    for prog in ("runc", "ip", "iptables", "buildah"):
        if shutil.which(prog) is None:
            out.append(prog)
    if not Path("/usr/lib/cni/bridge").exists():
        out.append("CNI plugins in /usr/lib/cni (containernetworking-plugins)")
    if not Path("/sys/fs/cgroup/memory/cgroup.procs").exists():
        out.append("cgroup v1 hierarchies (the node is written for this machine's v1 layout; v2 is not supported yet)")
    return out


def _run(*argv: str, check: bool = True, input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a command; with check=False nothing raises (teardown goes on past a hung or missing tool)."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, input=input, timeout=timeout)
    except (subprocess.TimeoutExpired, OSError) as exc:
        if check:
            raise TestbedError(f"{' '.join(argv)} failed: {exc}") from exc
        return subprocess.CompletedProcess(list(argv), 1, "", str(exc))
    if check and proc.returncode != 0:
        raise TestbedError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _lacks_cap_sys_resource() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return not (int(line.split()[1], 16) >> CAP_SYS_RESOURCE) & 1
    return True


# ------------------------------------------------------------------ network
def network_up(n: RealNodeLayout, *, api_port: int, minio_port: int) -> None:
    network_down(n)  # leftovers of a killed run
    save_host_settings()
    _run("ip", "link", "add", n.bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{n.gateway}/{n.subnet.split('/')[1]}", "dev", n.bridge)
    _run("ip", "link", "set", n.bridge, "up")
    # Pods reach host services on loopback ports through DNAT: allowed on this bridge only.
    Path(f"/proc/sys/net/ipv4/conf/{n.bridge}/route_localnet").write_text("1\n")
    dnat = [(n.service_ip, 443, api_port), (n.gateway, MINIO_POD_PORT, minio_port),
            (n.gateway, REGISTRY_POD_PORT, n.registry_port)]
    _run("iptables", "-t", "nat", "-N", NAT_CHAIN)
    for dst, port, to in dnat:
        _run("iptables", "-t", "nat", "-A", NAT_CHAIN, "-d", dst, "-p", "tcp", "--dport", str(port),
             "-j", "DNAT", "--to-destination", f"127.0.0.1:{to}")
    _run("iptables", "-t", "nat", "-I", "PREROUTING", "-i", n.bridge, "-j", NAT_CHAIN)
    # Nothing from the pods is forwarded anywhere but the bridge itself (belt and braces: pods
    # have no default route either).
    _run("iptables", "-N", FWD_CHAIN)
    _run("iptables", "-A", FWD_CHAIN, "-i", n.bridge, "!", "-o", n.bridge, "-j", "DROP")
    _run("iptables", "-A", FWD_CHAIN, "-o", n.bridge, "!", "-i", n.bridge, "-j", "DROP")
    _run("iptables", "-A", FWD_CHAIN, "-i", n.bridge, "-o", n.bridge, "-j", "ACCEPT")  # a host FORWARD DROP policy
    _run("iptables", "-I", "FORWARD", "-j", FWD_CHAIN)
    # What the host answers on the node address: the API server's calls to the kubelet (they come
    # from the host itself, on lo) and DNS from pods; nothing else, from pods or from outside. And
    # the guard kube-proxy keeps against CVE-2020-8558: loopback reached from the bridge only by DNAT.
    # Replies to the host's own connections to pods (the kubelet's probes come from the node address)
    # pass: without this the kubelet's httpGet probes never connected and it restarted healthy pods.
    _run("iptables", "-N", IN_CHAIN)
    _run("iptables", "-A", IN_CHAIN, "-d", n.gateway, "-i", "lo", "-j", "ACCEPT")
    _run("iptables", "-A", IN_CHAIN, "-d", n.gateway, "-i", n.bridge, "-m", "conntrack", "--ctstate",
         "ESTABLISHED,RELATED", "-j", "ACCEPT")
    for proto in ("udp", "tcp"):
        _run("iptables", "-A", IN_CHAIN, "-d", n.gateway, "-i", n.bridge, "-p", proto, "--dport", "53", "-j", "ACCEPT")
    _run("iptables", "-A", IN_CHAIN, "-d", n.gateway, "-j", "DROP")
    _run("iptables", "-A", IN_CHAIN, "-i", n.bridge, "-d", "127.0.0.0/8", "-m", "conntrack", "!", "--ctstate",
         "RELATED,ESTABLISHED,DNAT", "-j", "DROP")
    _run("iptables", "-I", "INPUT", "-j", IN_CHAIN)


def network_down(n: RealNodeLayout) -> None:
    """Remove the bridge and the rules (each step tolerates being already undone)."""
    while _run("iptables", "-t", "nat", "-D", "PREROUTING", "-i", n.bridge, "-j", NAT_CHAIN, check=False).returncode == 0:
        pass
    _run("iptables", "-t", "nat", "-F", NAT_CHAIN, check=False)
    _run("iptables", "-t", "nat", "-X", NAT_CHAIN, check=False)
    for table_chain in (("FORWARD", FWD_CHAIN), ("INPUT", IN_CHAIN)):
        while _run("iptables", "-D", table_chain[0], "-j", table_chain[1], check=False).returncode == 0:
            pass
        _run("iptables", "-F", table_chain[1], check=False)
        _run("iptables", "-X", table_chain[1], check=False)
    _run("ip", "link", "del", n.bridge, check=False)


# ------------------------------------------------------------------ files
def write_files(n: RealNodeLayout, *, admin_kubeconfig: Path) -> None:
    for d in (n.state, n.containerd_root, n.containerd_state, n.kubelet_root, n.cni_conf_dir, n.wrapper_dir,
              n.state / "pod-logs", n.state / "cni" / "ipam", n.state / "certs.d" / n.registry,
              n.state / "certs.d" / "_default"):
        d.mkdir(parents=True, exist_ok=True)
    (n.state / "containerd.toml").write_text(containerd_toml(n))
    (n.state / "certs.d" / n.registry / "hosts.toml").write_text(registry_hosts_toml(n))
    (n.state / "certs.d" / "_default" / "hosts.toml").write_text(NO_OUTSIDE_REGISTRY)
    (n.cni_conf_dir / "10-kubetrain.conflist").write_text(cni_conflist(n))
    (n.state / "resolv.conf").write_text(pod_resolv_conf())
    (n.state / "kubelet.json").write_text(kubelet_config(n, resolv_conf=n.state / "resolv.conf"))
    (n.state / "Corefile").write_text(corefile(n, kubeconfig=admin_kubeconfig))
    (n.state / "registry.yml").write_text(registry_yaml(n, storage=registry_storage(n)))
    wrapper = n.wrapper_dir / "runc"
    if _lacks_cap_sys_resource():
        wrapper.write_text(runc_wrapper(shutil.which("runc") or "/usr/sbin/runc"))
        wrapper.chmod(0o755)
    else:
        wrapper.unlink(missing_ok=True)


def registry_storage(n: RealNodeLayout) -> Path:
    """Pushed images outlive the testbed (a cache, like the binaries)."""
    return n.bin_dir.parent / "registry-data"


# ------------------------------------------------------------------ processes
def components(n: RealNodeLayout, *, admin_kubeconfig: Path) -> list[Component]:
    b = lambda name: str(n.bin_dir / name)  # noqa: E731
    path = f"{n.wrapper_dir}{os.pathsep}{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
    return [
        Component(name="registry", wave=0, argv=[b("registry"), "serve", str(n.state / "registry.yml")],
                  health=Health(f"http://{n.registry}/v2/")),
        Component(name="containerd", wave=1, argv=[b("containerd"), "--config", str(n.state / "containerd.toml")],
                  env={"PATH": f"{n.bin_dir}{os.pathsep}{path}"},
                  health=Health(f"http://127.0.0.1:{n.containerd_metrics_port}/v1/metrics")),
        Component(name="kubelet", wave=2, argv=[
            b("kubelet"), f"--config={n.state / 'kubelet.json'}", f"--kubeconfig={admin_kubeconfig}",
            f"--hostname-override={n.node_name}", f"--node-ip={n.gateway}", f"--root-dir={n.kubelet_root}",
            "--node-labels=kubetrain.io/real-node=true", "--v=1"],
            health=Health(f"http://127.0.0.1:{n.kubelet_healthz_port}/healthz")),
        Component(name="coredns", wave=2, argv=[b("coredns"), "-conf", str(n.state / "Corefile")],
                  health=Health(f"http://127.0.0.1:{n.coredns_health_port}/health")),
    ]


def ensure_pause_image(n: RealNodeLayout, *, log_file: Path) -> None:
    """The sandbox image (no public registry is reachable): a static Go program, pushed once."""
    if _image_in_registry(n, "kubetrain/pause", "1"):
        return
    work = n.bin_dir.parent / "pause-src"
    work.mkdir(parents=True, exist_ok=True)
    (work / "main.go").write_text(PAUSE_GO)
    if not (work / "go.mod").exists():
        (work / "go.mod").write_text("module kubetrain.local/pause\n\ngo 1.22\n")
    env = {**os.environ, "CGO_ENABLED": "0"}
    with open(log_file, "ab") as log:
        subprocess.run(["go", "build", "-ldflags=-s -w", "-o", "pause", "."], cwd=work, env=env, check=True,
                       stdout=log, stderr=subprocess.STDOUT)
    b = buildah_argv(n)
    ctr = _run(*b, "from", "scratch").stdout.strip()
    try:
        _run(*b, "copy", ctr, str(work / "pause"), "/pause")
        _run(*b, "config", "--entrypoint", '["/pause"]', "--user", "65535:65535", ctr)
        _run(*b, "commit", "--rm", ctr, f"{n.pause_image}")
        ctr = ""
    finally:
        if ctr:
            _run(*b, "rm", ctr, check=False)
    _run(*b, "push", "--tls-verify=false", n.pause_image, f"docker://{n.pause_image}", timeout=300)


def buildah_argv(n: RealNodeLayout) -> list[str]:
    """buildah with its own storage in the cache (image layers survive `down`)."""
    store = n.bin_dir.parent / "buildah"
    return ["buildah", "--root", str(store / "root"), "--runroot", str(store / "runroot"),
            "--storage-driver", "overlay"]


def _image_in_registry(n: RealNodeLayout, repo: str, tag: str) -> bool:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://{n.registry}/v2/{repo}/manifests/{tag}", method="HEAD", headers={
        "Accept": "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


# ------------------------------------------------------------------ teardown
def remove_containers(n: RealNodeLayout) -> None:
    """Kill and delete every container of the node (kubelet already stopped, containerd still up)."""
    if not n.containerd_sock.exists():
        return
    ctr = [str(n.bin_dir / "ctr"), "--address", str(n.containerd_sock), "-n", "k8s.io"]
    tasks = _run(*ctr, "tasks", "ls", "-q", check=False, timeout=30).stdout.split()
    for t in tasks:
        _run(*ctr, "tasks", "kill", "-s", "SIGKILL", t, check=False, timeout=30)
    deadline = time.monotonic() + 20
    for t in tasks:
        while _run(*ctr, "tasks", "delete", t, check=False, timeout=30).returncode != 0:
            if time.monotonic() > deadline:
                break
            time.sleep(0.3)
    for c in _run(*ctr, "containers", "ls", "-q", check=False, timeout=30).stdout.split():
        _run(*ctr, "containers", "delete", c, check=False, timeout=30)


def unmount_under(*roots: Path) -> None:
    """Lazily unmount everything mounted below `roots` (volumes, shm, rootfs), deepest first."""
    prefixes = tuple(str(r.resolve()) + "/" for r in roots)
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if mp.startswith(prefixes):
            points.append(mp)
    for mp in sorted(set(points), key=len, reverse=True):
        _run("umount", "-l", mp, check=False)


def make_cgroups(n: RealNodeLayout) -> None:
    """The kubelet's cgroupRoot in every v1 hierarchy (cpuset children start with no CPUs: copy the parent's)."""
    base = Path("/sys/fs/cgroup")
    for hier in base.iterdir() if base.is_dir() else ():
        top = hier / n.cgroup_root.strip("/")
        if not hier.is_dir() or not (hier / "cgroup.procs").exists():
            continue
        top.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (hier / knob).exists():
                (top / knob).write_text((hier / knob).read_text())


def remove_cgroups(n: RealNodeLayout) -> None:
    """Kill what still runs in the node's cgroup subtree (containers outlive a dead containerd), then
    rmdir the subtree in every v1 hierarchy, leaves first."""
    base = Path("/sys/fs/cgroup")
    for _ in range(20):
        pids = {int(x) for hier in (base.iterdir() if base.is_dir() else ())
                for f in (hier / n.cgroup_root.strip("/")).rglob("cgroup.procs") if hier.is_dir()
                for x in _read(f).split()}
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        time.sleep(0.25)
    for hier in base.iterdir() if base.is_dir() else ():
        top = hier / n.cgroup_root.strip("/")
        if not top.is_dir():
            continue
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            try:
                d.rmdir()
            except OSError:
                pass
        try:
            top.rmdir()
        except OSError:
            pass


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def shim_pids(n: RealNodeLayout) -> list[int]:
    """containerd-shim-runc-v2 processes of this node (they outlive containerd by design)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and str(n.containerd_sock).encode() in b" ".join(argv):
            out.append(int(p.name))
    return out


def teardown(n: RealNodeLayout) -> None:
    """After the node's processes stopped: shims, containers, mounts, cgroups, network, host settings.

    Everything the node made lives under `n.state` (runc's root and the network namespaces included),
    its cgroup subtree, the bridge and its chains: nothing the host's own runtimes use is touched.
    """
    procs.stop(shim_pids(n), grace=5)
    remove_cgroups(n)
    unmount_under(n.state)
    network_down(n)
    restore_host_settings()
    for volatile in (n.containerd_state, n.kubelet_root, n.state / "pod-logs", n.state / "cni"):
        shutil.rmtree(volatile, ignore_errors=True)


def leftovers(n: RealNodeLayout) -> list[str]:
    """What the node left on the host after a teardown (empty when `down` was complete)."""
    out = []
    if Path(f"/sys/class/net/{n.bridge}").exists():
        out.append(f"bridge {n.bridge}")
    rules = _run("iptables-save", check=False).stdout
    out += [f"iptables chain {c}" for c in (NAT_CHAIN, FWD_CHAIN, IN_CHAIN) if c in rules]
    prefix = str(n.state.resolve()) + "/"
    out += [f"mount {line.split()[4]}" for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4].startswith(prefix)]
    base = Path("/sys/fs/cgroup")
    out += [f"cgroup {h / n.cgroup_root.strip('/')}" for h in (base.iterdir() if base.is_dir() else ())
            if (h / n.cgroup_root.strip("/")).exists()]
    out += [f"shim pid {p}" for p in shim_pids(n)]
    if HOST_SETTINGS_FILE.exists():
        out.append(f"host settings not restored ({HOST_SETTINGS_FILE})")
    return out


def wait_node_ready(kubectl: list[str], node: str, *, timeout: float, log_file: Path) -> None:
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run([*kubectl, "get", "node", node, "-o", "json"], capture_output=True, text=True,
                             timeout=30)
        if out.returncode == 0:
            conds = json.loads(out.stdout).get("status", {}).get("conditions", [])
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
                return
        if time.monotonic() > deadline:
            raise procs.ComponentFailed("kubelet", f"node {node} not Ready after {timeout:.0f} s", log_file)
        time.sleep(0.5)


def start(n: RealNodeLayout, *, admin_kubeconfig: Path, kubectl: list[str], api_port: int, minio_port: int,
          run_dir: Path, record, say) -> None:
    """Bring the node up; `record(list[Running])` stores each started process for `down` right away."""
    missing = missing_prerequisites()
    if missing:
        raise TestbedError("the real node needs: " + ", ".join(missing)
                           + " (Debian: apt-get install runc containernetworking-plugins buildah iptables iproute2)")
    t0 = time.monotonic()
    record([])
    teardown(n)  # leftovers of a killed run: shims, containers, mounts, cgroups, rules
    network_up(n, api_port=api_port, minio_port=minio_port)
    write_files(n, admin_kubeconfig=admin_kubeconfig)
    make_cgroups(n)
    comps = components(n, admin_kubeconfig=admin_kubeconfig)
    started: list[Running] = []
    with open(run_dir / "registry.log", "a") as log:  # blobs of builds pruned since the last start (prune.py)
        prune.garbage_collect(n.bin_dir / "registry", n.state / "registry.yml", log=log)
    for wave in (0, 1, 2):
        for c in (c for c in comps if c.wave == wave):
            started.append(procs.start(c, run_dir / f"{c.name}.log"))
            record(started)
        procs.wait_healthy([r for r in started if r.name in {c.name for c in comps if c.wave == wave}],
                           pki=None, timeout=120, log_dir=run_dir)
        if wave == 0:
            ensure_pause_image(n, log_file=run_dir / "registry.log")
    wait_node_ready(kubectl, n.node_name, timeout=120, log_file=run_dir / "kubelet.log")
    say(f"real node {n.node_name} Ready after {time.monotonic() - t0:.1f} s (pods on {n.bridge} {n.subnet})")
