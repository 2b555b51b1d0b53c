"""The cost of recovery, in parts: one graceful preemption of the demo job, taken apart, N times.

The demo job (examples/trainingjob.yaml: 2 nodes x 1 process, DDP, the tiny GPT, checkpoints to MinIO)
runs on the testbed while this script evicts one of its pods through the Eviction API (what a
preemption does: DisruptionTarget, SIGTERM, the pod's grace period), waits until the next attempt has
trained on, and does it again. Each recovery is split at times the system itself records:

    SIGTERM            the evicted pod's launcher logs "SIGTERM: asking workers for an emergency checkpoint"
    1 committed        rank 0's launcher logs "checkpoint-<N> committed" for the emergency step N
    1b last pod gone   the pod watch delivers the DELETED event of the attempt's last pod
    2 pods created     the watch delivers the ADDED event of the next attempt's last pod
    3 running          the watch delivers the next attempt's last pod with phase Running
    4 restored         the last launcher of the next attempt logs "restored checkpoint-<N>"
    5 first step       rank 0's trainer logs "step <N+1>:" (logging_steps 1); "resuming from" (the
                       worker process up, torch imported, the model built) splits it

Log lines carry their own time (milliseconds, UTC); watch times are when this process received the
event. Steps lost = the step the evicted attempt reached (its last logged step, or the step it stopped
after) minus the step the next attempt restored (goal 0). Goal (issue 12): SIGTERM -> first trained
step <= 10 s on the real node.

    flock /tmp/kt-suite.lock timeout 1500 python benchmarks/recovery.py --node agent [--preemptions 5]
    flock /tmp/kt-suite.lock timeout 1500 python benchmarks/recovery.py --node real

`--node agent` runs the pods on a test node agent (processes) and `--node real` on the real node
(kubelet + containerd, the trainer image built from trainer_image/Dockerfile, cached). The operator
runs as a local process watching only the run's namespace. The testbed is started if it is not
running, and then stopped again at the end (the real node likewise); whatever was already running stays.
Deviations from the demo job, for measuring: max_steps 100000 (deleted at the end), logging_steps 1,
no progress bar, maxPreemptions 50; on the real node 500m CPU requests (as docs/e2e.md's demo).
"""

from __future__ import annotations

import argparse
import calendar
import dataclasses
import json
import re
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "testbed"), str(ROOT / "benchmarks")]

from kubernetes import client, config  # noqa: E402

from chaos import AGENT_TAINT_KEY, GROUP, PLURAL, RUN_LABEL, VERSION, Agents, Operator, PodTimeline  # noqa: E402
from kubetrain_testbed import TestbedConfig, free_port, kubectl, load_env  # noqa: E402
from kubetrain_testbed import cluster  # noqa: E402
from kubetrain_testbed import state as testbed_state  # noqa: E402

REAL_NODE_LABEL = "kubetrain.io/real-node"
STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
RE = {
    "sigterm": re.compile(STAMP + r"kubetrain-launch WARNING SIGTERM"),
    "stopped": re.compile(STAMP + r"\[rank 0\] WARNING SIGTERM: stopped after step (\d+)"),
    "committed": re.compile(STAMP + r"kubetrain-launch INFO checkpoint-(\d+) committed"),
    "restored": re.compile(STAMP + r"kubetrain-launch INFO restored checkpoint-(\d+)"),
    "resuming": re.compile(STAMP + r"\[rank 0\] INFO resuming from \S*checkpoint-(\d+)"),
    "step": re.compile(STAMP + r"\[rank 0\] INFO step (\d+): \{'loss'"),
}
PARTS = [
    ("sigterm_to_committed", "1  SIGTERM -> emergency checkpoint committed"),
    ("committed_to_gone", "1b committed -> last pod gone (launcher exit, pod finalized)"),
    ("gone_to_created", "2  last pod gone -> new pods created"),
    ("created_to_running", "3  created -> containers running"),
    ("running_to_restored", "4  running -> checkpoint restored (launcher, all pods)"),
    ("restored_to_first_step", "5  restored -> first trained step"),
    ("  restored_to_resuming", "   of 5: restored -> worker up, resuming (imports, model)"),
    ("total", "   total SIGTERM -> first trained step"),
]


def stamp(text: str) -> float:
    """A log line's time (UTC, milliseconds) as epoch seconds."""
    base, ms = text.split(",")
    return calendar.timegm(time.strptime(base, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000


def find(name: str, text: str) -> list[tuple[float, int | None]]:
    out = []
    for line in re.split(r"[\r\n]", text):
        m = RE[name].search(line)
        if m:
            out.append((stamp(m.group(1)), int(m.group(2)) if m.lastindex and m.lastindex > 1 else None))
    return out


class Logs:
    """Each training pod's log text: the agent's per-pod file, or `kubectl logs -f` saved per pod."""

    def __init__(self, node: str, run_dir: Path, namespace: str, penv: dict, agent_dir: Path | None) -> None:
        self.node, self.run_dir, self.namespace, self.penv, self.agent_dir = node, run_dir, namespace, penv, agent_dir
        self.followers: dict[str, subprocess.Popen] = {}
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def follow(self, pod: str) -> None:
        """Real node: keep the log of a pod whose container runs (the kubelet forgets it with the pod)."""
        if self.node == "real" and pod not in self.followers:
            out = open(self.run_dir / "logs" / f"{pod}.log", "wb")
            self.followers[pod] = subprocess.Popen(["kubectl", "logs", "-f", "-n", self.namespace, pod],
                                                   env=self.penv, stdout=out, stderr=subprocess.DEVNULL)

    def text(self, pod: str) -> str:
        if self.node == "real":
            path = self.run_dir / "logs" / f"{pod}.log"
            return path.read_text(errors="replace") if path.exists() else ""
        files = sorted((self.agent_dir / "pods").glob(f"{self.namespace}_{pod}_*/trainer.log"))
        return files[-1].read_text(errors="replace") if files else ""

    def close(self) -> None:
        for p in self.followers.values():
            if p.poll() is None:
                p.terminate()
                p.wait(10)


def demo_job(name: str, *, node: str, bucket: str, endpoint: str, image: str | None, tag: str) -> dict:
    job = yaml.safe_load((ROOT / "examples" / "trainingjob.yaml").read_text())
    job["metadata"] = {"name": name}
    spec = job["spec"]
    spec["trainer"]["builtin"]["args"].update(max_steps=100_000, logging_steps=1, disable_tqdm=True)
    spec["checkpoint"] = {**spec["checkpoint"], "uri": f"s3://{bucket}/recovery-{tag}", "endpoint": endpoint}
    spec["runPolicy"] = {**spec.get("runPolicy", {}), "maxPreemptions": 50}
    if node == "agent":
        spec["masterPort"] = free_port()
        spec["podTemplate"] = {"nodeSelector": {RUN_LABEL: tag}, "tolerations": [
            {"key": AGENT_TAINT_KEY, "operator": "Equal", "value": "true", "effect": "NoSchedule"}]}
    else:
        spec["image"] = image
        spec["resources"] = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "3Gi"}}
        spec["podTemplate"] = {"nodeSelector": {REAL_NODE_LABEL: "true"}, "tolerations": [
            {"key": REAL_NODE_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"}]}
    return job


class Run:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.cfg = TestbedConfig.from_environ()
        self.started_testbed = self.added_real_node = False
        self.tag = secrets.token_hex(3)
        self.ns, self.job = f"recovery-{self.tag}", "demo"
        self.run_dir = Path(f"/tmp/kubetrain-recovery-{self.tag}")
        self.run_dir.mkdir(parents=True)
        self.offset = time.time() - time.monotonic()
        self.timeline = self.operator = self.agents = self.logs = None

    def say(self, msg: str) -> None:
        print(f"[recovery {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    # ------------------------------------------------------------ setup / teardown
    def setup(self) -> None:
        if not testbed_state.is_healthy(self.cfg):
            self.say("starting the testbed (stopped again at the end)")
            self.started_testbed = True
        if self.a.node == "real":
            state = testbed_state._read_state(self.cfg) or {}
            self.added_real_node = not (state.get("real_node") or {}).get("complete")
        if self.started_testbed or self.added_real_node:
            cluster.up(dataclasses.replace(self.cfg, real_node=self.a.node == "real"))
        self.env = load_env(self.cfg)
        self.penv = self.env.subprocess_env()
        api = config.new_client_from_config(config_file=self.env.kubeconfig)
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        image = None
        if self.a.node == "real":
            from kubetrain_testbed.images import build_all
            from kubetrain_testbed.realnode import real_node_bin_dir

            layout = cluster._real_node_layout(self.cfg, real_node_bin_dir(self.cfg.build_script))
            rows = build_all(layout, log_path=self.cfg.run_dir / "images.log", names=("trainer",))
            image = rows[0]["ref"]
            self.say(f"trainer image {image}")
        kubectl(self.env, "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "trainingjob.yaml"))
        self.core.create_namespace({"metadata": {"name": self.ns}})
        self.core.create_namespaced_secret(self.ns, {"metadata": {"name": "kubetrain-s3"}, "stringData": {
            "accessKeyId": self.env.access_key, "secretAccessKey": self.env.secret_key}})
        agent_dir = None
        if self.a.node == "agent":
            self.agents = Agents(self.penv, self.env.kubeconfig, self.core, self.run_dir, self.tag, 3)
            self.agents.start(f"recovery-{self.tag}")
            agent_dir = self.agents.state_dir(f"recovery-{self.tag}")
        self.logs = Logs(self.a.node, self.run_dir, self.ns, self.penv, agent_dir)
        self.timeline = PodTimeline(self.core, self.ns)
        self.operator = Operator(self.penv, self.ns, self.run_dir / "operator.log")
        self.operator.start()
        if self.operator.wait_healthy(120) is None:
            raise RuntimeError(f"the operator did not become healthy; see {self.operator.log_path}")
        endpoint = self.env.s3_endpoint if self.a.node == "agent" else self.env.pod_s3_endpoint
        body = demo_job(self.job, node=self.a.node, bucket=self.env.bucket, endpoint=endpoint, image=image,
                        tag=self.tag)
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)
        self.say(f"namespace {self.ns}: demo job created; logs in {self.run_dir}")

    def teardown(self) -> None:
        try:
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.job)
        except Exception:  # noqa: BLE001
            pass
        if self.operator:
            self.operator.stop()
        try:
            self.core.delete_collection_namespaced_pod(self.ns, grace_period_seconds=0)
        except Exception:  # noqa: BLE001
            pass
        if self.logs:
            self.logs.close()
        if self.agents:
            for name in list(self.agents.procs):
                self.agents.stop(name)
                try:
                    self.core.delete_node(name)
                except client.ApiException:
                    pass
        if self.timeline:
            self.timeline.stop.set()
        try:
            import boto3

            s3 = boto3.client("s3", endpoint_url=self.env.s3_endpoint, aws_access_key_id=self.env.access_key,
                              aws_secret_access_key=self.env.secret_key, region_name=self.env.region)
            keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.env.bucket, Prefix=f"recovery-{self.tag}/") for o in page.get("Contents", [])]
            for i in range(0, len(keys), 1000):
                s3.delete_objects(Bucket=self.env.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})
            self.core.delete_namespace(self.ns)
        except Exception as exc:  # noqa: BLE001
            self.say(f"clean-up: {exc!r}")
        for p in self.run_dir.glob("agents/*/pods/*/checkpoints"):
            subprocess.run(["rm", "-rf", str(p)], check=False)
        if self.added_real_node and not self.started_testbed:
            self.say("removing the real node this run added")
            cluster.remove_real_node(self.cfg)
        if self.started_testbed:
            self.say("stopping the testbed this run started")
            cluster.down(self.cfg)

    # ------------------------------------------------------------ the run
    def pods(self, attempt: int) -> list:
        return [e for e in self.timeline.live() if e.job == self.job and e.attempt == attempt]

    def wait_training(self, attempt: int, after_steps: int, timeout: float) -> None:
        """Until rank 0 of `attempt` has logged a step `after_steps` past its first (its logs kept meanwhile)."""
        deadline = time.monotonic() + timeout
        first = None
        while time.monotonic() < deadline:
            for ev in self.pods(attempt):
                if ev.phase == "Running":
                    self.logs.follow(ev.name)
            steps = find("step", self.logs.text(f"{self.job}-a{attempt}-n0"))
            if steps:
                first = first if first is not None else steps[0][1]
                if steps[-1][1] >= first + after_steps:
                    return
            st = (self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.job)
                  .get("status") or {})
            if st.get("phase") in ("Failed", "Succeeded"):
                raise RuntimeError(f"the job ended: {st}")
            time.sleep(0.5)
        raise RuntimeError(f"attempt {attempt} did not train {after_steps} steps in {timeout:.0f} s; see {self.run_dir}")

    def run(self) -> list[dict]:
        rows = []
        self.wait_training(1, self.a.steps_between, 600)
        for k in range(self.a.preemptions):
            attempt = k + 1
            victim = f"{self.job}-a{attempt}-n{k % 2}"
            self.say(f"preemption {k + 1}/{self.a.preemptions}: evicting {victim}")
            self.core.create_namespaced_pod_eviction(victim, self.ns, client.V1Eviction(
                metadata=client.V1ObjectMeta(name=victim, namespace=self.ns)))
            t_evict = time.time()
            self.wait_training(attempt + 1, self.a.steps_between, 600)
            rows.append(self.measure(attempt, t_evict))
            self.say(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}))
        return rows

    def measure(self, attempt: int, t_evict: float) -> dict:
        old = [f"{self.job}-a{attempt}-n{r}" for r in range(2)]
        new = [f"{self.job}-a{attempt + 1}-n{r}" for r in range(2)]
        old_text = {p: self.logs.text(p) for p in old}
        new_text = {p: self.logs.text(p) for p in new}
        sigterm = min(t for p in old for t, _ in find("sigterm", old_text[p]))
        stopped = find("stopped", old_text[old[0]])
        stopped_step = stopped[-1][1] if stopped else None
        reached = max([s for _, s in find("step", old_text[old[0]])] + [stopped_step or 0])
        restored = [find("restored", new_text[p]) for p in new]
        restored_step = restored[0][-1][1]
        commit = [t for t, s in find("committed", old_text[old[0]]) if s == restored_step and t >= sigterm]
        events = self.timeline.snapshot()

        def watch(names: list[str], pred) -> float:
            """When the watch delivered the last of `names` in the state `pred` (first time for each)."""
            firsts = [min(e.t for e in events if e.name == n and pred(e)) for n in names]
            return max(firsts) + self.offset

        gone = watch(old, lambda e: e.type == "DELETED")
        created = watch(new, lambda e: e.type == "ADDED")
        running = watch(new, lambda e: e.phase == "Running")
        t_restored = max(r[-1][0] for r in restored)
        resuming = find("resuming", new_text[new[0]])
        first = [t for t, s in find("step", new_text[new[0]]) if s == restored_step + 1]
        committed = commit[0] if commit else float("nan")
        return {
            "attempt": attempt, "evict_to_sigterm": sigterm - t_evict,
            "sigterm_to_committed": committed - sigterm, "committed_to_gone": gone - committed,
            "gone_to_created": created - gone, "created_to_running": running - created,
            "running_to_restored": t_restored - running, "restored_to_first_step": first[0] - t_restored,
            "  restored_to_resuming": resuming[-1][0] - t_restored, "total": first[0] - sigterm,
            "stopped_step": stopped_step, "reached_step": reached, "restored_step": restored_step,
            "steps_lost": reached - restored_step, "emergency_committed": bool(commit),
        }


def report(rows: list[dict], node: str) -> None:
    print(f"\n{node}: {len(rows)} graceful preemptions (Eviction API), seconds")
    print(f"{'part':62s} {'median':>7s} {'max':>7s}")
    for key, label in PARTS:
        vals = [r[key] for r in rows]
        print(f"{label:62s} {statistics.median(vals):7.2f} {max(vals):7.2f}")
    lost = [r["steps_lost"] for r in rows]
    print(f"{'steps lost per preemption (goal 0)':62s} {statistics.median(lost):7.0f} {max(lost):7.0f}")
    print(f"emergency checkpoint committed before the pod went: {sum(r['emergency_committed'] for r in rows)}"
          f"/{len(rows)}; goal: total <= 10 s on the real node")
    print(json.dumps(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--node", choices=("agent", "real"), default="agent")
    p.add_argument("--preemptions", type=int, default=5)
    p.add_argument("--steps-between", type=int, default=20,
                   help="steps each attempt trains (past its first) before the next eviction")
    a = p.parse_args()
    run = Run(a)
    try:
        run.setup()
        rows = run.run()
    finally:
        run.teardown()
    report(rows, a.node)


if __name__ == "__main__":
    main()
