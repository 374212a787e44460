"""Shell entry point.

    python3 -m hack.localcluster build            # build or reuse the cached binaries
    python3 -m hack.localcluster up [--dir DIR]   # start; prints `export KUBECONFIG=...`
    python3 -m hack.localcluster up --real-node   # a real kubelet + containerd node
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
    b = sub.add_parser("build", help="build (or reuse) etcd, kube-*, helm in the cache")
    b.add_argument("--node", action="store_true", help="also kubelet, kube-proxy, crictl, coredns")
    for name in ("up", "down"):
        s = sub.add_parser(name)
        s.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="state directory")
        if name == "up":
            s.add_argument("--real-node", action="store_true",
                           help="run a real node (kubelet, containerd, runc) with the images "
                                "`make images` built")
    args = p.parse_args(argv)
    if args.command == "build":
        names = build.ALL_BINARIES + (build.NODE_BINARIES if args.node else ())
        print(build.ensure_binaries(names=names))
        return 0
    if args.command == "up":
        if (args.dir / "state.json").exists():
            print(f"{args.dir} holds a cluster; run `down --dir {args.dir}` first",
                  file=sys.stderr)
            return 1
        images: dict[str, Path] = {}
        if args.real_node:
            from hack.images.build import ensure_images, image_name

            build.ensure_binaries(names=build.ALL_BINARIES + build.NODE_BINARIES)
            images = {image_name(t): a for t, a in ensure_images().items()}
        cluster = LocalCluster(state_dir=args.dir, real_node=args.real_node,
                               images=images).start()
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
