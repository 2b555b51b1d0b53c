"""Command line of the testbed: `python -m kubetrain_testbed up|down|status|env`.

scripts/testbed.sh is a thin wrapper around this. Exit codes: 0 done,
1 the testbed could not be brought to the requested state, 2 bad usage.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from .cluster import down, load_env, status, up
from .config import TestbedConfig
from .procs import TestbedError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="testbed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="build what is missing, start (or reuse) the testbed, write .testbed/env")
    sub.add_parser("down", help="stop every testbed process")
    sub.add_parser("status", help="say what runs and whether it is healthy")
    sub.add_parser("env", help="print the export lines of .testbed/env (contains credentials)")
    args = parser.parse_args(argv)
    cfg = TestbedConfig.from_environ()
    try:
        if args.command == "up":
            t0 = time.monotonic()
            env = up(cfg)
            print(f"testbed up in {time.monotonic() - t0:.1f} s: API {env.api_server}, S3 {env.s3_endpoint}")
            print(f"use it with: source {cfg.env_file}")
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
