"""``shardline-operator``: run the Kopf operator with a liveness endpoint.

Works in a pod (in-cluster service account) and outside one (``KUBECONFIG``); Kopf logs in
with the same order of preference through the ``kubernetes`` package.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

import kopf


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardline-operator", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="Watch only this namespace (repeatable); default: all namespaces.",
    )
    parser.add_argument(
        "--liveness-endpoint",
        default=os.environ.get("SHARDLINE_LIVENESS_ENDPOINT", "http://127.0.0.1:8080/healthz"),
        help="URL the liveness endpoint listens on (in a pod: http://$(POD_IP):8080/healthz).",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("SHARDLINE_METRICS_PORT", "8081")),
        help="Port of the Prometheus /metrics endpoint (all addresses); 0 disables it.",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=30.0,
        help="Seconds between unprompted passes of an idle object (events and requeues "
        "trigger the others); at least 1.",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="Log level.",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run until interrupted; returns the process exit status."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.metrics_port <= 65535:
        parser.error(
            f"--metrics-port must be 0 (disabled) or a port in 1..65535, got {args.metrics_port}"
        )
    if not args.resync_seconds >= 1:
        parser.error(f"--resync-seconds must be at least 1, got {args.resync_seconds}")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level != "debug":
        # Kopf logs every handler run (each pod event) and aiohttp every probe.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    from . import (
        handlers,  # noqa: F401  (registers the handlers)
        metrics,
    )

    handlers.RESYNC_SECONDS = args.resync_seconds
    if args.metrics_port:
        try:
            metrics.serve(args.metrics_port)
        except OSError as exc:
            parser.error(f"--metrics-port {args.metrics_port}: cannot listen: {exc}")

    try:
        asyncio.run(
            kopf.operator(
                clusterwide=not args.namespace,
                namespaces=args.namespace,
                standalone=True,
                liveness_endpoint=args.liveness_endpoint,
            )
        )
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
