"""Images the node needs: the pod sandbox ("pause") image, built here from ``pause.c`` with
gcc into a docker-archive by hand (one static binary, one layer; no registry is reachable), and
the import of image archives into the node's containerd."""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

from .config import PAUSE_IMAGE

PAUSE_SOURCE = Path(__file__).with_name("pause.c")


def _cache() -> Path:
    root = Path(os.environ.get("SHARDLINE_CACHE", Path.home() / ".cache" / "shardline"))
    return root / "images"


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


def pause_archive(binary: bytes, name: str = PAUSE_IMAGE) -> bytes:
    """A docker-archive (``docker save`` layout) of an image whose only file is ``/pause``."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        _add(t, "pause", binary, 0o755)
    layer_bytes = layer.getvalue()
    image_config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
        "rootfs": {"type": "layers",
                   "diff_ids": [f"sha256:{hashlib.sha256(layer_bytes).hexdigest()}"]},
    }).encode()
    config_name = f"{hashlib.sha256(image_config).hexdigest()}.json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [name],
                            "Layers": ["layer.tar"]}]).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as t:
        _add(t, "layer.tar", layer_bytes)
        _add(t, config_name, image_config)
        _add(t, "manifest.json", manifest)
    return out.getvalue()


def ensure_pause_archive() -> Path:
    """Compile ``pause.c`` statically and write its archive, named by the source's hash."""
    source = PAUSE_SOURCE.read_bytes()
    path = _cache() / f"pause-{hashlib.sha256(source).hexdigest()[:12]}.tar"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "pause"
        subprocess.run(["gcc", "-static", "-O2", "-o", str(binary), str(PAUSE_SOURCE)],
                       check=True, capture_output=True, text=True)
        path.with_suffix(".partial").write_bytes(pause_archive(binary.read_bytes()))
    path.with_suffix(".partial").replace(path)
    return path


def import_archives(archives: dict[str, Path], socket: Path) -> None:
    """``ctr -n k8s.io images import`` each archive (values) into the containerd at ``socket``."""
    from hack.images.build import import_archive

    for name, archive in archives.items():
        import_archive(archive, str(socket), name)
