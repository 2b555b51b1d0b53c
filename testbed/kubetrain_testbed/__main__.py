"""Command line of the testbed: `python -m kubetrain_testbed up|down|status|env`.

scripts/testbed.sh is a thin wrapper around this. Exit codes: 0 done,
1 the testbed could not be brought to the requested state, 2 bad usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time

from .cluster import down, up
from .state import load_env, status
from .config import TestbedConfig
from .procs import TestbedError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="testbed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up_p = sub.add_parser("up", help="build what is missing, start (or reuse) the testbed, write .testbed/env")
    up_p.add_argument("--nodes", choices=("kwok", "real"), default=None,
                      help="real: also run a kubelet + containerd node whose pods are containers")
    up_p.add_argument("--kueue", action="store_true",
                      help="also run Kueue (built on first use; testbed/README.md), or add it to the running testbed")
    up_p.add_argument("--kueue-pods-ready-timeout", metavar="DURATION", default=None,
                      help="Kueue's waitForPodsReady timeout (Go duration; default 30s, or "
                           "KUBETRAIN_TESTBED_KUEUE_PODS_READY_TIMEOUT)")
    img_p = sub.add_parser("images", help="build the operator and trainer images from their Dockerfiles and push "
                                           "them to the real node's registry (needs `up --nodes real`)")
    img_p.add_argument("names", nargs="*", metavar="operator|trainer", help="default: both")
    img_p.add_argument("--build-only", action="store_true",
                       help="build into buildah's store without pushing (no running testbed needed)")
    img_p.add_argument("--keep-old", action="store_true",
                       help="keep older builds in the caches (by default they are removed: testbed/README.md)")
    sub.add_parser("down", help="stop every testbed process")
    sub.add_parser("status", help="say what runs and whether it is healthy")
    sub.add_parser("env", help="print the export lines of .testbed/env (contains credentials)")
    args = parser.parse_args(argv)
    cfg = TestbedConfig.from_environ()
    if getattr(args, "nodes", None) == "real":
        cfg = dataclasses.replace(cfg, real_node=True)
    if getattr(args, "kueue", False) or getattr(args, "kueue_pods_ready_timeout", None):
        settings = cfg.kueue_settings
        if args.kueue_pods_ready_timeout:
            settings = dataclasses.replace(settings, pods_ready_timeout=args.kueue_pods_ready_timeout)
        cfg = dataclasses.replace(cfg, kueue=True, kueue_settings=settings)
    try:
        if args.command == "up":
            t0 = time.monotonic()
            env = up(cfg)
            print(f"testbed up in {time.monotonic() - t0:.1f} s: API {env.api_server}, S3 {env.s3_endpoint}")
            print(f"use it with: source {cfg.env_file}")
        elif args.command == "images":
            from .cluster import _real_node_layout
            from .images import main as build_images
            from .realnode import real_node_bin_dir

            if not args.build_only and not load_env(cfg).registry:
                raise TestbedError("no real node is running: `scripts/testbed.sh up --nodes real` first")
            layout = _real_node_layout(cfg, real_node_bin_dir(cfg.build_script))
            names = tuple(args.names) or ("operator", "trainer")
            if set(names) - {"operator", "trainer"}:
                parser.error(f"images: unknown image(s) {', '.join(sorted(set(names) - {'operator', 'trainer'}))}")
            return build_images(layout, cfg.run_dir / "images.log", names, push=not args.build_only,
                                prune_old=not args.keep_old)
        elif args.command == "down":
            survivors = down(cfg)
            if survivors:
                print(f"could not stop: {', '.join(survivors)}", file=sys.stderr)
                return 1
            print("testbed down")
        elif args.command == "status":
            rows = status(cfg)
            if not rows:
                print("testbed not running")
                return 1
            for r in rows:
                state = "healthy" if r.healthy else ("running, unhealthy" if r.alive else "dead")
                print(f"{r.name:<24} pid {r.pid:<8} {state} ({r.detail})")
            return 0 if all(r.healthy for r in rows) else 1
        elif args.command == "env":
            for k, v in load_env(cfg).as_environ().items():
                print(f"export {k}={shlex.quote(v)}")
            print('export PATH="$KUBETRAIN_TESTBED_BIN:$PATH"')
    except TestbedError as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
