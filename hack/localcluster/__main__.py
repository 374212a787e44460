"""Shell entry point.

    python3 -m hack.localcluster build            # build or reuse the cached binaries
    python3 -m hack.localcluster up [--dir DIR]   # start; prints `export KUBECONFIG=...`
    python3 -m hack.localcluster down [--dir DIR] # stop every process by its saved PID
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from . import build
from .control_plane import LocalCluster

DEFAULT_DIR = Path(tempfile.gettempdir()) / "shardline-cluster"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m hack.localcluster",
                                description="local Kubernetes 1.37.2 control plane")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build (or reuse) etcd, kube-*, helm in the cache")
    for name in ("up", "down"):
        s = sub.add_parser(name)
        s.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="state directory")
    args = p.parse_args(argv)
    if args.command == "build":
        print(build.ensure_binaries())
        return 0
    if args.command == "up":
        if (args.dir / "state.json").exists():
            print(f"{args.dir} holds a cluster; run `down --dir {args.dir}` first",
                  file=sys.stderr)
            return 1
        cluster = LocalCluster(state_dir=args.dir).start()
        print(f"export KUBECONFIG={cluster.kubeconfig}")
        print(f"export PATH={cluster.bin_dir}:$PATH   # helm")
        return 0
    state = args.dir / "state.json"
    if not state.exists():
        print(f"no cluster state in {args.dir}", file=sys.stderr)
        return 1
    LocalCluster.load(args.dir).stop()
    state.unlink()
    print(f"stopped the cluster in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
