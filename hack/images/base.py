"""The Debian bookworm base image, bootstrapped from Debian packages with ``mmdebstrap``.

No image registry is reachable from CI, so the Dockerfile's public bases
(``python:3.11-slim-bookworm``) are replaced by this image through build args. It carries what
the public base carries: Debian bookworm with CPython 3.11 (Debian's ``python3`` is 3.11.2), its
headers (Triton compiles a launcher that includes ``Python.h``), ``venv`` and CA certificates.
The recipe's hash names the image, so a changed recipe builds a new base and an unchanged one
is reused from buildah's storage.
"""
from __future__ import annotations

import hashlib
import subprocess
import tempfile
from pathlib import Path

from .tools import image_exists, log, run

SUITE = "bookworm"
PACKAGES = ("python3", "python3-venv", "python3-dev", "ca-certificates")
# Documentation and translations are dropped, as in the slim public images.
DPKG_OPTS = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/doc/*",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/info/*",
)
REPOSITORY = "localhost/shardline-base"


def base_tag() -> str:
    """``localhost/shardline-base:bookworm-<recipe hash>``."""
    recipe = "\n".join((SUITE, *PACKAGES, *DPKG_OPTS))
    return f"{REPOSITORY}:{SUITE}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def ensure_base() -> str:
    """Return the base image's name, bootstrapping it on a miss (about 2-4 minutes).

    Raises subprocess.CalledProcessError when mmdebstrap or buildah fails.
    """
    tag = base_tag()
    if image_exists(tag):
        log(f"base {tag}: cached")
        return tag
    with tempfile.TemporaryDirectory(prefix="shardline-base-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        cmd = ["nice", "-n", "10", "mmdebstrap", "--variant=apt", "--quiet",
               f"--include={','.join(PACKAGES)}"]
        cmd += [f"--dpkgopt={opt}" for opt in DPKG_OPTS]
        run(cmd + [SUITE, str(rootfs)], f"mmdebstrap {SUITE}")
        container = run(["buildah", "from", "scratch"], "buildah from scratch").strip()
        try:
            run(["buildah", "add", container, str(rootfs), "/"], "add the root file system")
            run(["buildah", "config", "--env",
                 "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "--cmd", "/bin/bash", container], "configure the base")
            run(["buildah", "commit", "--rm", container, tag], f"commit {tag}")
        except BaseException:
            subprocess.run(["buildah", "rm", container], capture_output=True, check=False)
            raise
    return tag
