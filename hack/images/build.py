"""Build both Dockerfile targets with buildah, cache them, and import them into containerd.

``ensure_images()`` is what ``make images`` and the node fixture call:

1. the mmdebstrap base (:mod:`.base`) replaces the Dockerfile's public bases (build args);
2. the runtime's Python dependencies are fetched on the host into a wheelhouse with
   ``pip download`` (which reads the host's pip cache, so the torch wheels that ``make install``
   fetched are not downloaded again), and pip in the build finds them there (``PIP_FIND_LINKS``
   plus a read-only bind mount of the wheelhouse);
3. ``buildah bud --layers`` builds each target, then ``buildah push`` writes a docker-archive;
4. the archive is named by a hash of the build inputs (Dockerfile, pyproject, README, the
   operator and runtime sources, the base recipe), so an unchanged tree skips steps 1-3;
5. ``ctr -n k8s.io images import`` loads the archive into a containerd (the node's).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import tomllib

from .base import ensure_base
from .tools import log, run

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("operator", "runtime")
SOURCE_DIRS = ("operator", "runtime")
SOURCE_FILES = ("Dockerfile", ".dockerignore", "pyproject.toml", "README.md")
WHEELHOUSE_MOUNT = "/wheelhouse"


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def image_name(target: str) -> str:
    """The name ``make images`` gives a target, e.g. ``localhost/shardline-runtime:0.1.0``:
    the name the examples and the chart's default values use."""
    return f"localhost/shardline-{target}:{version()}"


def torch_version() -> str:
    """The Dockerfile's ``TORCH_VERSION`` build arg default."""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("ARG TORCH_VERSION="):
            return line.split("=", 1)[1].strip()
    raise RuntimeError("Dockerfile has no `ARG TORCH_VERSION=` line")


def cache_dir() -> Path:
    root = Path(os.environ.get("SHARDLINE_CACHE", Path.home() / ".cache" / "shardline"))
    return root / "images"


def inputs_hash(base: str) -> str:
    """sha256 (16 hex digits) over every file the build reads, and the base image's name."""
    digest = hashlib.sha256(base.encode())
    files = [ROOT / f for f in SOURCE_FILES]
    for d in SOURCE_DIRS:
        files += sorted(p for p in (ROOT / d).rglob("*") if p.is_file()
                        and "__pycache__" not in p.parts and p.suffix != ".pyc")
    for path in files:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def archive_path(target: str, digest: str) -> Path:
    return cache_dir() / f"shardline-{target}-{digest}.tar"


def _requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [f"torch=={torch_version()}", *project["dependencies"], *extras["runtime"],
            *extras["operator"], "setuptools>=68", "wheel"]


def fill_wheelhouse() -> Path:
    """``pip download`` every runtime and operator dependency into the wheelhouse (the build
    installs from it alone, ``PIP_NO_INDEX=1``); skipped when these requirements were fetched
    before (a marker file named by their hash)."""
    house = cache_dir() / "wheels"
    house.mkdir(parents=True, exist_ok=True)
    requirements = _requirements()
    marker = house / f".requirements-{hashlib.sha256(' '.join(requirements).encode()).hexdigest()[:12]}"
    if marker.exists():
        return house
    run([sys.executable, "-m", "pip", "download", "--quiet", "--progress-bar", "off",
         "--dest", str(house), *requirements], "fill the wheelhouse")
    marker.touch()
    return house


def build_target(target: str, base: str, house: Path, archive: Path) -> None:
    """``buildah bud`` one target and write its docker-archive to ``archive``."""
    name = image_name(target)
    run(["nice", "-n", "10", "buildah", "bud", "--layers", "--network", "host",
         "--target", target, "--tag", name,
         "--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", f"RUNTIME_BASE_IMAGE={base}",
         "--build-arg", f"PIP_FIND_LINKS={WHEELHOUSE_MOUNT}", "--build-arg", "PIP_NO_INDEX=1",
         "--volume", f"{house}:{WHEELHOUSE_MOUNT}:ro",
         "--file", str(ROOT / "Dockerfile"), str(ROOT)], f"build {name}", echo=True)
    partial = archive.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    run(["buildah", "push", name, f"docker-archive:{partial}:{name}"], f"export {name}")
    partial.replace(archive)
    for old in cache_dir().glob(f"shardline-{target}-*.tar"):
        if old != archive:
            old.unlink()


def ensure_images(targets: tuple[str, ...] = TARGETS) -> dict[str, Path]:
    """Build (or reuse) each target's archive; return ``{target: archive path}``.

    Raises subprocess.CalledProcessError naming the failing command (mmdebstrap, pip, buildah).
    """
    base = ensure_base()
    digest = inputs_hash(base)
    archives = {t: archive_path(t, digest) for t in targets}
    todo = [t for t, a in archives.items() if not a.exists()]
    if not todo:
        log(f"images {digest}: cached in {cache_dir()}")
        return archives
    house = fill_wheelhouse()
    for target in todo:
        build_target(target, base, house, archives[target])
    return archives


def import_archive(archive: Path, address: str, name: str | None = None) -> None:
    """Load a docker-archive into the containerd at ``address`` (namespace ``k8s.io``, the
    CRI's) unless an image labelled with this archive's file name is already there."""
    ctr = ["ctr", "--address", address, "-n", "k8s.io", "images"]
    label = f"shardline.archive={archive.stem}"
    listed = subprocess.run([*ctr, "ls", "-q", f"labels.\"shardline.archive\"=={archive.stem}"],
                            capture_output=True, text=True, check=False).stdout.split()
    if listed:
        log(f"{archive.name}: already in {address} as {', '.join(listed)}")
        return
    out = run([*ctr, "import", archive.as_posix()], f"import {archive.name}")
    names = [name] if name else [line.split()[1] for line in out.splitlines()
                                 if line.startswith("unpacking ")]
    for image in names:
        run([*ctr, "label", image, label], f"label {image}")


def import_images(archives: dict[str, Path], address: str) -> None:
    """Import each target's archive (``{target: archive}``) into the containerd at
    ``address``."""
    for target, archive in archives.items():
        import_archive(archive, address, image_name(target))


def image_size(archive: Path) -> int:
    """Uncompressed size in bytes of an image (its docker-archive)."""
    return archive.stat().st_size
