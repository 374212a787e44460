"""Run a command in a built image the way the pods run it: runc, uid 10001, read-only root,
tmpfs at HOME, the cache root and /tmp (the emptyDirs the operator mounts), the image's env.

    python3 -m hack.images.smoke localhost/shardline-runtime:0.1.0 -- python3 -c 'import torch'
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

WRITABLE = ("/home/shardline", "/var/cache/shardline", "/tmp")


def _buildah(*args: str) -> str:
    return subprocess.run(["buildah", *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def bundle_config(rootfs: str, env: list[str], argv: list[str], cwd: str) -> dict:
    """An OCI runtime config: ``argv`` as 10001:10001, read-only ``rootfs``, every capability
    dropped, no new privileges, tmpfs at each :data:`WRITABLE` path and /dev/shm, owned by
    10001 (runc gives a tmpfs the mode of the directory it covers; a kubelet emptyDir is 0777)."""
    tmpfs = [{"destination": path, "type": "tmpfs", "source": "tmpfs",
              "options": ["nosuid", "nodev", "uid=10001", "gid=10001", "size=1g"]}
             for path in (*WRITABLE, "/dev/shm")]
    return {
        "ociVersion": "1.0.2",
        "process": {"terminal": False, "user": {"uid": 10001, "gid": 10001}, "args": argv,
                    "env": env, "cwd": cwd, "noNewPrivileges": True,
                    "capabilities": {k: [] for k in ("bounding", "effective", "inheritable",
                                                     "permitted", "ambient")}},
        "root": {"path": rootfs, "readonly": True},
        "hostname": "smoke",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            *tmpfs,
        ],
        "linux": {"namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")],
                  "maskedPaths": ["/proc/kcore", "/proc/keys"],
                  "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger"]},
    }


def run_readonly(image: str, argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``argv`` in ``image`` (from buildah's storage) under runc as a pod would."""
    container = _buildah("from", image)
    try:
        rootfs = _buildah("mount", container)
        config = json.loads(_buildah("inspect", "--type", "image", image))["OCIv1"]["config"]
        with tempfile.TemporaryDirectory(prefix="shardline-smoke-") as bundle:
            spec = bundle_config(rootfs, config.get("Env", []), argv,
                                 config.get("WorkingDir") or "/")
            (Path(bundle) / "config.json").write_text(json.dumps(spec))
            return subprocess.run(["runc", "run", "--bundle", bundle,
                                   f"smoke-{uuid.uuid4().hex[:8]}"], capture_output=True,
                                  text=True, timeout=timeout, check=False)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True, check=False)


if __name__ == "__main__":
    image, _, command = sys.argv[1], sys.argv[2], sys.argv[3:]
    done = run_readonly(image, command)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    sys.exit(done.returncode)
