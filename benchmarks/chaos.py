"""Chaos: many real training jobs on the testbed while random faults hit them, and what survived.

Not a test: a bounded run that prints a table and writes a JSON report. It
exists because each fault kubetrain claims to survive is proven by its own
test, one at a time, on a quiet cluster; real clusters mix them. Here N
TrainingJobs (real trainer processes on test node agents, checkpoints to
MinIO) run while a seeded RNG injects faults drawn from:

    preemption        a higher-priority pod that does not fit: kube-scheduler evicts a victim
    eviction          the Eviction API on a random training pod
    node-deletion     an agent's Node object deleted (its processes run on until their pods
                      are gone); then the agent is replaced by a fresh one of the same name
    operator-kill     SIGKILL of the operator, restarted 1-5 s later
    trainer-kill      kill -9 of a pod's launcher while one of its checkpoints is being uploaded
                      (some of its files in S3, its manifest not yet)
    minio-restart     MinIO stopped (SIGTERM) and started again
    s3-outage         MinIO killed, started again --outage-seconds later
    job-recreate      a running TrainingJob deleted and created again under the same name

What it measures (each "must be 0" is a promise of docs/contract.md or the design):

- jobs finished / total, and whether each finished one has its final model;
- restores of incomplete or mismatched checkpoints (must be 0): every "restored
  checkpoint-N (attempt A)" line of a trainer log is checked at once against the
  restored folder (every file's digest against the manifest it restored, every
  file a checkpoint of that world size needs, trainer_state.json at step N) and
  against the manifest an S3 auditor saw and verified in MinIO;
- overlapping attempts (must be 0): in the pod watch stream, a pod of attempt N+1
  ADDED while a pod of attempt <= N of the same job was not yet DELETED; also
  sampled from /proc (trainer processes of two attempts alive at once);
- duplicate pods (must be 0): a second pod for the same job, attempt and node rank;
- steps lost per fault kind: the step an attempt reached minus the step the next
  one resumed from, charged to the fault that ended the attempt;
- the operator's SIGKILL restarts survived.

Run it on a running testbed (`scripts/testbed.sh up`), holding the suite lock
when the machine is shared:

    flock /tmp/kt-suite.lock python benchmarks/chaos.py --jobs 20 --faults 60 --seed 1
    python benchmarks/chaos.py --jobs 4 --faults 10 --outage-seconds 15 --duration 600   # a quick run

It stops by itself at --duration, and on the way out deletes its namespace, its
PriorityClass, its S3 prefix, its agents' nodes and every process it started.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "testbed")]

from kubernetes import client, config  # noqa: E402

from kubetrain_testbed import TestbedConfig, free_port, kubectl, load_env  # noqa: E402
from kubetrain_testbed.restart import start_component, stop_component  # noqa: E402

GROUP, VERSION, PLURAL = "kubetrain.io", "v1alpha1", "trainingjobs"
AGENT_TAINT_KEY = "kubetrain.io/agent"
MARKER_ENV = "KUBETRAIN_AGENT_NODE"
RUN_LABEL = "kubetrain-chaos/run"

KINDS = ("preemption", "eviction", "node-deletion", "operator-kill", "trainer-kill", "minio-restart",
         "s3-outage", "job-recreate")
WEIGHTS = {"preemption": 2.0, "eviction": 2.0, "node-deletion": 1.0, "operator-kill": 1.5, "trainer-kill": 2.0,
           "minio-restart": 1.0, "s3-outage": 0.5, "job-recreate": 1.0}
"""Relative frequency after the first len(KINDS) faults (which are one of each kind, shuffled)."""
GLOBAL_KINDS = ("operator-kill", "minio-restart", "s3-outage")
"""Faults that hit no job in particular: a restart they cause is charged to them by time window."""


def now() -> float:
    return time.monotonic()


# --------------------------------------------------------------------------- objects


def job_spec(*, nodes: int, master_port: int, args: argparse.Namespace, bucket: str, prefix: str,
             endpoint: str, tag: str, seed: int) -> dict:
    """A small causal-LM job on the run's agent nodes, checkpointing to MinIO.

    The model is the built-in tiny GPT with a 4096-token vocabulary: cheap steps (short sequences, batch
    2) but checkpoints of about 7 MB, so that an upload lasts long enough for a kill to land inside it."""
    return {
        "image": "kubetrain/trainer:chaos", "nodes": nodes, "procsPerNode": 1, "masterPort": master_port,
        "resources": {"requests": {"cpu": "1", "memory": "256Mi"}},
        "trainer": {"builtin": {"task": "causal-lm", "args": {
            "max_steps": args.max_steps, "save_steps": args.save_steps, "save_total_limit": 2,
            "logging_steps": 1, "per_device_train_batch_size": 2, "seq_len": 16, "vocab_size": 4096,
            "learning_rate": 0.001, "seed": seed, "disable_tqdm": True, "report_to": ["none"]}}},
        "checkpoint": {"uri": f"s3://{bucket}/{prefix}", "endpoint": endpoint,
                       "credentialsSecret": {"name": "kubetrain-s3"}},
        # kill -9 without a disruption is an application failure by contract: leave room for several.
        "runPolicy": {"backoffLimit": 20, "backoffSeconds": 2, "maxPreemptions": 200},
        "podTemplate": {"nodeSelector": {RUN_LABEL: tag},
                        "tolerations": [{"key": AGENT_TAINT_KEY, "operator": "Equal", "value": "true",
                                         "effect": "NoSchedule"}]},
    }


def preemptor_pod(*, name: str, node: str, cpu: int, priority_class: str, seconds: int) -> dict:
    """A pod that only fits on `node` once `cpu` cores are free there: kube-scheduler preempts for it."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"kubetrain-chaos/preemptor": "1"}},
            "spec": {"priorityClassName": priority_class, "restartPolicy": "Never",
                     "terminationGracePeriodSeconds": 1,
                     "nodeSelector": {"kubernetes.io/hostname": node},
                     "tolerations": [{"key": AGENT_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
                     "containers": [{"name": "main", "image": "kubetrain.invalid/ignored:0",
                                     "command": ["sleep", str(seconds)],
                                     "resources": {"requests": {"cpu": str(cpu), "memory": "16Mi"}}}]}}


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class PodEvent:
    """One pod watch event, reduced to what the analysis reads."""

    t: float
    type: str
    name: str
    uid: str
    job: str | None
    owner: str | None
    """uid of the owning TrainingJob: one job incarnation."""
    attempt: int
    rank: int
    phase: str
    node: str
    deleting: bool
    disruption: str | None
    exit_codes: tuple[int, ...]


@dataclass
class Fault:
    """One injected fault; `targets` are (job, incarnation uid, attempt) it hit (filled in for preemption)."""

    id: int
    kind: str
    t: float
    targets: list[tuple[str, str, int]] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)
    end: float | None = None
    """When a global fault was over (MinIO back, operator healthy)."""


@dataclass
class PodLog:
    """What one pod's trainer log said (launcher and workers share it)."""

    pod: str
    uid8: str
    restored: tuple[int, int] | None = None
    """(step, attempt that wrote it) of the restored checkpoint."""
    scratch: bool = False
    max_step: int = 0
    committed: list[int] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    not_committed: list[str] = field(default_factory=list)
    exit_code: int | None = None


@dataclass(frozen=True)
class RestoreCheck:
    job: str
    pod: str
    step: int
    manifest_attempt: int
    verdict: str
    """ok | incomplete | mismatched | unverified."""
    detail: str


# --------------------------------------------------------------------------- observers


class PodTimeline:
    """The namespace's pod watch stream in delivery order, and the latest state of every pod."""

    def __init__(self, core: client.CoreV1Api, namespace: str) -> None:
        self.core, self.namespace = core, namespace
        self.events: list[PodEvent] = []
        self.latest: dict[str, PodEvent] = {}
        self.owner_of: dict[str, tuple[str, int]] = {}
        """pod uid8 -> (job incarnation uid, attempt): how the process sampler names what it sees."""
        self.gaps = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="pod-timeline")
        self.ready = threading.Event()
        self.thread.start()
        if not self.ready.wait(60):
            raise RuntimeError("the pod watch did not start")

    @staticmethod
    def _event(t: float, kind: str, obj: dict) -> PodEvent:
        meta, spec, status = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
        labels = meta.get("labels") or {}
        owner = next((o["uid"] for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
        disruption = next((c.get("reason") or "DisruptionTarget" for c in status.get("conditions") or []
                           if c.get("type") == "DisruptionTarget" and c.get("status") == "True"), None)
        codes = tuple(cs["state"]["terminated"]["exitCode"] for cs in status.get("containerStatuses") or []
                      if (cs.get("state") or {}).get("terminated"))
        return PodEvent(t=t, type=kind, name=meta["name"], uid=meta["uid"], job=labels.get("kubetrain.io/job-name"),
                        owner=owner, attempt=int(labels.get("kubetrain.io/attempt", 0)),
                        rank=int(labels.get("kubetrain.io/node-rank", 0)), phase=status.get("phase", ""),
                        node=spec.get("nodeName") or "", deleting=bool(meta.get("deletionTimestamp")),
                        disruption=disruption, exit_codes=codes)

    def _record(self, ev: PodEvent) -> None:
        with self.lock:
            self.events.append(ev)
            if ev.job:
                self.owner_of[ev.uid[:8]] = (ev.owner or "", ev.attempt)
            if ev.type == "DELETED":
                self.latest.pop(ev.uid, None)
            else:
                self.latest[ev.uid] = ev

    def _relist(self) -> str:
        resp = self.core.list_namespaced_pod(self.namespace, _preload_content=False)
        body = json.loads(resp.data)
        t = now()
        seen = set()
        for obj in body["items"]:
            ev = self._event(t, "ADDED" if obj["metadata"]["uid"] not in self.latest else "MODIFIED", obj)
            seen.add(ev.uid)
            self._record(ev)
        for uid, last in list(self.latest.items()):
            if uid not in seen:
                self._record(dataclasses.replace(last, t=t, type="DELETED"))
        return body["metadata"]["resourceVersion"]

    def _run(self) -> None:
        rv = self._relist()
        self.ready.set()
        while not self.stop.is_set():
            try:
                resp = self.core.list_namespaced_pod(self.namespace, watch=True, resource_version=rv,
                                                     allow_watch_bookmarks=True, timeout_seconds=30,
                                                     _preload_content=False)
                try:
                    for line in resp:
                        ev = json.loads(line)
                        obj = ev["object"]
                        if ev["type"] == "ERROR":  # 410 Gone: what happened meanwhile comes from a relist
                            self.gaps += 1
                            rv = self._relist()
                            break
                        rv = obj["metadata"]["resourceVersion"]
                        if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                            self._record(self._event(now(), ev["type"], obj))
                        if self.stop.is_set():
                            return
                finally:
                    resp.release_conn()
            except Exception:  # noqa: BLE001  (resume the watch from the last resourceVersion)
                time.sleep(0.2)

    def live(self) -> list[PodEvent]:
        with self.lock:
            return list(self.latest.values())

    def snapshot(self) -> list[PodEvent]:
        with self.lock:
            return list(self.events)


class ProcessSampler:
    """Which job attempts have live trainer processes, from /proc, twice a second.

    The pod watch says when the API server forgot a pod; a process can outlive that (a force deletion,
    a lost node). Two attempts' processes alive at once would be the overlap that matters to storage."""

    def __init__(self, marker_prefix: str, owner_of: dict[str, tuple[str, int]], interval: float = 0.5) -> None:
        self.marker = f"{MARKER_ENV}={marker_prefix}".encode()
        self.owner_of = owner_of
        self.interval = interval
        self.samples = 0
        self.overlaps: list[dict] = []
        self.last_alive: dict[str, float] = {}
        """pod uid8 -> last time one of its processes was seen alive."""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="proc-sampler")
        self.thread.start()

    def _scan(self) -> dict[str, set[tuple[str, int]]]:
        jobs: dict[str, set[tuple[str, int]]] = defaultdict(set)
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    raw = f.read()
                if self.marker not in raw:
                    continue
                with open(f"/proc/{entry.name}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue
                env = dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)
                job = env.get(b"KUBETRAIN_JOB_NAME")
                if not job:
                    continue
                cwd = os.readlink(f"/proc/{entry.name}/cwd")
            except OSError:
                continue
            m = re.search(r"/pods/[^/]+_([0-9a-f]{8})(/|$)", cwd)
            uid8 = m.group(1) if m else "?"
            jobs[job.decode()].add((uid8, int(env.get(b"KUBETRAIN_ATTEMPT", b"0"))))
        return jobs

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            t = now()
            jobs = self._scan()
            self.samples += 1
            for job, pods in jobs.items():
                for uid8, _ in pods:
                    self.last_alive[uid8] = t
                keys = {self.owner_of.get(uid8, ("?" + uid8, attempt)) for uid8, attempt in pods}
                if len(keys) > 1:
                    self.overlaps.append({"t": t, "job": job,
                                          "attempts": sorted(f"{o[:8]}/a{a}" for o, a in keys)})


LOG_PATTERNS = {
    "restored": re.compile(r"restored checkpoint-(\d+) \(attempt (\d+)\) into (\S+)"),
    "scratch": re.compile(r"no complete checkpoint in .*: starting from scratch"),
    "step": re.compile(r"INFO step (\d+): \{'loss'"),
    "queued": re.compile(r"new local checkpoint-(\d+): queued for upload"),
    "committed": re.compile(r"checkpoint-(\d+) committed \("),
    "corrupt": re.compile(r"(checkpoint-\d+ is corrupt.*)"),
    "not_committed": re.compile(r"(checkpoint-\d+ (?:not committed|can not be committed).*)"),
    "exit": re.compile(r"outcome exit code (\d+)"),
}


class LogTailer:
    """Follows every trainer log of the run's agents; hands each restore to a verifier at once."""

    def __init__(self, agent_dirs: list[Path], namespace: str, on_restore) -> None:
        self.agent_dirs, self.namespace, self.on_restore = agent_dirs, namespace, on_restore
        self.logs: dict[str, PodLog] = {}
        """pod dir name (<ns>_<pod>_<uid8>) -> what its log said."""
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="log-tailer")
        self.thread.start()

    def _files(self) -> list[Path]:
        out = []
        for d in self.agent_dirs:
            out.extend(d.glob(f"pods/{self.namespace}_*/trainer.log"))
        return out

    def poll(self) -> None:
        for path in self._files():
            try:
                size = path.stat().st_size
            except OSError:
                continue
            pos = self.offsets.get(path, 0)
            if size <= pos:
                continue
            with open(path, "rb") as f:
                f.seek(pos)
                data = self.partial.pop(path, b"") + f.read(size - pos)
            self.offsets[path] = size
            lines = data.split(b"\n")
            if lines[-1]:
                self.partial[path] = lines[-1]
            for line in lines[:-1]:
                self._line(path.parent, line.decode("utf-8", "replace"))

    def _line(self, pod_dir: Path, line: str) -> None:
        key = pod_dir.name
        with self.lock:
            log = self.logs.get(key)
            if log is None:
                _, rest = key.split("_", 1)
                pod, _, uid8 = rest.rpartition("_")
                log = self.logs[key] = PodLog(pod=pod, uid8=uid8)
        if (m := LOG_PATTERNS["step"].search(line)):
            log.max_step = max(log.max_step, int(m.group(1)))
        elif (m := LOG_PATTERNS["restored"].search(line)):
            log.restored = (int(m.group(1)), int(m.group(2)))
            log.max_step = max(log.max_step, int(m.group(1)))
            self.on_restore(log, Path(m.group(3)))
        elif LOG_PATTERNS["scratch"].search(line):
            log.scratch = True
        elif (m := LOG_PATTERNS["committed"].search(line)):
            log.committed.append(int(m.group(1)))
        elif (m := LOG_PATTERNS["corrupt"].search(line)):
            log.corrupt.append(m.group(1)[:300])
        elif (m := LOG_PATTERNS["not_committed"].search(line)):
            log.not_committed.append(m.group(1)[:300])
        elif (m := LOG_PATTERNS["exit"].search(line)):
            log.exit_code = int(m.group(1))

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - a benchmark observer must not die
                print(f"[chaos] log tailer: {exc!r}", flush=True)

    def by_pod(self) -> dict[tuple[str, str], PodLog]:
        with self.lock:
            return {(log.pod, log.uid8): log for log in self.logs.values()}


def _digest(entry: dict[str, Any]) -> tuple[str, str]:
    return ("xxh128", entry["xxh128"]) if "xxh128" in entry else ("sha256", entry.get("sha256", ""))


def digest_matches(data: bytes, entry: dict[str, Any]) -> bool:
    """Whether `data` has the digest the manifest's file entry records (docs/contract.md: `xxh128`, or
    `sha256` in manifests written before it), computed here from the definition, not by the trainer."""
    import xxhash

    if "xxh128" in entry:
        part = 8 << 20
        tree = b"".join(xxhash.xxh3_128_digest(data[i:i + part]) for i in range(0, len(data), part))
        return xxhash.xxh3_128_hexdigest(tree) == entry["xxh128"]
    return hashlib.sha256(data).hexdigest() == entry.get("sha256")


def required_files(world_size: int) -> set[str]:
    """What a complete checkpoint of the built-in trainer holds (the HF layout, one RNG state per rank, and
    kubetrain's own state beside trainer_state.json: the data position an exact resume needs)."""
    return {"trainer_state.json", "kubetrain_state.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
            *(f"rng_state_{r}.pth" for r in range(world_size))}


def completeness_problems(files: dict[str, dict], world_size: int) -> list[str]:
    """Why a manifest's file list is not a whole checkpoint (empty: it is)."""
    missing = sorted(required_files(world_size) - set(files))
    return [f"missing {', '.join(missing)}"] if missing else []


class S3Auditor:
    """Sees every manifest committed under the run's prefix and checks it against the bytes in MinIO.

    A manifest is verified when first seen (every file there, its size and digest as listed). A failure
    only counts when the manifest is still the same afterwards: retention deletes a manifest before its
    files, so a checkpoint deleted while being verified is "superseded", not broken."""

    def __init__(self, s3, bucket: str, prefix: str) -> None:
        self.s3, self.bucket, self.prefix = s3, bucket, prefix.rstrip("/") + "/"
        self.archive: dict[tuple[str, str, str], dict] = {}
        """(job, folder, etag) -> the manifest and its verdict."""
        self.lock = threading.Lock()
        self.errors = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="s3-auditor")
        self.thread.start()

    def keys(self, sub: str = "") -> dict[str, dict]:
        out = {}
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + sub):
            for obj in page.get("Contents", []):
                out[obj["Key"]] = obj
        return out

    def verify(self, base: str, manifest: dict) -> tuple[str, str]:
        """("ok"|"bad", detail) for a manifest's files under `base` (the folder's key with a trailing /)."""
        problems = []
        for f in manifest.get("files", []):
            try:
                body = self.s3.get_object(Bucket=self.bucket, Key=base + f["path"])["Body"].read()
            except self.s3.exceptions.NoSuchKey:
                problems.append(f"{f['path']} missing")
                continue
            if len(body) != f["size"] or not digest_matches(body, f):
                problems.append(f"{f['path']} differs")
        return ("bad", "; ".join(problems)) if problems else ("ok", "")

    def scan(self) -> None:
        for key, obj in self.keys().items():
            rel = key[len(self.prefix):]
            parts = rel.split("/")
            # <namespace>/<job>/<folder>/manifest.json
            if len(parts) != 4 or parts[3] != "manifest.json":
                continue
            job, folder, etag = parts[1], parts[2], obj["ETag"]
            if (job, folder, etag) in self.archive:
                continue
            try:
                manifest = json.loads(self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read())
            except self.s3.exceptions.NoSuchKey:
                continue
            base = key[: -len("manifest.json")]
            verdict, detail = self.verify(base, manifest)
            if verdict == "bad":
                try:
                    again = self.s3.head_object(Bucket=self.bucket, Key=key)["ETag"]
                except Exception:  # noqa: BLE001 - gone: deleted by retention meanwhile
                    again = None
                if again != etag:
                    verdict, detail = "superseded", f"manifest replaced or deleted during verification ({detail})"
            files = {f["path"]: f for f in manifest.get("files", [])}
            record = {"job": job, "folder": folder, "etag": etag, "step": manifest.get("step"),
                      "attempt": manifest.get("attempt"), "world_size": manifest.get("world_size"),
                      "files": files, "seen": now(), "verdict": verdict, "detail": detail,
                      "incomplete": completeness_problems(files, int(manifest.get("world_size") or 1))
                      if folder.startswith("checkpoint-") else []}
            with self.lock:
                self.archive[(job, folder, etag)] = record

    def find(self, job: str, step: int, attempt: int) -> list[dict]:
        with self.lock:
            return [r for (j, folder, _), r in self.archive.items()
                    if j == job and folder == f"checkpoint-{step}" and r["attempt"] == attempt]

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                self.scan()
            except Exception:  # noqa: BLE001 - MinIO down or restarting: look again in a second
                self.errors += 1


class RestoreVerifier:
    """Checks each restore the moment its log line appears, before the trainer moves past it."""

    def __init__(self, auditor: S3Auditor, namespace: str) -> None:
        self.auditor, self.namespace = auditor, namespace
        self.checks: list[RestoreCheck] = []
        self.queue: list[tuple[PodLog, Path, float]] = []
        self.cv = threading.Condition()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="restore-verifier")
        self.thread.start()

    def submit(self, log: PodLog, path: Path) -> None:
        with self.cv:
            self.queue.append((log, path, now()))
            self.cv.notify()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self.stop.is_set():
                    self.cv.wait(0.5)
                if not self.queue and self.stop.is_set():
                    return
                log, path, seen = self.queue.pop(0)
            try:
                self.checks.append(self.check(log, path, seen))
            except Exception as exc:  # noqa: BLE001
                step, attempt = log.restored or (-1, -1)
                self.checks.append(RestoreCheck(job=job_of_pod(log.pod), pod=log.pod, step=step,
                                                manifest_attempt=attempt, verdict="unverified",
                                                detail=f"verifier error {exc!r}"))

    def check(self, log: PodLog, path: Path, seen: float) -> RestoreCheck:
        step, attempt = log.restored
        job = job_of_pod(log.pod)
        result = lambda verdict, detail: RestoreCheck(job=job, pod=log.pod, step=step,  # noqa: E731
                                                      manifest_attempt=attempt, verdict=verdict, detail=detail)
        problems: list[str] = []
        local_files: dict[str, dict] | None = None
        try:
            local = json.loads((path / "manifest.json").read_text())
        except FileNotFoundError:
            local = None  # the trainer's local retention was quicker: judge by S3 alone
        if local is not None:
            local_files = {f["path"]: f for f in local["files"]}
            if (local.get("step"), local.get("attempt")) != (step, attempt):
                problems.append(f"restored folder's manifest says step {local.get('step')} attempt "
                                f"{local.get('attempt')}")
            for name, f in local_files.items():
                p = path / name
                try:
                    if p.stat().st_size != f["size"] or not digest_matches(p.read_bytes(), f):
                        problems.append(f"{name} differs from the manifest")
                except FileNotFoundError:
                    problems.append(f"{name} not restored")
            problems += completeness_problems(local_files, int(local.get("world_size") or 1))
            try:
                state = json.loads((path / "trainer_state.json").read_text())
                if state.get("global_step") != step:
                    problems.append(f"trainer_state.json says global_step {state.get('global_step')}")
            except FileNotFoundError:
                pass  # already named above when the manifest lists it
            if not path.exists():  # retention removed the folder while it was checked: judge by S3 alone
                local_files, problems = None, []
        # What the auditor saw in MinIO for this step and attempt (it scans every second).
        deadline = seen + 5.0
        records = self.auditor.find(job, step, attempt)
        while not records and now() < deadline:
            time.sleep(0.3)
            records = self.auditor.find(job, step, attempt)
        if problems:
            kind = "incomplete" if any(p.startswith("missing") or "not restored" in p for p in problems) else "mismatched"
            return result(kind, "; ".join(problems))
        if not records:
            if local_files is None:
                return result("unverified", "restored folder gone and the manifest never seen in S3")
            return result("ok", "restored folder verified; the S3 auditor never saw this manifest")
        bad = [r for r in records if r["verdict"] == "bad" or r["incomplete"]]
        if bad:
            return result("incomplete", f"manifest in S3: {bad[0]['detail'] or bad[0]['incomplete']}")
        if local_files is not None:
            same = any({k: _digest(v) for k, v in r["files"].items()} == {k: _digest(v) for k, v in local_files.items()}
                       for r in records)
            if not same:
                return result("mismatched", "restored manifest differs from the one committed in S3")
        verdicts = {r["verdict"] for r in records}
        if "ok" in verdicts:
            return result("ok", "")
        return result("unverified" if local_files is None else "ok", f"S3 auditor: {sorted(verdicts)}")


def job_of_pod(pod: str) -> str:
    """`<job>-a<attempt>-n<rank>` -> job."""
    m = re.fullmatch(r"(.+)-a\d+-n\d+", pod)
    return m.group(1) if m else pod


# --------------------------------------------------------------------------- actors


class Operator:
    """The operator as a child process that can be SIGKILLed and started again."""

    def __init__(self, env: dict[str, str], namespace: str, log_path: Path) -> None:
        self.port = free_port()
        self.env = {**env, "KUBETRAIN_NAMESPACES": namespace, "KUBETRAIN_LOG_LEVEL": "INFO",
                    "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), env.get("PYTHONPATH", "")])}
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.expected_down = False
        self.unexpected_exits: list[dict] = []
        self.starts = 0

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kubetrain", "operator", "run",
                                          f"--liveness=http://127.0.0.1:{self.port}/healthz"],
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.starts += 1
        self.expected_down = False

    def healthy(self) -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2).read()
            return True
        except OSError:
            return False

    def wait_healthy(self, timeout: float) -> float | None:
        t0 = now()
        while now() - t0 < timeout:
            if self.healthy():
                return now() - t0
            if self.proc and self.proc.poll() is not None:
                return None
            time.sleep(0.3)
        return None

    def kill(self) -> None:
        self.expected_down = True
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def check(self) -> None:
        """An exit nobody asked for is recorded and the operator started again (the run goes on)."""
        if self.proc and not self.expected_down and self.proc.poll() is not None:
            self.unexpected_exits.append({"t": now(), "code": self.proc.returncode})
            print(f"[chaos] operator exited by itself with {self.proc.returncode}: starting it again", flush=True)
            self.start()

    def stop(self) -> None:
        self.expected_down = True
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Agents:
    """Test node agents (real processes running pods' commands), one Node each."""

    def __init__(self, env: dict[str, str], kubeconfig: str, core: client.CoreV1Api, run_dir: Path, tag: str,
                 slots: int) -> None:
        self.env = {**env, "PYTHONPATH": os.pathsep.join([str(ROOT / "testbed"), env.get("PYTHONPATH", "")])}
        self.kubeconfig, self.core, self.run_dir, self.tag, self.slots = kubeconfig, core, run_dir, tag, slots
        self.procs: dict[str, subprocess.Popen] = {}
        self.replacing: set[str] = set()

    def state_dir(self, name: str) -> Path:
        return self.run_dir / "agents" / name

    def start(self, name: str) -> None:
        state = self.state_dir(name)
        state.mkdir(parents=True, exist_ok=True)
        with open(state / "agent.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "kubetrain_testbed.agent", "--kubeconfig", self.kubeconfig,
                 "--node-name", name, "--state-dir", str(state), "--cpu", str(self.slots), "--pods", "30",
                 "--label", f"{RUN_LABEL}={self.tag}", "--taint", f"{AGENT_TAINT_KEY}=true:NoSchedule",
                 "--delete-node-on-exit", "--shutdown-grace", "10"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = now() + 120
        while now() < deadline:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"agent {name} exited with {self.procs[name].returncode}; see {state / 'agent.log'}")
            try:
                node = self.core.read_node(name)
                if any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or []):
                    return
            except client.ApiException:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"agent {name} not Ready after 120 s; see {state / 'agent.log'}")

    def stop(self, name: str, timeout: float = 60) -> None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- the run


class Chaos:
    """Submits the jobs, injects the faults, keeps the run's machinery alive; all state lives here."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.cfg = TestbedConfig.from_environ()
        self.env = load_env(self.cfg)
        self.penv = self.env.subprocess_env()
        api = config.new_client_from_config(config_file=self.env.kubeconfig)
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.sched = client.SchedulingV1Api(api)
        import boto3

        self.s3 = boto3.client("s3", endpoint_url=self.env.s3_endpoint, aws_access_key_id=self.env.access_key,
                               aws_secret_access_key=self.env.secret_key, region_name=self.env.region)
        self.tag = secrets.token_hex(3)
        self.namespace = f"chaos-{self.tag}"
        self.prefix = f"chaos-{self.tag}"
        self.priority_class = f"chaos-{self.tag}-high"
        self.run_dir = Path(args.run_dir or f"/tmp/kubetrain-chaos-{self.tag}")
        self.t0 = now()
        self.deadline = self.t0 + args.duration
        self.faults: list[Fault] = []
        self.jobs: dict[str, dict] = {}
        """name -> {"nodes", "incarnations": [uid...], "status": {...}, "submitted": t, "recreating": bool}."""
        self.queue: list[str] = []
        self.minio_down = False
        self.threads: list[threading.Thread] = []
        self.hunting: set[str] = set()
        self.preemptors: dict[str, tuple[float, str]] = {}
        """preemptor pod -> (created, node)."""
        self.agent_names: list[str] = []
        self.stopping = threading.Event()

    # ---------------------------------------------------------------- helpers
    def rel(self, t: float) -> float:
        return round(t - self.t0, 2)

    def say(self, msg: str) -> None:
        print(f"[chaos {now() - self.t0:7.1f}s] {msg}", flush=True)

    def background(self, fn, *a) -> None:
        def run() -> None:
            try:
                fn(*a)
            except Exception as exc:  # noqa: BLE001 - one fault's trouble is reported, the run goes on
                self.say(f"{fn.__name__} failed: {exc!r}")

        t = threading.Thread(target=run, daemon=True, name=fn.__name__)
        self.threads.append(t)
        t.start()

    def create_job(self, name: str) -> str:
        info = self.jobs[name]
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob", "metadata": {"name": name},
                "spec": job_spec(nodes=info["nodes"], master_port=free_port(), args=self.args,
                                 bucket=self.env.bucket, prefix=self.prefix, endpoint=self.env.s3_endpoint,
                                 tag=self.tag, seed=info["seed"])}
        for _ in range(60):
            try:
                obj = self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)
                info["incarnations"].append(obj["metadata"]["uid"])
                return obj["metadata"]["uid"]
            except client.ApiException as exc:
                if exc.status != 409:
                    raise
                time.sleep(0.5)  # the deleted incarnation is still being removed
        raise RuntimeError(f"TrainingJob {name} could not be created again (409 for 30 s)")

    def poll_jobs(self) -> None:
        items = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)["items"]
        for obj in items:
            info = self.jobs.get(obj["metadata"]["name"])
            if info and info["incarnations"] and obj["metadata"]["uid"] == info["incarnations"][-1]:
                info["status"] = obj.get("status") or {}

    def finished(self, name: str) -> bool:
        info = self.jobs[name]
        return not info["recreating"] and info["status"].get("phase") in ("Succeeded", "Failed")

    def active(self) -> list[str]:
        return [n for n, i in self.jobs.items() if i["incarnations"] and not self.finished(n)]

    def training_pods(self) -> list[PodEvent]:
        """Live, Running, not terminating training pods whose trainer has logged a step."""
        logs = self.tailer.by_pod()
        out = []
        for ev in self.timeline.live():
            if ev.job and ev.phase == "Running" and not ev.deleting and ev.node in self.agents.procs:
                log = logs.get((ev.name, ev.uid[:8]))
                if log is not None and log.max_step > 0:
                    out.append(ev)
        return sorted(out, key=lambda e: e.name)

    # ---------------------------------------------------------------- setup / teardown
    def setup(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        kubectl(self.env, "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "trainingjob.yaml"))
        kubectl(self.env, "wait", "--for=condition=Established", "crd/trainingjobs.kubetrain.io", "--timeout=120s",
                timeout=150)
        self.core.create_namespace({"metadata": {"name": self.namespace, "labels": {RUN_LABEL: self.tag}}})
        self.sched.create_priority_class({"metadata": {"name": self.priority_class}, "value": 1000000,
                                          "description": "kubetrain chaos benchmark: preempts training pods"})
        self.core.create_namespaced_secret(self.namespace, {
            "metadata": {"name": "kubetrain-s3"},
            "stringData": {"accessKeyId": self.env.access_key, "secretAccessKey": self.env.secret_key}})
        self.agents = Agents(self.penv, self.env.kubeconfig, self.core, self.run_dir, self.tag, self.args.slots)
        self.agent_names = [f"chaos-{self.tag}-{i}" for i in range(self.args.agents)]
        for name in self.agent_names:
            self.agents.start(name)
        self.timeline = PodTimeline(self.core, self.namespace)
        self.sampler = ProcessSampler(f"chaos-{self.tag}-", self.timeline.owner_of)
        self.auditor = S3Auditor(self.s3, self.env.bucket, self.prefix)
        self.verifier = RestoreVerifier(self.auditor, self.namespace)
        self.tailer = LogTailer([self.agents.state_dir(n) for n in self.agent_names], self.namespace,
                                self.verifier.submit)
        self.operator = Operator(self.penv, self.namespace, self.run_dir / "operator.log")
        self.operator.start()
        if self.operator.wait_healthy(120) is None:
            raise RuntimeError(f"the operator did not become healthy; see {self.operator.log_path}")
        for i in range(self.args.jobs):
            name = f"job-{i:02d}"
            self.jobs[name] = {"nodes": self.rng.choice(self.args.nodes), "seed": 42 + i, "incarnations": [],
                               "status": {}, "recreating": False, "submitted": None}
            self.queue.append(name)
        self.say(f"namespace {self.namespace}, {len(self.agent_names)} agents x {self.args.slots} slots, "
                 f"{self.args.jobs} jobs, logs in {self.run_dir}")

    def teardown(self) -> dict:
        """Everything back as it was; returns what the clean-up itself found (leftover processes...)."""
        found: dict[str, Any] = {}
        self.stopping.set()
        until = now() + 60
        for t in self.threads:
            t.join(timeout=max(0.1, until - now()))
        if self.minio_down or not self._minio_alive():
            try:
                start_component(self.cfg, "minio")
            except Exception as exc:  # noqa: BLE001
                found["minio_restart_error"] = repr(exc)
            self.minio_down = False
        try:
            self.poll_jobs()
        except Exception as exc:  # noqa: BLE001
            found["last_job_poll_error"] = repr(exc)
        auditor = getattr(self, "auditor", None)
        if auditor is not None:
            auditor.stop.set()
            auditor.thread.join(10)
            try:
                auditor.scan()  # the final models of the last jobs
            except Exception as exc:  # noqa: BLE001
                found["last_audit_error"] = repr(exc)
        op = getattr(self, "operator", None)
        if op:
            found["operator_healthy_at_end"] = op.healthy()
            op.stop()
        try:
            self.custom.delete_collection_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)
            self.core.delete_collection_namespaced_pod(self.namespace, grace_period_seconds=0)
        except client.ApiException:
            pass
        agents = getattr(self, "agents", None)
        if agents:
            for name in list(agents.procs):
                agents.stop(name)
            left = self._marked_pids()
            found["processes_left_after_agents_stopped"] = len(left)
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            for name in self.agent_names:
                try:
                    self.core.delete_node(name)
                except client.ApiException:
                    pass
        for stopper in ("timeline", "sampler", "tailer"):
            obj = getattr(self, stopper, None)
            if obj is not None:
                obj.stop.set()
        if getattr(self, "tailer", None):
            self.tailer.poll()  # the last lines
        if getattr(self, "verifier", None):
            self.verifier.stop.set()
            self.verifier.thread.join(60)
        try:
            self.core.delete_namespace(self.namespace)
        except client.ApiException:
            pass
        try:
            self.sched.delete_priority_class(self.priority_class)
        except client.ApiException:
            pass
        if not self.args.keep_s3 and auditor is not None:
            try:
                keys = list(auditor.keys())
                for i in range(0, len(keys), 1000):
                    self.s3.delete_objects(Bucket=self.env.bucket,
                                           Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
                uploads = self.s3.list_multipart_uploads(Bucket=self.env.bucket, Prefix=self.prefix + "/")
                for u in uploads.get("Uploads", []):
                    self.s3.abort_multipart_upload(Bucket=self.env.bucket, Key=u["Key"], UploadId=u["UploadId"])
                found["incomplete_multipart_uploads_left"] = len(uploads.get("Uploads", []))
            except Exception as exc:  # noqa: BLE001
                found["s3_cleanup_error"] = repr(exc)
        # Local checkpoints are large; the logs stay for reading.
        for d in self.run_dir.glob("agents/*/pods/*"):
            for sub in ("checkpoints", ".checkpoints.upload-staging"):
                subprocess.run(["rm", "-rf", str(d / sub)], check=False)
        return found

    def _marked_pids(self) -> list[int]:
        marker = f"{MARKER_ENV}=chaos-{self.tag}-".encode()
        out = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/environ", "rb") as f:
                        if marker in f.read():
                            out.append(int(entry.name))
                except OSError:
                    pass
        return out

    def _minio_alive(self) -> bool:
        try:
            urllib.request.urlopen(f"{self.env.s3_endpoint}/minio/health/live", timeout=2).read()
            return True
        except OSError:
            return False

    # ---------------------------------------------------------------- the loop
    def admit(self) -> None:
        """Start queued jobs while their pods fit on the agents: capacity bounds what runs at once."""
        capacity = self.args.agents * self.args.slots
        busy = sum(self.jobs[n]["nodes"] for n in self.active())
        while self.queue and busy + self.jobs[self.queue[0]]["nodes"] <= capacity:
            name = self.queue.pop(0)
            self.create_job(name)
            self.jobs[name]["submitted"] = now()
            busy += self.jobs[name]["nodes"]
            self.say(f"submitted {name} ({self.jobs[name]['nodes']} node(s))")

    def maintain(self) -> None:
        self.operator.check()
        for name, (since, _) in list(self.preemptors.items()):
            try:
                pod = self.core.read_namespaced_pod(name, self.namespace)
                done = pod.status.phase in ("Succeeded", "Failed") or now() - since > 90
            except client.ApiException:
                done = True
            if done:
                try:
                    self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
                except client.ApiException:
                    pass
                del self.preemptors[name]

    def run(self) -> None:
        end_of_faults = False
        next_fault = None
        drawn: tuple[str, float] | None = None
        interval = self.args.fault_interval
        last_poll = 0.0
        while now() < self.deadline - self.args.teardown_reserve:
            if now() - last_poll > 2:
                self.poll_jobs()
                last_poll = now()
            self.admit()
            self.maintain()
            if next_fault is None and self.training_pods():
                next_fault = now()  # the first fault as soon as something trains
            injected = len(self.faults)
            if not end_of_faults and next_fault is not None and now() >= next_fault:
                if injected >= self.args.faults:
                    end_of_faults = True
                    self.say(f"all {injected} faults injected; letting the jobs finish")
                else:
                    if drawn is None:
                        drawn = (self.pick_kind(injected), now())
                    # The drawn kind waits up to --kind-wait seconds for a target (a pod that trains, MinIO
                    # up...); only then another kind that has one goes instead. Switching at once would
                    # favour the kinds that are always possible (operator-kill) and skew the mix.
                    if self.inject(drawn[0], fallback=now() - drawn[1] > self.args.kind_wait):
                        drawn = None
                        next_fault = now() + interval * self.rng.uniform(0.5, 1.5)
                    else:
                        next_fault = now() + 1
            if not self.queue and all(self.finished(n) for n in self.jobs):
                self.say("every job finished")
                break
            time.sleep(0.5)
        else:
            self.say("deadline reached")

    # ---------------------------------------------------------------- faults
    def pick_kind(self, index: int) -> str:
        if index < len(KINDS) and self.args.faults >= len(KINDS):
            if index == 0:
                self.first_kinds = list(KINDS)
                self.rng.shuffle(self.first_kinds)
            return self.first_kinds[index]
        kinds = list(KINDS)
        return self.rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]

    def eligible(self, kind: str) -> bool:
        pods = self.training_pods()
        if kind in ("preemption", "eviction", "trainer-kill", "job-recreate"):
            if kind == "trainer-kill":
                return len(self.hunting) < 2 and any(p.name not in self.hunting for p in pods)
            if kind == "job-recreate":
                return any(not self.jobs[p.job]["recreating"] for p in pods if p.job in self.jobs)
            if kind == "preemption":
                return bool(self._preemptible_nodes(pods))
            return bool(pods)
        if kind == "node-deletion":
            return not self.agents.replacing and len(self.agent_names) > 1 and bool(pods)
        if kind == "operator-kill":
            return not self.operator.expected_down
        return not self.minio_down

    def inject(self, kind: str, *, fallback: bool) -> bool:
        if not self.eligible(kind):
            if not fallback:
                return False
            ready = [k for k in KINDS if self.eligible(k)]
            if not ready:
                return False
            kind = self.rng.choices(ready, weights=[WEIGHTS[k] for k in ready])[0]
        fault = Fault(id=len(self.faults) + 1, kind=kind, t=now())
        self.faults.append(fault)
        getattr(self, "fault_" + kind.replace("-", "_"))(fault)
        self.say(f"fault {fault.id}/{self.args.faults}: {kind} {fault.detail or ''}")
        return True

    def _target(self, pod: PodEvent) -> tuple[str, str, int]:
        return (pod.job, pod.owner or "", pod.attempt)

    def _preemptible_nodes(self, pods: list[PodEvent]) -> list[str]:
        """Nodes with a training pod, neither being replaced nor waiting for an earlier preemptor."""
        busy = {node for _, node in self.preemptors.values()} | self.agents.replacing
        return sorted({p.node for p in pods} - busy)

    def fault_preemption(self, fault: Fault) -> None:
        node = self.rng.choice(self._preemptible_nodes(self.training_pods()))
        # Each training pod requests one cpu: ask for one more than is free, so exactly one must go.
        used = sum(1 for p in self.timeline.live() if p.node == node and p.job and p.phase not in ("Succeeded", "Failed"))
        cpu = min(self.args.slots, self.args.slots - used + 1)
        name = f"preemptor-{fault.id}"
        self.core.create_namespaced_pod(self.namespace, preemptor_pod(
            name=name, node=node, cpu=cpu, priority_class=self.priority_class, seconds=15))
        self.preemptors[name] = (now(), node)
        fault.detail = {"node": node, "cpu": cpu, "preemptor": name}

    def fault_eviction(self, fault: Fault) -> None:
        pod = self.rng.choice(self.training_pods())
        fault.targets.append(self._target(pod))
        try:
            self.core.create_namespaced_pod_eviction(pod.name, self.namespace, client.V1Eviction(
                metadata=client.V1ObjectMeta(name=pod.name, namespace=self.namespace)))
            fault.detail = {"pod": pod.name}
        except client.ApiException as exc:
            fault.detail = {"pod": pod.name, "refused": exc.status}

    def fault_node_deletion(self, fault: Fault) -> None:
        pods = self.training_pods()
        node = self.rng.choice(sorted({p.node for p in pods}))
        fault.targets.extend(self._target(p) for p in self.timeline.live() if p.node == node and p.job)
        self.agents.replacing.add(node)
        self.core.delete_node(node)
        fault.detail = {"node": node, "pods": sorted(p.name for p in self.timeline.live() if p.node == node)}
        self.background(self._replace_node, fault, node)

    def _replace_node(self, fault: Fault, node: str) -> None:
        """The lost node's pods go away (pod GC, the operator); then a fresh node of the same name joins."""
        deadline = now() + 120
        while now() < deadline and not self.stopping.is_set():
            if not [p for p in self.timeline.live() if p.node == node]:
                break
            time.sleep(1)
        fault.detail["pods_gone_after_s"] = round(now() - fault.t, 1)
        self.agents.stop(node)
        if not self.stopping.is_set():
            self.agents.start(node)
            fault.detail["node_back_after_s"] = round(now() - fault.t, 1)
        self.agents.replacing.discard(node)
        fault.end = now()

    def fault_operator_kill(self, fault: Fault) -> None:
        self.operator.kill()
        delay = self.rng.uniform(1, 5)
        fault.detail = {"restart_after_s": round(delay, 1)}

        def restart() -> None:
            time.sleep(delay)
            self.operator.start()
            healthy = self.operator.wait_healthy(120)
            fault.detail["healthy_after_s"] = None if healthy is None else round(healthy, 1)
            if healthy is None and self.operator.expected_down:
                fault.detail["killed_again_while_starting"] = True
            fault.end = now()

        self.background(restart)

    def fault_trainer_kill(self, fault: Fault) -> None:
        pod = self.rng.choice([p for p in self.training_pods() if p.name not in self.hunting])
        fault.targets.append(self._target(pod))
        fault.detail = {"pod": pod.name}
        self.hunting.add(pod.name)
        self.background(self._hunt, fault, pod)

    def _pod_dir(self, pod: PodEvent) -> Path | None:
        for name in self.agent_names:
            hits = list(self.agents.state_dir(name).glob(f"pods/{self.namespace}_{pod.name}_{pod.uid[:8]}"))
            if hits:
                return hits[0]
        return None

    def _hunt(self, fault: Fault, pod: PodEvent) -> None:
        """Wait for the pod's next upload; kill -9 its launcher once some files are in S3 but no commit."""
        try:
            pod_dir = self._pod_dir(pod)
            if pod_dir is None:
                fault.detail["outcome"] = "pod folder not found"
                return
            log_path, pos = pod_dir / "trainer.log", (pod_dir / "trainer.log").stat().st_size
            base = f"{self.prefix}/{self.namespace}/{pod.job}/"
            deadline = now() + self.args.hunt_seconds
            while now() < deadline and not self.stopping.is_set():
                with open(log_path, "rb") as f:
                    f.seek(pos)
                    data = f.read()
                pos += len(data)
                steps = [int(m.group(1)) for m in LOG_PATTERNS["queued"].finditer(data.decode("utf-8", "replace"))]
                if steps:
                    step = steps[-1]
                    folder = f"{base}checkpoint-{step}/"
                    commit_names = {"manifest.json", f"manifest.node-{pod.rank}.json"}
                    window_end = now() + 10
                    while now() < window_end:
                        try:
                            names = self._names(folder)
                        except Exception:  # noqa: BLE001 - S3 down: the upload is pending anyway
                            names = None
                        if names is not None and names & commit_names:
                            break  # missed this one; wait for the next upload
                        if names:
                            self._kill_launcher(fault, pod_dir, pod)
                            fault.detail.update(outcome="killed mid-upload", step=step,
                                                files_in_s3=len(names))
                            return
                        time.sleep(0.005)
                time.sleep(0.01)
            self._kill_launcher(fault, pod_dir, pod)
            fault.detail["outcome"] = "killed, no upload caught in time"
        finally:
            self.hunting.discard(pod.name)

    def _names(self, folder: str) -> set[str]:
        resp = self.s3.list_objects_v2(Bucket=self.env.bucket, Prefix=folder)
        return {o["Key"][len(folder):] for o in resp.get("Contents", [])}

    def _kill_launcher(self, fault: Fault, pod_dir: Path, pod: PodEvent) -> None:
        """kill -9 of the container's main process (the launcher), then of the rest of the container.

        A container runtime kills every process of the container when its PID 1 dies; the test node
        agent only kills the launcher's process group, and the launcher starts its workers in groups of
        their own, so the benchmark plays the runtime's part for them."""
        entry = f"KUBETRAIN_POD_NAME={pod.name}".encode()
        try:
            pid = int((pod_dir / "trainer.pgid").read_text().strip())
            with open(f"/proc/{pid}/environ", "rb") as f:
                if entry not in f.read().split(b"\0"):
                    raise ProcessLookupError
            os.kill(pid, signal.SIGKILL)
            fault.detail["killed_pid"] = pid
        except (OSError, ValueError):
            fault.detail["outcome"] = "launcher already gone"
            return
        rest = 0
        for other in self._marked_pids():
            try:
                with open(f"/proc/{other}/environ", "rb") as f:
                    if entry in f.read().split(b"\0"):
                        os.kill(other, signal.SIGKILL)
                        rest += 1
            except OSError:
                pass
        fault.detail["other_container_processes_killed"] = rest

    def fault_minio_restart(self, fault: Fault) -> None:
        self.minio_down = True

        def restart() -> None:
            try:
                stop_component(self.cfg, "minio")
            finally:
                start_component(self.cfg, "minio")
                self.minio_down = False
            fault.end = now()
            fault.detail["down_s"] = round(fault.end - fault.t, 1)

        self.background(restart)

    def fault_s3_outage(self, fault: Fault) -> None:
        self.minio_down = True
        stop_component(self.cfg, "minio", kill=True)
        fault.detail = {"seconds": self.args.outage_seconds}

        def back() -> None:
            end = now() + self.args.outage_seconds
            while now() < end and not self.stopping.is_set():
                time.sleep(0.5)
            if not self.stopping.is_set():  # else the clean-up starts it
                start_component(self.cfg, "minio")
                self.minio_down = False
            fault.end = now()
            fault.detail["down_s"] = round(fault.end - fault.t, 1)

        self.background(back)

    def fault_job_recreate(self, fault: Fault) -> None:
        pods = [p for p in self.training_pods() if p.job in self.jobs and not self.jobs[p.job]["recreating"]]
        name = self.rng.choice(sorted({p.job for p in pods}))
        info = self.jobs[name]
        old = info["incarnations"][-1]
        attempts = sorted({p.attempt for p in self.timeline.live() if p.owner == old})
        fault.targets.extend((name, old, a) for a in attempts)
        info["recreating"] = True
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        try:
            new = self.create_job(name)
            info["status"] = {}
            fault.detail = {"job": name, "old_uid": old[:8], "new_uid": new[:8]}
        finally:
            info["recreating"] = False


# --------------------------------------------------------------------------- analysis (pure)


def api_overlaps(events: Iterable[PodEvent]) -> tuple[list[dict], list[dict]]:
    """(overlaps within one job incarnation, overlaps between incarnations of the same job name).

    Within an incarnation: a pod of attempt N+1 ADDED while a pod of an older attempt still existed."""
    alive: dict[str, PodEvent] = {}
    within, across = [], []
    for ev in events:
        if not ev.job:
            continue
        if ev.type == "ADDED" and ev.uid not in alive:
            older = [p for p in alive.values() if p.owner == ev.owner and p.attempt < ev.attempt]
            if older:
                within.append({"t": ev.t, "added": ev.name, "still_there": sorted(p.name for p in older)})
            others = [p for p in alive.values() if p.job == ev.job and p.owner != ev.owner]
            if others:
                across.append({"t": ev.t, "added": ev.name, "other_incarnation": sorted(p.name for p in others)})
            alive[ev.uid] = ev
        elif ev.type == "DELETED":
            alive.pop(ev.uid, None)
    return within, across


def duplicate_pods(events: Iterable[PodEvent]) -> list[dict]:
    """A second pod (another uid) for the same job incarnation, attempt and node rank."""
    seen: dict[tuple[str, int, int], set[str]] = defaultdict(set)
    names: dict[tuple[str, int, int], set[str]] = defaultdict(set)
    for ev in events:
        if ev.job and ev.type == "ADDED":
            key = (ev.owner or "", ev.attempt, ev.rank)
            seen[key].add(ev.uid)
            names[key].add(ev.name)
    return [{"incarnation": k[0][:8], "attempt": k[1], "rank": k[2], "pods": sorted(names[k]), "uids": len(v)}
            for k, v in seen.items() if len(v) > 1]


@dataclass(frozen=True)
class Attempt:
    job: str
    owner: str
    attempt: int
    first_added: float
    restored: int | None
    """Step resumed from (0: from scratch), None when no pod of it got that far."""
    restored_steps: tuple[int, ...]
    """What each node restored: more than one value means the ranks resumed from different steps."""
    progress: int | None
    """Highest step any of its pods reached (or restored), None without logs."""
    exit_codes: tuple[int, ...]
    disruptions: tuple[str, ...]


def attempts_of(events: list[PodEvent], logs: dict[tuple[str, str], PodLog]) -> dict[str, list[Attempt]]:
    """Per job name, its attempts (all incarnations) in the order they started."""
    pods: dict[tuple[str, str, int], list[PodEvent]] = defaultdict(list)
    first: dict[tuple[str, str, int], float] = {}
    for ev in events:
        if ev.job:
            key = (ev.job, ev.owner or "", ev.attempt)
            pods[key].append(ev)
            first.setdefault(key, ev.t)
    out: dict[str, list[Attempt]] = defaultdict(list)
    for key in sorted(first, key=first.get):
        evs = pods[key]
        uids = {(e.name, e.uid[:8]) for e in evs}
        plogs = [logs[u] for u in uids if u in logs]
        restored = [pl.restored[0] if pl.restored else 0 for pl in plogs if pl.restored or pl.scratch]
        progress = [max(pl.max_step, pl.restored[0] if pl.restored else 0) for pl in plogs]
        codes = tuple(sorted({c for e in evs for c in e.exit_codes}))
        disruptions = tuple(sorted({e.disruption for e in evs if e.disruption}))
        out[key[0]].append(Attempt(job=key[0], owner=key[1], attempt=key[2], first_added=first[key],
                                   restored=min(restored) if restored else None,
                                   restored_steps=tuple(sorted(set(restored))),
                                   progress=max(progress) if progress else None,
                                   exit_codes=codes, disruptions=disruptions))
    return out


def transitions(attempts: dict[str, list[Attempt]], faults: list[Fault]) -> list[dict]:
    """Each restart (attempt to the next attempt that got to its restore), its steps lost, and its cause.

    The cause is the first fault aimed at the ended attempt(s) (later ones are listed too); else a global fault (operator, MinIO)
    that began while they ran; else none of ours (the exit codes and disruptions say what)."""
    out = []
    for job, seq in attempts.items():
        prev: Attempt | None = None
        between: list[Attempt] = []
        for att in seq:
            if att.restored is None:
                between.append(att)
                continue
            if prev is not None and prev.progress is not None:
                ended = [prev, *between]
                keys = {(a.owner, a.attempt) for a in ended}
                aimed = sorted((f for f in faults if any((o, a) in keys for j, o, a in f.targets if j == job)),
                               key=lambda f: f.t)
                window = (prev.first_added, att.first_added)
                outage = any(f.kind == "s3-outage" and f.t <= window[1] and (f.end or window[1]) >= window[0]
                             for f in faults)
                globals_ = [f for f in faults if f.kind in GLOBAL_KINDS and window[0] <= f.t <= window[1]]
                also = [f.id for f in aimed[1:]]
                if aimed:
                    cause, fault_id = aimed[0].kind, aimed[0].id
                elif globals_:
                    cause, fault_id = globals_[0].kind, globals_[0].id
                else:
                    cause, fault_id = "no injected fault", None
                out.append({"job": job, "from": f"{prev.owner[:8]}/a{prev.attempt}",
                            "to": f"{att.owner[:8]}/a{att.attempt}", "reached": prev.progress,
                            "resumed": att.restored, "lost": max(0, prev.progress - att.restored),
                            "cause": cause, "fault": fault_id, "also_hit_by_faults": also,
                            "s3_outage_in_window": outage,
                            "exit_codes": sorted({c for a in ended for c in a.exit_codes}),
                            "disruptions": sorted({d for a in ended for d in a.disruptions})})
            prev, between = att, []
        # An attempt with no restore line yet (killed while starting) keeps the previous one as "reached".
    return out


def resolve_preemptions(faults: list[Fault], events: list[PodEvent]) -> None:
    """The victims of each preemption fault: pods on its node the scheduler marked, after the fault."""
    marked: dict[str, PodEvent] = {}
    for ev in events:
        if ev.job and ev.disruption == "PreemptionByScheduler" and ev.uid not in marked:
            marked[ev.uid] = ev
    taken: set[str] = set()
    for f in sorted((f for f in faults if f.kind == "preemption"), key=lambda f: f.t):
        victims = [ev for ev in marked.values() if ev.uid not in taken and ev.node == f.detail.get("node")
                   and f.t <= ev.t <= f.t + 60]
        for ev in victims:
            taken.add(ev.uid)
            f.targets.append((ev.job, ev.owner or "", ev.attempt))
        f.detail["victims"] = sorted(ev.name for ev in victims)


def per_kind(faults: list[Fault], trans: list[dict]) -> dict[str, dict]:
    out = {k: {"injected": 0, "restarts": 0, "steps_lost": [], "lost_in_outage": 0} for k in KINDS}
    for f in faults:
        out[f.kind]["injected"] += 1
    for t in trans:
        if t["cause"] in out:
            out[t["cause"]]["restarts"] += 1
            out[t["cause"]]["steps_lost"].append(t["lost"])
            out[t["cause"]]["lost_in_outage"] += t["lost"] if t["s3_outage_in_window"] else 0
    return out


# --------------------------------------------------------------------------- report


def report(chaos: Chaos, cleanup: dict, wall_s: float) -> dict:
    events = chaos.timeline.snapshot()
    resolve_preemptions(chaos.faults, events)
    logs = chaos.tailer.by_pod()
    within, across = api_overlaps(events)
    dups = duplicate_pods(events)
    # Two attempts of one job object alive at once (must not happen) vs. a re-created job's new pods
    # running beside the deleted incarnation's last ones (item "same name, new job": their writes must lose).
    procs = [o for o in chaos.sampler.overlaps if len({a.split("/")[0] for a in o["attempts"]}) == 1]
    cross = [o for o in chaos.sampler.overlaps if len({a.split("/")[0] for a in o["attempts"]}) > 1]
    cross_s: dict[str, float] = defaultdict(float)
    for o in cross:
        cross_s[o["job"]] += chaos.sampler.interval
    # Processes that outlived their pod object: last seen alive after the pod's DELETED event.
    deleted_at = {ev.uid[:8]: ev.t for ev in events if ev.type == "DELETED" and ev.job}
    ghosts = sorted(((chaos.sampler.last_alive[u] - t), u) for u, t in deleted_at.items()
                    if u in chaos.sampler.last_alive and chaos.sampler.last_alive[u] > t + 1.0)
    atts = attempts_of(events, logs)
    trans = transitions(atts, chaos.faults)
    disagreements = [{"job": a.job, "attempt": f"{a.owner[:8]}/a{a.attempt}", "steps": a.restored_steps}
                     for seq in atts.values() for a in seq if len(a.restored_steps) > 1]
    kinds = per_kind(chaos.faults, trans)
    checks = chaos.verifier.checks
    bad = [c for c in checks if c.verdict in ("incomplete", "mismatched")]
    unverified = [c for c in checks if c.verdict == "unverified"]
    corrupt = sorted({c for log in logs.values() for c in log.corrupt})
    not_committed = sorted({c for log in logs.values() for c in log.not_committed})
    # Jobs: the final incarnation's phase, and its final model in S3 (seen by the auditor).
    finals = {r["job"]: r for r in chaos.auditor.archive.values() if r["folder"] == "final"}
    jobs = {}
    for name, info in chaos.jobs.items():
        st = info["status"]
        final = finals.get(name)
        jobs[name] = {"nodes": info["nodes"], "incarnations": len(info["incarnations"]), "phase": st.get("phase"),
                      "attempt": st.get("attempt"), "preemptions": st.get("preemptions"),
                      "failures": st.get("failures"), "message": (st.get("message") or "")[:300],
                      "last_checkpoint": (st.get("lastCheckpoint") or {}).get("step"),
                      "final_model_step": final["step"] if final else None}
    succeeded = [n for n, j in jobs.items() if j["phase"] == "Succeeded"]
    with_final = [n for n in succeeded if jobs[n]["final_model_step"] == chaos.args.max_steps]
    op_kills = [f for f in chaos.faults if f.kind == "operator-kill"]
    # A kill survived when the operator came back healthy, or was killed again (by the next fault) while
    # it started: that restart is then judged with the next kill. The run's end checks the last one.
    survived = [f for f in op_kills if f.detail.get("healthy_after_s") is not None
                or f.detail.get("killed_again_while_starting")]
    out = {
        "config": {k: v for k, v in vars(chaos.args).items()}, "namespace": chaos.namespace, "wall_s": round(wall_s),
        "jobs_total": len(jobs), "jobs_succeeded": len(succeeded), "jobs_with_final_model": len(with_final),
        "jobs_failed": sorted(n for n, j in jobs.items() if j["phase"] == "Failed"),
        "jobs_unfinished": sorted(n for n, j in jobs.items() if j["phase"] not in ("Succeeded", "Failed")),
        "restores": len(checks), "restores_ok": sum(c.verdict == "ok" for c in checks),
        "restores_incomplete_or_mismatched": [dataclasses.asdict(c) for c in bad],
        "restores_unverified": [dataclasses.asdict(c) for c in unverified],
        "corrupt_checkpoints_refused_by_trainer": corrupt, "commits_refused_in_trainer_logs": not_committed,
        "overlapping_attempts_api": within, "overlapping_incarnations_api": across,
        "overlapping_attempts_processes": procs,
        "incarnations_running_together_s": {k: round(v, 1) for k, v in sorted(cross_s.items())},
        "processes_outliving_their_pod": [{"uid8": u, "seconds": round(s, 1)} for s, u in ghosts],
        "duplicate_pods": dups, "restore_disagreements": disagreements, "pod_watch_gaps": chaos.timeline.gaps,
        "operator_kills": len(op_kills), "operator_restarts_survived": len(survived),
        "operator_unexpected_exits": chaos.operator.unexpected_exits,
        "faults_injected": len(chaos.faults),
        "per_kind": {k: {"injected": v["injected"], "restarts": v["restarts"], "steps_lost_total": sum(v["steps_lost"]),
                         "steps_lost_max": max(v["steps_lost"], default=0),
                         "steps_lost_with_s3_down": v["lost_in_outage"]} for k, v in kinds.items()},
        "restarts_without_injected_fault": [t for t in trans if t["cause"] == "no injected fault"],
        "transitions": trans,
        "faults": [{**dataclasses.asdict(f), "t": chaos.rel(f.t), "end": chaos.rel(f.end) if f.end else None,
                    "targets": [(j, o[:8], a) for j, o, a in f.targets]} for f in chaos.faults],
        "jobs": jobs, "cleanup": cleanup, "s3_auditor_errors": chaos.auditor.errors,
        "manifests_audited": len(chaos.auditor.archive),
        "manifests_bad_in_s3": [{k: r[k] for k in ("job", "folder", "step", "attempt", "detail", "incomplete")}
                                for r in chaos.auditor.archive.values() if r["verdict"] == "bad" or r["incomplete"]],
    }
    return out


def print_table(r: dict) -> None:
    def row(label: str, value: Any, must_zero: bool = False) -> None:
        flag = ""
        if must_zero:
            flag = "  ok" if value in (0, "0") else "  <-- must be 0"
        print(f"  {label:<58} {value}{flag}")

    c = r["config"]
    print(f"\n=== chaos: {r['jobs_total']} jobs on {c['agents']} agents x {c['slots']} slots, "
          f"{r['faults_injected']} faults (target {c['faults']}), seed {c['seed']}, {r['wall_s']} s ===")
    row("jobs finished (Succeeded) / total", f"{r['jobs_succeeded']} / {r['jobs_total']}")
    row("  ... with their final model at max_steps in S3", r["jobs_with_final_model"])
    if r["jobs_failed"]:
        row("  failed", ", ".join(f"{n}: {r['jobs'][n]['message'][:80]}" for n in r["jobs_failed"]))
    if r["jobs_unfinished"]:
        row("  unfinished at the deadline", ", ".join(r["jobs_unfinished"]))
    row("checkpoint restores checked (ok / all)", f"{r['restores_ok']} / {r['restores']}")
    row("restores of incomplete or mismatched checkpoints", len(r["restores_incomplete_or_mismatched"]), True)
    row("  restores that could not be verified", len(r["restores_unverified"]))
    row("  corrupt checkpoints the trainer refused at restore", len(r["corrupt_checkpoints_refused_by_trainer"]))
    row("  manifests audited in S3 / bad", f"{r['manifests_audited']} / {len(r['manifests_bad_in_s3'])}")
    row("overlapping attempts (pod watch)", len(r["overlapping_attempts_api"]), True)
    row("overlapping attempts (trainer processes, /proc samples)", len(r["overlapping_attempts_processes"]), True)
    row("  re-created job's pods ADDED beside the old incarnation's", len(r["overlapping_incarnations_api"]))
    together = r["incarnations_running_together_s"]
    row("  ... its processes running beside the old one's (jobs, max s)",
        f"{len(together)}, {max(together.values(), default=0):.1f}")
    row("  processes alive > 1 s after their pod was deleted", len(r["processes_outliving_their_pod"]))
    row("duplicate pods", len(r["duplicate_pods"]), True)
    row("attempts whose nodes restored different steps", len(r["restore_disagreements"]), True)
    row("operator SIGKILL restarts survived", f"{r['operator_restarts_survived']} / {r['operator_kills']}"
        + ("" if r["cleanup"].get("operator_healthy_at_end", True) else " (NOT healthy at the end)")
        + (f" ({len(r['operator_unexpected_exits'])} exits by itself)" if r["operator_unexpected_exits"] else ""))
    row("restarts with no injected fault to blame", len(r["restarts_without_injected_fault"]))
    print(f"\n  {'fault':<16}{'injected':>9}{'restarts':>10}{'steps lost':>12}{'max':>6}{'  of them while S3 was down':>28}")
    for k, v in r["per_kind"].items():
        print(f"  {k:<16}{v['injected']:>9}{v['restarts']:>10}{v['steps_lost_total']:>12}{v['steps_lost_max']:>6}"
              f"{v['steps_lost_with_s3_down']:>28}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--faults", type=int, default=60, help="faults to inject while jobs run")
    ap.add_argument("--seed", type=int, default=1, help="seeds the RNG that draws fault kinds, targets, job sizes")
    ap.add_argument("--duration", type=float, default=1500, help="hard limit of the whole run in seconds")
    ap.add_argument("--fault-interval", type=float, default=10, help="mean seconds between faults")
    ap.add_argument("--kind-wait", type=float, default=30,
                    help="seconds a drawn fault kind waits for a target before another kind goes instead")
    ap.add_argument("--outage-seconds", type=float, default=60, help="length of an S3 outage")
    ap.add_argument("--agents", type=int, default=2, help="test node agents (Nodes)")
    ap.add_argument("--slots", type=int, default=3, help="training pods per agent (its cpu capacity)")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2], help="job sizes (nodes) to draw from")
    ap.add_argument("--max-steps", type=int, default=500)
    ap.add_argument("--save-steps", type=int, default=40)
    ap.add_argument("--hunt-seconds", type=float, default=45,
                    help="how long a trainer-kill waits for an upload before it kills anyway")
    ap.add_argument("--teardown-reserve", type=float, default=90, help="seconds of --duration kept for clean-up")
    ap.add_argument("--run-dir", default=None, help="logs and agent state (default /tmp/kubetrain-chaos-<tag>)")
    ap.add_argument("--out", default=None, help="JSON report path (default <run-dir>/report.json)")
    ap.add_argument("--keep-s3", action="store_true", help="leave the checkpoints in MinIO")
    args = ap.parse_args()
    if args.agents < 1 or args.slots < 1 or args.agents * args.slots < max(args.nodes):
        ap.error("--agents x --slots must fit the largest job (--nodes)")
    if args.jobs < 1 or args.faults < 0 or args.max_steps < 1 or args.save_steps < 1:
        ap.error("--jobs, --max-steps and --save-steps must be >= 1, --faults >= 0")

    def on_term(signum, frame):  # clean up on SIGTERM as on Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    chaos = Chaos(args)
    t0 = now()
    cleanup: dict = {}
    try:
        chaos.setup()
        chaos.run()
    except KeyboardInterrupt:
        chaos.say("interrupted: cleaning up")
    finally:
        cleanup = chaos.teardown()
    if getattr(chaos, "timeline", None) is None:
        return 1
    r = report(chaos, cleanup, now() - t0)
    out = Path(args.out or chaos.run_dir / "report.json")
    out.write_text(json.dumps(r, indent=1, default=str))
    print_table(r)
    print(f"\nreport: {out}   logs: {chaos.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
