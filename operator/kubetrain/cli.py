"""`kubetrain` command line: `kubetrain operator run` runs the controller in-process.

Settings come from the environment (see `config.py`) and may be overridden by
flags; they are validated before anything connects to the cluster, and a bad
value exits with status 2 and a message naming the setting.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

from kubetrain.config import ConfigError, Settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubetrain", description="Kubernetes-native training operator")
    sub = parser.add_subparsers(dest="command", required=True)
    op = sub.add_parser("operator", help="the TrainingJob controller")
    op_sub = op.add_subparsers(dest="action", required=True)
    run = op_sub.add_parser("run", help="run the controller in the foreground (kopf, standalone)")
    run.add_argument("--namespace", action="append", default=None,
                     help="watch this namespace (repeatable); overrides KUBETRAIN_NAMESPACES")
    run.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    run.add_argument("--log-level", default=None, help="overrides KUBETRAIN_LOG_LEVEL")
    run.add_argument("--liveness", default=None, metavar="URL",
                     help="serve kopf's health endpoint, e.g. http://0.0.0.0:8080/healthz")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    env = dict(os.environ)
    if args.namespace:
        env["KUBETRAIN_NAMESPACES"] = ",".join(args.namespace)
    if args.all_namespaces:
        env["KUBETRAIN_NAMESPACES"] = ""
    if args.log_level:
        env["KUBETRAIN_LOG_LEVEL"] = args.log_level
    try:
        settings = Settings.from_env(env)
    except ConfigError as exc:
        print(f"kubetrain: {exc}", file=sys.stderr)
        return 2
    return run_operator(settings, liveness=args.liveness)


def run_operator(settings: Settings, *, liveness: str | None = None) -> int:
    import kopf

    import kubetrain.handlers  # noqa: F401  (registers the handlers)

    kopf.configure(debug=settings.log_level == "DEBUG", verbose=settings.log_level == "DEBUG",
                   quiet=settings.log_level in ("WARNING", "ERROR"))
    logging.getLogger().setLevel(settings.log_level)
    logging.getLogger("kubetrain").setLevel(settings.log_level)
    if settings.log_level != "DEBUG":  # "Handler 'pod_event' succeeded." on every watch event
        logging.getLogger("kopf.objects").setLevel("WARNING")
    kopf.run(
        standalone=True,
        clusterwide=settings.clusterwide,
        namespaces=settings.namespaces,
        liveness_endpoint=liveness,
        memo=kopf.Memo(settings=settings),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
