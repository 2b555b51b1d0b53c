"""Checkpoint upload/download throughput of kubetrain's S3 path vs boto3's TransferManager, on MinIO.

Issue 12 section 3. A private MinIO (the testbed's binary, its own free port on 127.0.0.1 and a
temporary data folder; the shared testbed is not touched) holds the bytes. Two checkpoint shapes
of `--size` bytes (default 1 GiB):

- many: `size / 16 MiB` files of 16 MiB plus a few small json files (a DDP / HF checkpoint);
- one: a single file of `size` bytes (one big `model.safetensors`).

Each direction is timed twice on the same bytes in the same run:

- kubetrain: upload = the commit protocol (`commit.CommitProtocol.run`: the xxh128 digest of every file,
  list, per-file upload with the claims fence, manifest last), download = `restore.restore_newest`
  (list, manifest, download with every file's xxh128 computed part by part as its bytes land, rename into
  place): what the launcher does;
- raw: one `s3transfer` TransferManager (boto3's own) with a tuned TransferConfig
  (max_concurrency 16, 32 MiB parts, a 16-connection pool), every file submitted at once, no hashing.

Each transfer runs in its own child process (so its peak RSS is its own), kubetrain and raw
alternate (A B, B A, ...), and a ratio is raw seconds / kubetrain seconds within one round
(kubetrain's share of raw throughput; goal >= 0.9x), reported as median and range over rounds.
Peak RSS of kubetrain's upload process is also measured at `--rss-sizes` (goal <= 256 MiB at any
size), and the download's in every round (parts that land early wait in memory for the hash). Last, a 2-node sharded FSDP-layout checkpoint is committed by two nodes (node parts, then
the manifest) and restored once per node: bytes each node downloads vs the bytes its ranks' shards
and the shared files take. Prints figures; not a test.

    python benchmarks/s3_throughput.py [--size 1024] [--rounds 2] [--rss-sizes 256,2048] [--shapes many,one]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

MiB = 1 << 20
FILE_MB = 16
BUCKET = "bench"
SMALL_FILES = ("config.json", "trainer_state.json", "generation_config.json", "tokenizer_config.json")
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ MinIO


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _minio_binary() -> Path:
    explicit = os.environ.get("KUBETRAIN_MINIO_BIN")
    if explicit:
        return Path(explicit)
    out = subprocess.run([str(ROOT / "testbed" / "build.sh"), "--print"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip()) / "minio"


class Minio:
    def __init__(self, work: Path) -> None:
        self.port = _free_port()
        self.user, self.password = "bench", "bench-" + secrets.token_hex(8)
        data = work / "minio-data"
        data.mkdir()
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(work), "MINIO_ROOT_USER": self.user,
               "MINIO_ROOT_PASSWORD": self.password, "MINIO_BROWSER": "off", "MINIO_UPDATE": "off"}
        self.log = open(work / "minio.log", "ab")
        self.proc = subprocess.Popen(
            [str(_minio_binary()), "server", "--quiet", f"--address=127.0.0.1:{self.port}",
             f"--console-address=127.0.0.1:{_free_port()}", str(data)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/minio/health/live", timeout=1)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"MinIO did not start (see {work / 'minio.log'})") from None
                time.sleep(0.2)
        _client(self.endpoint, self.env).create_bucket(Bucket=BUCKET)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.user, "AWS_SECRET_ACCESS_KEY": self.password, "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.endpoint}

    def client_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _client(endpoint: str, env: dict[str, str] | None = None, pool: int = 10):
    import boto3
    from botocore.config import Config

    env = env or dict(os.environ)
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        config=Config(max_pool_connections=pool, s3={"addressing_style": "path"}))


# ------------------------------------------------------------------ checkpoints on disk


def _write(path: Path, size: int, block: bytes, tag: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        left = size
        i = 0
        while left > 0:
            chunk = block[: min(left, len(block))]
            head = tag + i.to_bytes(8, "little")  # every block differs (no dedupe anywhere)
            fh.write(head + chunk[len(head):])
            left -= len(chunk)
            i += 1


def make_checkpoint(folder: Path, shape: str, size: int) -> int:
    """A complete local checkpoint folder of `size` bytes; returns its byte count."""
    block = os.urandom(4 * MiB)
    if shape == "many":
        n = max(1, size // (FILE_MB * MiB))
        for i in range(n):
            _write(folder / f"model-{i:05d}-of-{n:05d}.safetensors", FILE_MB * MiB, block, f"m{i:07d}".encode())
    else:
        _write(folder / "model.safetensors", size, block, b"one")
    for name in SMALL_FILES:
        (folder / name).write_text(json.dumps({"name": name, "global_step": 1, "log_history": []}))
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# ------------------------------------------------------------------ child processes (one transfer each)


def _store(uri: str):
    from kubetrain_trainer.storage import CheckpointStore, StorageConfig

    return CheckpointStore(StorageConfig.from_env({**os.environ, "KUBETRAIN_CHECKPOINT_URI": uri}))


def child_kt_upload(folder: Path, uri: str, step: int) -> dict:
    from kubetrain_trainer.commit import ClaimsFence, CommitProtocol, SyncSettings, UploadJob

    store = _store(uri)
    settings = SyncSettings(attempt=1, world_size=1, strategy="ddp", fence_check_interval_s=1.0)
    protocol = CommitProtocol(store, settings, fence=ClaimsFence(store, settings), stopped=threading.Event(),
                              newer_waiting=lambda: False)
    t0 = time.perf_counter()
    outcome = protocol.run(UploadJob(step=step, folder=folder))
    seconds = time.perf_counter() - t0
    assert outcome.action == "committed", outcome
    return {"seconds": seconds, "bytes": outcome.size_bytes}


def child_kt_download(dest: Path, uri: str, step: int) -> dict:
    from kubetrain_trainer.restore import restore_newest

    store = _store(uri)
    t0 = time.perf_counter()
    restored = restore_newest(store, dest, deadline=time.monotonic() + 600)
    seconds = time.perf_counter() - t0
    assert restored.committed is not None and restored.committed.step == step, restored
    got = sum(p.stat().st_size for p in restored.path.rglob("*") if p.is_file() and p.name != "manifest.json")
    return {"seconds": seconds, "bytes": got}


def _raw_manager():
    from boto3.s3.transfer import TransferConfig
    from s3transfer.manager import TransferManager

    client = _client(os.environ["AWS_ENDPOINT_URL"], pool=16)
    config = TransferConfig(max_concurrency=16, multipart_threshold=32 * MiB, multipart_chunksize=32 * MiB)
    return client, TransferManager(client, config)


def child_raw_upload(folder: Path, prefix: str) -> dict:
    client, manager = _raw_manager()
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    t0 = time.perf_counter()
    with manager:
        futures = [manager.upload(str(p), BUCKET, f"{prefix}/{p.relative_to(folder).as_posix()}") for p in files]
        for f in futures:
            f.result()
    return {"seconds": time.perf_counter() - t0, "bytes": sum(p.stat().st_size for p in files)}


def child_raw_download(dest: Path, prefix: str) -> dict:
    client, manager = _raw_manager()
    t0 = time.perf_counter()
    keys = [(o["Key"], o["Size"]) for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Prefix=prefix + "/") for o in page.get("Contents", []) if not o["Key"].endswith("manifest.json")]
    with manager:
        futures = []
        for key, _ in keys:
            target = dest / key[len(prefix) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            futures.append(manager.download(BUCKET, key, str(target)))
        for f in futures:
            f.result()
    return {"seconds": time.perf_counter() - t0, "bytes": sum(s for _, s in keys)}


def child_main(argv: list[str]) -> None:
    mode, path, where = argv[0], Path(argv[1]), argv[2]
    step = int(argv[3]) if len(argv) > 3 else 1
    import logging

    logging.basicConfig(level=logging.WARNING)
    out = {"kt-up": lambda: child_kt_upload(path, where, step), "kt-down": lambda: child_kt_download(path, where, step),
           "raw-up": lambda: child_raw_upload(path, where), "raw-down": lambda: child_raw_download(path, where)}[mode]()
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(json.dumps(out))


def run_child(minio: Minio, *args: str) -> dict:
    # Every transfer starts with no writeback in flight: none pays for the dirty pages the previous one left
    # (MinIO's files, or the downloaded copy). That alone did not remove the order effect (`_balanced`).
    os.sync()
    time.sleep(0.5)
    proc = subprocess.run([sys.executable, __file__, "--child", *args], env=minio.client_env(), capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"child {args[0]} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ the sharded restore


def sharded_restore(minio: Minio, work: Path, size: int) -> list[dict]:
    """2 nodes x 1 rank, the FSDP layout `strategies/dcp_files.RankFilesWriter` writes: per DCP folder each
    rank's proper shards in `__<r>_0.distcp`, what every rank loads in `__<r>_shared.distcp`, node rank 0's
    `.metadata` and rank-files record; per-rank rng state; shared small files. Each node commits its own
    files through the protocol (node parts, then node rank 0's manifest), then each node restores it as
    the launcher does (`NodeRanks` of its node), into its own folder."""
    import threading as th

    from kubetrain_trainer.commit import ClaimsFence, CommitProtocol, SyncSettings, UploadJob
    from kubetrain_trainer.layout import RANK_FILES_NAME
    from kubetrain_trainer.rank_files import NodeRanks, RankFiles
    from kubetrain_trainer.restore import restore_newest

    uri = f"s3://{BUCKET}/sharded"
    os.environ.update(minio.env)
    block = os.urandom(4 * MiB)
    nodes = 2
    record = RankFiles(world_size=nodes, private={r: (f"__{r}_0.distcp",) for r in range(nodes)}).to_json()
    folders, own = [], []
    for r in range(nodes):
        f = work / f"node-{r}" / "checkpoint-5"
        mine = [f"pytorch_model_fsdp_0/__{r}_0.distcp", f"optimizer_0/__{r}_0.distcp"]
        _write(f / mine[0], size // 3, block, f"mdl{r}".encode())
        _write(f / mine[1], 2 * size // 3, block, f"opt{r}".encode())
        for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
            _write(f / sub / f"__{r}_shared.distcp", 32 << 10, block, f"{sub}{r}".encode())
        _write(f / f"rng_state_{r}.pth", 16 << 10, block, f"rng{r}".encode())
        if r == 0:  # node rank 0 writes the shared files (DCP metadata and the records, scheduler, trainer state)
            for name in ("pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", "scheduler.pt",
                         "trainer_state.json"):
                _write(f / name, 64 << 10, block, name.encode())
            for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
                (f / sub / RANK_FILES_NAME).write_bytes(record)
        folders.append(f)
        own.append(sum((f / m).stat().st_size for m in mine))
    total = sum(p.stat().st_size for f in folders for p in f.rglob("*") if p.is_file())
    errors: list[BaseException] = []

    def commit(r: int) -> None:
        try:
            store = _store(uri)
            s = SyncSettings(attempt=1, world_size=nodes, strategy="fsdp", node_rank=r, nnodes=nodes, part_wait_s=120)
            CommitProtocol(store, s, fence=ClaimsFence(store, s), stopped=th.Event(),
                           newer_waiting=lambda: False).run(UploadJob(step=5, folder=folders[r]))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [th.Thread(target=commit, args=(r,)) for r in range(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    out = []
    for r in range(nodes):
        dest = work / f"restore-{r}"
        restored = restore_newest(_store(uri), dest, deadline=time.monotonic() + 600,
                                  node=NodeRanks.of(node_rank=r, nnodes=nodes, world_size=nodes))
        got = sum(p.stat().st_size for p in restored.path.rglob("*") if p.is_file() and p.name != "manifest.json")
        out.append({"node": r, "downloaded": got, "needed": total - sum(own) + own[r], "total": total})
        shutil.rmtree(dest)
    return out


def _print_throughput(args: argparse.Namespace, results: dict) -> None:
    print(f"\nkubetrain / raw TransferManager throughput (raw s / kubetrain s), median (range) of {args.rounds} "
          f"rounds, {args.size} MiB; goal >= 0.90x")
    print("The order in a round moves the ratio: the first upload and the second download of a round are the "
          "faster ones,\nwhichever client runs them. 'order-balanced' is the median over round pairs (kubetrain "
          "first, then raw first)\nof the geometric mean of the pair's two ratios, where that order effect cancels.")
    print("| shape | upload | upload, order-balanced | download | download, order-balanced | "
          "kubetrain peak RSS (MiB), upload / download |")
    print("|---|---|---|---|---|---|")
    for shape, r in results.items():
        files = "1 file" if shape == "one" else f"{r['bytes'] // (FILE_MB * MiB)} x {FILE_MB} MiB + {len(SMALL_FILES)} json"
        print(f"| {shape} ({files}) | {_fmt(r['up'])} | {_balanced(r['up'])} | {_fmt(r['down'])} | "
              f"{_balanced(r['down'])} | {max(r['rss']):.0f} / {max(r['rss_down']):.0f} |")


def _balanced(ratios: list[float]) -> str:
    """Rounds alternate the order (kubetrain first in even rounds): each pair's geometric mean cancels an
    effect of the order that scales both of its ratios alike."""
    pairs = [math.sqrt(a * b) for a, b in zip(ratios[0::2], ratios[1::2])]
    if not pairs:
        return "needs 2+ rounds"
    return _fmt(pairs) + (" (the last, unpaired round left out)" if len(ratios) % 2 else "")


# ------------------------------------------------------------------ main


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=1024, help="checkpoint MiB per shape (default 1024)")
    ap.add_argument("--rounds", type=int, default=2, help="an even number balances the order (default 2)")
    ap.add_argument("--shapes", default="many,one", help="'' = none (only the sharded restore)")
    ap.add_argument("--rss-sizes", default="256", help="extra MiB sizes for the upload peak RSS ('' = none)")
    ap.add_argument("--sharded-size", type=int, default=128, help="MiB per node of the sharded checkpoint (0 = skip)")
    ap.add_argument("--workdir", default=None, help="parent of the temporary folder (default: the system's)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops our MinIO
    size = args.size * MiB
    work = Path(tempfile.mkdtemp(prefix="kt-s3bench-", dir=args.workdir))
    free = shutil.disk_usage(work).free
    need = 4 * size + 3 * max([0, *[int(s) * MiB for s in args.rss_sizes.split(",") if s]])
    if free < need:
        raise SystemExit(f"{free / 2**30:.1f} GiB free under {work}, need about {need / 2**30:.1f} GiB")
    minio = Minio(work)
    print(f"MinIO on {minio.endpoint}, data in {work}; load {os.getloadavg()[0]:.1f}, {os.cpu_count()} cpus")
    results: dict = {}
    try:
        for shape in [s for s in args.shapes.split(",") if s]:
            src = work / f"src-{shape}" / "checkpoint-1"
            nbytes = make_checkpoint(src, shape, size)
            rounds, rss, rss_down, ratios_up, ratios_down = [], [], [], [], []
            for rnd in range(args.rounds):
                kt_prefix, raw_prefix = f"kt-{shape}-{rnd}", f"raw-{shape}-{rnd}"
                order = ("kt", "raw") if rnd % 2 == 0 else ("raw", "kt")
                t: dict = {}
                for who in order:  # uploads
                    if who == "kt":
                        t["kt-up"] = run_child(minio, "kt-up", str(src), f"s3://{BUCKET}/{kt_prefix}", "1")
                    else:
                        t["raw-up"] = run_child(minio, "raw-up", str(src), raw_prefix)
                # Downloads: each reads the objects its own upload wrote (same bytes). When both read the same
                # objects, the second read in a round was up to 2.8x faster than the first, whichever client
                # made it: the ratio measured the order (0.35x first, 1.4x second), not the code.
                for who in order:
                    dest = work / f"dl-{who}"
                    if who == "kt":
                        t["kt-down"] = run_child(minio, "kt-down", str(dest), f"s3://{BUCKET}/{kt_prefix}", "1")
                    else:
                        t["raw-down"] = run_child(minio, "raw-down", str(dest), raw_prefix)
                    shutil.rmtree(dest, ignore_errors=True)
                for k in ("kt-up", "raw-up", "kt-down", "raw-down"):
                    assert t[k]["bytes"] == nbytes, (k, t[k]["bytes"], nbytes)
                ratios_up.append(t["raw-up"]["seconds"] / t["kt-up"]["seconds"])
                ratios_down.append(t["raw-down"]["seconds"] / t["kt-down"]["seconds"])
                rounds.append(t)
                rss.append(t["kt-up"]["peak_rss_mib"])
                rss_down.append(t["kt-down"]["peak_rss_mib"])
                mbps = {k: nbytes / MiB / v["seconds"] for k, v in t.items()}
                print(f"  {shape} round {rnd + 1}: " + ", ".join(f"{k} {v:.0f} MiB/s" for k, v in mbps.items())
                      + f"; peak RSS kt-up {t['kt-up']['peak_rss_mib']:.0f} MiB, raw-up "
                        f"{t['raw-up']['peak_rss_mib']:.0f} MiB, kt-down {t['kt-down']['peak_rss_mib']:.0f} MiB, "
                        f"raw-down {t['raw-down']['peak_rss_mib']:.0f} MiB", flush=True)
            results[shape] = {"bytes": nbytes, "up": ratios_up, "down": ratios_down, "rss": rss, "rss_down": rss_down,
                              "rounds": rounds}
            shutil.rmtree(src.parent)
        rss_by_size: dict[str, list] = {}
        for extra in [int(s) for s in args.rss_sizes.split(",") if s]:
            for shape in [s for s in args.shapes.split(",") if s]:
                src = work / f"rss-{shape}-{extra}" / "checkpoint-1"
                make_checkpoint(src, shape, extra * MiB)
                r = run_child(minio, "kt-up", str(src), f"s3://{BUCKET}/rss-{shape}-{extra}", "1")
                rss_by_size.setdefault(shape, []).append((extra, r["peak_rss_mib"], extra / (r["seconds"] or 1)))
                shutil.rmtree(src.parent)
        sharded = sharded_restore(minio, work, args.sharded_size * MiB) if args.sharded_size else []
    finally:
        minio.stop()
        shutil.rmtree(work, ignore_errors=True)

    if results:
        _print_throughput(args, results)
    if rss_by_size:
        print("\nkubetrain upload peak RSS by checkpoint size (goal <= 256 MiB at any size)")
        for shape, rows in rss_by_size.items():
            cells = [f"{args.size} MiB: {max(results[shape]['rss']):.0f}"] if shape in results else []
            cells += [f"{s} MiB: {m:.0f}" for s, m, _ in rows]
            print(f"  {shape}: " + ", ".join(cells) + " (MiB)")
    if sharded:
        print(f"\nsharded restore, 2 nodes x 1 rank, FSDP layout, {sharded[0]['total'] / MiB:.0f} MiB in all")
        for s in sharded:
            print(f"  node {s['node']}: downloaded {s['downloaded'] / MiB:.0f} MiB; its own shards + shared files "
                  f"{s['needed'] / MiB:.0f} MiB")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
    else:
        main()
