"""``make images``: build (or reuse) both images and import them into containerd.

    python3 -m hack.images                          # build or reuse; import when a socket is up
    python3 -m hack.images --address SOCK           # import into that containerd
    python3 -m hack.images --no-import              # build the archives only

Prints one line per target: name, archive, size in MB, and how long the step took.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from .build import TARGETS, ensure_images, image_name, image_size, import_images

DEFAULT_ADDRESS = "/run/containerd/containerd.sock"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m hack.images", description=__doc__.split("\n")[0])
    p.add_argument("--target", choices=TARGETS, action="append",
                   help="build only this target (repeatable; default: both)")
    p.add_argument("--address", default=os.environ.get("CONTAINERD_ADDRESS", DEFAULT_ADDRESS),
                   help="containerd socket to import into (default: %(default)s)")
    p.add_argument("--no-import", action="store_true", help="build the archives only")
    args = p.parse_args(argv)
    started = time.monotonic()
    archives = ensure_images(tuple(args.target or TARGETS))
    built = time.monotonic() - started
    for target, archive in archives.items():
        print(f"{image_name(target)}\t{archive}\t{image_size(archive) / 1e6:.0f} MB")
    print(f"build: {built:.0f} s")
    if args.no_import:
        return 0
    if not os.path.exists(args.address):
        print(f"no containerd socket at {args.address}: not imported (the node imports the "
              "archives when it starts)", file=sys.stderr)
        return 0
    import_images(archives, args.address)
    print(f"build and import: {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
