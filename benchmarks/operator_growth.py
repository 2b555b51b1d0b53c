"""How the operator's CPU seconds and peak RSS grow with the number of TrainingJobs (issue 12, item 5).

Not a test: it prints figures and ratios. On the testbed (started, and stopped again at the end, when
it is not running; hold the suite lock), in a fresh namespace on a private pool of kwok nodes, for each N of --jobs (default 50, 200, 800; --nodes 4 pods
each), with a fresh operator process per N:

1. launch: N TrainingJobs applied at once (--threads clients) -> every pod Running and every job's
   status.phase Running;
2. touch: --touches rounds of one metadata change per TrainingJob (an annotation): one job event each
   per round, through kopf;
3. idle: --idle seconds with N jobs running and nothing happening (no per-job timer may tick);
4. finish: every pod annotated with the testbed's exit code 0, so kwok moves it to Succeeded (a pod
   phase change each, through the pod informer) -> every job Succeeded;
5. delete: the TrainingJobs deleted -> the garbage collector deletes the pods -> all gone.

After each phase the benchmark waits until the operator is quiet (under 3 % of a core for two 1 s
windows in a row). Per phase it reads the operator's CPU seconds (utime + stime of /proc/<pid>/stat),
the watch events of the namespace's pods and TrainingJobs (what the operator's watches receive) and the
operator's API writes (its /metrics); at the end the process's peak RSS (VmHWM of /proc/<pid>/status).
It prints CPU ms per job and µs per event per phase and N, and the growth ratios 200/50 and 800/200
normalised by N (1.00 = linear; above 1 = each job costs more when there are more jobs).
A canary process runs the same piece of Python work ten times a second throughout (`Canary`); its CPU per
run in each phase's seconds shows how much slower the machine itself ran then, and the per-event growth is
also printed divided by the canary's.

The operator runs with KUBETRAIN_RESYNC_SECONDS=3600 and progress reads off: the periodic resync
re-plans every job once a minute by design (one reconcile per job, what the touch phase measures), and
with it on, a phase that lasts longer at a larger N would also hold more resyncs per job, which is the
control plane's slowness, not the operator's growth. Everything it creates is deleted at the end.

    flock /tmp/kt-suite.lock timeout 1500 python benchmarks/operator_growth.py --jobs 50,200,800
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "testbed"), str(ROOT / "benchmarks")]

from kubernetes import client, config  # noqa: E402

from kubetrain import builders  # noqa: E402
from kubetrain.api import Job  # noqa: E402
from kubetrain_testbed import EXIT_CODE_ANNOTATION, TestbedConfig, free_port, is_healthy, kubectl, load_env  # noqa: E402
from kubetrain_testbed import cluster  # noqa: E402
from operator_scale import (  # noqa: E402
    GROUP, PLURAL, VERSION, job_spec, make_nodes, remove_bench_objects, scrape_operator,
)

TOUCH = "bench.kubetrain.io/touch"
PHASES = ("launch", "touch", "idle", "finish", "delete")
MERGE_PATCH = "application/merge-patch+json"


class Stream:
    """A raw watch of one list endpoint: events counted, and a small record per object (or None once
    deleted). Raw JSON lines, no client models: this process shares the 2 cores with the operator."""

    def __init__(self, lister: Callable[..., Any], record: Callable[[dict], Any]) -> None:
        self.lister, self.record = lister, record
        self.objs: dict[str, Any] = {}
        self.events = 0
        self.stop = threading.Event()
        resp = lister(_preload_content=False)
        try:
            rv = json.loads(resp.data)["metadata"]["resourceVersion"]
        finally:
            resp.release_conn()
        threading.Thread(target=self._run, args=(rv,), daemon=True).start()

    def _run(self, rv: str) -> None:
        while not self.stop.is_set():
            try:
                resp = self.lister(watch=True, resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=30,
                                   _preload_content=False)
                try:
                    for line in resp:
                        ev = json.loads(line)
                        obj = ev["object"]
                        if ev["type"] == "ERROR":  # 410 Gone: the counts stay exact only without one
                            print(f"  watch error: {obj.get('message')}", flush=True)
                            rv = json.loads(self.lister(_preload_content=False).data)["metadata"]["resourceVersion"]
                            break
                        rv = obj["metadata"]["resourceVersion"]
                        if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                            self.events += 1
                            name = obj["metadata"]["name"]
                            self.objs[name] = None if ev["type"] == "DELETED" else self.record(obj)
                        if self.stop.is_set():
                            return
                finally:
                    resp.release_conn()
            except Exception:  # noqa: BLE001  (resume the watch)
                time.sleep(0.2)

    def count(self, pred: Callable[[Any], bool]) -> int:
        return sum(1 for v in list(self.objs.values()) if pred(v))


class Proc:
    """CPU seconds and memory of one process, from /proc."""

    TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def cpu(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self.TICK  # utime, stime

    def mem_mib(self, key: str) -> float:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def quiet(self, timeout: float = 120.0) -> float:
        """Wait until two 1 s windows in a row each use under 3 % of a core; returns the seconds waited."""
        start, calm = time.monotonic(), 0
        while time.monotonic() - start < timeout and calm < 2:
            before = self.cpu()
            time.sleep(1.0)
            calm = calm + 1 if self.cpu() - before < 0.03 else 0
        return time.monotonic() - start


CANARY = r"""
import sys, time, orjson
doc = sys.stdin.buffer.read()
def unit():
    for _ in range(40):  # a pod event's work, roughly: parse, read the fields a view keeps, build a tuple
        pod = orjson.loads(doc)
        meta, spec = pod["metadata"], pod["spec"]
        env = {e["name"]: e.get("value") for c in spec["containers"] for e in c.get("env", ())}
        sorted((meta.get("labels") or {}).items()), tuple(env), meta.get("name")
for _ in range(20):
    unit()
while True:
    t0 = time.thread_time()
    unit()
    print(time.monotonic(), (time.thread_time() - t0) * 1e6, flush=True)
    time.sleep(0.1)
"""


class Canary:
    """A fixed piece of Python work (parsing a pod and reading it, as the operator does per pod event), run
    10 times a second in a process of its own: its CPU µs per run, taken in the seconds a phase's CPU figure
    covers (the phase and its settling), says how much slower the machine runs the same code then (a busier
    control plane, the other vCPU's load, colder caches), with the operator's code unchanged. The growth
    ratios are also printed divided by it."""

    def __init__(self, pod: dict) -> None:
        self.samples: list[tuple[float, float]] = []
        self.proc = subprocess.Popen([sys.executable, "-c", CANARY], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.proc.stdin.write(json.dumps(pod))
        self.proc.stdin.close()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            t, us = line.split()
            self.samples.append((float(t), float(us)))

    def median_us(self, start: float, end: float) -> float:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the canary process exited ({self.proc.returncode})")
        got = sorted(us for t, us in self.samples if start <= t <= end)  # CLOCK_MONOTONIC: one clock for all
        return got[len(got) // 2] if got else float("nan")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def wait_for(what: str, cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.5)
    print(f"  TIMEOUT after {timeout:.0f}s waiting for {what}", flush=True)
    return False


def loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def run_n(env: Any, core: client.CoreV1Api, custom: client.CustomObjectsApi, namespace: str, pool: str, n: int,
          args: argparse.Namespace, log_path: str, canary: Canary) -> dict:
    """One N: a fresh operator, the five phases, then everything of this N deleted."""
    prefix, nodes = f"g{n}", args.nodes
    pod_names = {f"{prefix}-{j}-a1-n{r}" for j in range(n) for r in range(nodes)}
    job_names = {f"{prefix}-{j}" for j in range(n)}
    pods = Stream(lambda **kw: core.list_namespaced_pod(namespace, **kw), lambda o: o.get("status", {}).get("phase"))
    jobs = Stream(lambda **kw: custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, **kw),
                  lambda o: ((o.get("status") or {}).get("phase"), (o["metadata"].get("annotations") or {}).get(TOUCH)))
    port, metrics_port = free_port(), free_port()
    op_env = {**env.subprocess_env(), "KUBETRAIN_NAMESPACES": namespace, "KUBETRAIN_LOG_LEVEL": "WARNING",
              "KUBETRAIN_API_THREADS": str(args.threads), "KUBETRAIN_METRICS_PORT": str(metrics_port),
              "KUBETRAIN_PROGRESS_INTERVAL_SECONDS": "0", "KUBETRAIN_RESYNC_SECONDS": "3600",
              "PYTHONPATH": str(ROOT / "operator") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log_path, "ab") as log:
        op = subprocess.Popen([sys.executable, "-m", "kubetrain", "operator", "run",
                               f"--liveness=http://127.0.0.1:{port}/healthz"], env=op_env, stdout=log,
                              stderr=subprocess.STDOUT)
    proc = Proc(op.pid)
    out: dict[str, Any] = {"n": n, "pods": len(pod_names), "phases": {}, "ok": True, "load": [loadavg()]}
    pool_ = concurrent.futures.ThreadPoolExecutor(args.threads)
    try:
        wait_for("the operator's liveness endpoint", lambda: _up(port), 60)
        proc.quiet()
        out["rss_start_mib"] = proc.mem_mib("VmRSS")

        def phase(name: str, act: Callable[[], None], done: Callable[[], bool], timeout: float) -> None:
            cpu0, ev0, wr0, t0 = proc.cpu(), pods.events + jobs.events, scrape_operator(metrics_port), time.monotonic()
            act()
            ok = wait_for(f"{name} of {n} jobs", done, timeout)
            wall = time.monotonic() - t0
            settle = proc.quiet()
            canary_us = canary.median_us(t0, time.monotonic())  # the seconds the CPU figure covers
            wr1 = scrape_operator(metrics_port)
            rec = {"cpu_s": proc.cpu() - cpu0, "events": pods.events + jobs.events - ev0, "wall_s": wall,
                   "settle_s": settle, "writes": wr1.get("writes", 0) - wr0.get("writes", 0),
                   "rss_mib": proc.mem_mib("VmRSS"), "ok": ok, "canary_us": canary_us}
            out["phases"][name] = rec
            out["ok"] = out["ok"] and ok
            print(f"  N={n} {name:<6} {rec['cpu_s']:7.2f} s CPU  {rec['events']:6d} events  "
                  f"{rec['writes']:6.0f} writes  {wall:6.1f} s (+{settle:.0f} s to quiet)  RSS {rec['rss_mib']:.0f} MiB  "
                  f"load {loadavg()}  canary {rec['canary_us']:.0f} µs", flush=True)

        def apply() -> None:
            list(pool_.map(lambda name: custom.create_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob",
                                                   "metadata": {"name": name}, "spec": job_spec(nodes, pool)},
                _preload_content=False), sorted(job_names)))

        def touch() -> None:
            for k in range(1, args.touches + 1):
                list(pool_.map(lambda name: custom.patch_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, name, {"metadata": {"annotations": {TOUCH: str(k)}}},
                    _content_type=MERGE_PATCH, _preload_content=False), sorted(job_names)))

        def finish() -> None:
            list(pool_.map(lambda name: core.patch_namespaced_pod(
                name, namespace, {"metadata": {"annotations": {EXIT_CODE_ANNOTATION: "0"}}},
                _preload_content=False), sorted(pod_names)))

        def delete() -> None:
            custom.delete_collection_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)

        def jobs_in(phase_: str) -> Callable[[], bool]:
            return lambda: all((jobs.objs.get(j) or (None,))[0] == phase_ for j in job_names)

        limit = 120 + n * nodes * 0.25
        phase("launch", apply, lambda: all(pods.objs.get(p) == "Running" for p in pod_names)
              and jobs_in("Running")(), limit)
        phase("touch", touch, lambda: all((jobs.objs.get(j) or (None, None))[1] == str(args.touches)
                                          for j in job_names), limit)
        phase("idle", lambda: time.sleep(args.idle), lambda: True, 1)
        phase("finish", finish, jobs_in("Succeeded"), limit)
        phase("delete", delete, lambda: not any(pods.objs.get(p) for p in pod_names)
              and not any(jobs.objs.get(j) for j in job_names), limit)
        out["hwm_mib"] = proc.mem_mib("VmHWM")
        out["load"].append(loadavg())
        return out
    finally:
        pool_.shutdown(wait=False)
        op.terminate()
        try:
            op.wait(20)
        except subprocess.TimeoutExpired:
            op.kill()
        pods.stop.set()
        jobs.stop.set()
        custom.delete_collection_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
        deadline = time.monotonic() + 300
        while (core.list_namespaced_pod(namespace, label_selector="kubetrain.io/job-name", limit=1).items
               and time.monotonic() < deadline):
            time.sleep(1)


def _up(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).read()
        return True
    except OSError:
        return False


def per(res: dict, phase: str | None, *, by: str) -> float:
    """CPU seconds of one phase (None: all) per job ("job") or per event ("event")."""
    chosen = [res["phases"][p] for p in ([phase] if phase else PHASES) if p in res["phases"]]
    cpu = sum(p["cpu_s"] for p in chosen)
    if by == "job":
        return cpu / res["n"]
    events = sum(p["events"] for p in chosen)
    return cpu / events if events else float("nan")


def report(results: list[dict], args: argparse.Namespace) -> None:
    print(f"\n=== operator growth: {args.nodes} pods per job, {args.fake_nodes} kwok nodes, "
          f"resync off, progress reads off ===")
    print("CPU ms per job, by phase (events per job in brackets):")
    print(f"{'N':>5} " + " ".join(f"{p:>15}" for p in PHASES) + f" {'total':>9}  peak RSS (VmHWM)  start RSS")
    for r in results:
        cells = [f"{per(r, p, by='job') * 1000:7.2f} ({r['phases'][p]['events'] / r['n']:5.1f})"
                 if p in r["phases"] else f"{'-':>15}" for p in PHASES]
        print(f"{r['n']:>5} " + " ".join(cells) + f" {per(r, None, by='job') * 1000:9.2f}  "
              f"{r.get('hwm_mib', float('nan')):7.0f} MiB      {r.get('rss_start_mib', float('nan')):5.0f} MiB")
    print("CPU µs per event, by phase:")
    for r in results:
        cells = [f"{per(r, p, by='event') * 1e6:15.0f}" if p in r["phases"] and p != "idle" else f"{'-':>15}"
                 for p in PHASES]
        print(f"{r['n']:>5} " + " ".join(cells) + f" {per(r, None, by='event') * 1e6:9.0f}")
    print("growth, normalised by N (CPU per job, CPU per event; 1.00 = linear):")
    for small, big in zip(results, results[1:]):
        job_r = {p: per(big, p, by="job") / per(small, p, by="job") for p in PHASES if p != "idle"}
        ev_r = {p: per(big, p, by="event") / per(small, p, by="event") for p in PHASES if p != "idle"}
        tot_j, tot_e = per(big, None, by="job") / per(small, None, by="job"), \
            per(big, None, by="event") / per(small, None, by="event")
        nan = float("nan")
        hwm_b, hwm_s = big.get("hwm_mib", nan), small.get("hwm_mib", nan)
        rss = (hwm_b - big.get("rss_start_mib", nan)) / big["n"] / ((hwm_s - small.get("rss_start_mib", nan)) / small["n"])
        print(f"  {big['n']}/{small['n']}: per job total {tot_j:.2f} ("
              + ", ".join(f"{p} {v:.2f}" for p, v in job_r.items()) + f"); per event total {tot_e:.2f} ("
              + ", ".join(f"{p} {v:.2f}" for p, v in ev_r.items()) + f"); peak RSS {hwm_b / hwm_s:.2f}x "
              f"for {big['n'] / small['n']:.0f}x the jobs, RSS above start per job {rss:.2f}")
    print("the canary (the same Python work each time, in the same seconds): median CPU µs per run, by phase:")
    for r in results:
        print(f"{r['n']:>5} " + " ".join(f"{r['phases'][p]['canary_us']:15.0f}" if p in r["phases"] else f"{'-':>15}"
                                         for p in PHASES))
    print("growth per event divided by the canary's (how much more the operator's code costs per event at the "
          "larger N, net of how much slower the machine ran the same code then; 1.00 = linear):")
    for small, big in zip(results, results[1:]):
        net = {}
        for p in PHASES:
            if p == "idle" or p not in big["phases"] or p not in small["phases"]:
                continue
            slow = big["phases"][p]["canary_us"] / small["phases"][p]["canary_us"]
            net[p] = (per(big, p, by="event") / per(small, p, by="event")) / slow
        print(f"  {big['n']}/{small['n']}: " + ", ".join(f"{p} {v:.2f}" for p, v in net.items()))
    for r in results:
        print(f"  N={r['n']}: all phases completed: {r['ok']}; writes per job "
              + ", ".join(f"{p} {r['phases'][p]['writes'] / r['n']:.1f}" for p in PHASES if p in r["phases"])
              + f"; load average {' -> '.join(r['load'])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", default="50,200,800", help="comma-separated numbers of TrainingJobs")
    ap.add_argument("--nodes", type=int, default=4, help="nodes (pods) per job")
    ap.add_argument("--fake-nodes", type=int, default=8, help="private kwok nodes to schedule onto")
    ap.add_argument("--threads", type=int, default=32, help="API threads of the operator and of this client")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of the idle phase")
    ap.add_argument("--touches", type=int, default=3, help="metadata changes per TrainingJob in the touch phase")
    ap.add_argument("--keep", action="store_true", help="leave the namespace and nodes behind")
    args = ap.parse_args()
    sizes = [int(x) for x in args.jobs.split(",")]

    cfg = TestbedConfig.from_environ()
    started = not is_healthy(cfg)
    if started:
        print("starting the testbed (stopped again at the end)", flush=True)
        cluster.up(cfg)
    try:
        return measure(load_env(cfg), sizes, args)
    finally:
        if started:
            cluster.down(cfg)


def measure(env: Any, sizes: list[int], args: argparse.Namespace) -> int:
    api = config.new_client_from_config(config_file=env.kubeconfig)
    api.configuration.connection_pool_maxsize = args.threads + 4
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    tag = secrets.token_hex(3)
    namespace = pool = f"growth-{tag}"
    kubectl(env, "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "trainingjob.yaml"))
    core.create_namespace({"metadata": {"name": namespace}})
    per_node = max(sizes) * args.nodes // args.fake_nodes + 20
    node_names = [f"{pool}-{i}" for i in range(args.fake_nodes)]
    results: list[dict] = []
    log_path = f"/tmp/operator-growth-{tag}.log"
    print(f"namespace {namespace}, {args.fake_nodes} kwok nodes of {per_node} pods each; operator log {log_path}; "
          f"load average {loadavg()}", flush=True)
    canary: Canary | None = None
    try:
        canary = Canary(builders.get_pod(job=Job.from_storage(
            {"metadata": {"name": "canary", "namespace": namespace, "uid": ""}, "spec": job_spec(args.nodes, pool)}),
            attempt=1, rank=0))
        make_nodes(env, node_names, pool=pool, per_node=per_node)
        wait_for("the namespace's ServiceAccount", lambda: bool(core.list_namespaced_service_account(namespace).items), 60)
        time.sleep(3)  # let kwok mark the new nodes Ready
        for n in sizes:
            print(f"N={n}: {n} TrainingJobs x {args.nodes} pods ...", flush=True)
            results.append(run_n(env, core, custom, namespace, pool, n, args, log_path, canary))
        report(results, args)
        return 0 if all(r["ok"] for r in results) else 1
    finally:
        if canary is not None:
            canary.stop()
        if not args.keep:
            remove_bench_objects(core, namespace, node_names)


if __name__ == "__main__":
    sys.exit(main())
