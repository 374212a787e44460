"""The ServiceAccount volume kubelet gives a pod, for pods run as local processes.

Kubelet mounts a projected token, the cluster CA and the namespace at
``/var/run/secrets/kubernetes.io/serviceaccount`` and sets ``KUBERNETES_SERVICE_HOST`` /
``KUBERNETES_SERVICE_PORT``; clients then take their in-cluster branch
(``kubernetes.config.load_incluster_config``). The agent writes the three files into the pod's
work directory and starts the container in its own mount namespace (``unshare --mount``) with
that directory bind-mounted at the standard path, so no other process on the machine sees it.
Where mount namespaces are not allowed, the agent falls back to a kubeconfig (``KUBECONFIG``).
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

MOUNT_PATH = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def mount_namespaces_work() -> tuple[bool, str]:
    """Whether containers can get the standard mount (``unshare --mount`` and a mount point)."""
    if shutil.which("unshare") is None:
        return False, "service accounts: no unshare; pods get a KUBECONFIG instead of the mounted token"
    try:
        MOUNT_PATH.mkdir(parents=True, exist_ok=True)  # an empty mount point; files only inside a pod
        probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                               capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"service accounts: {e}; pods get a KUBECONFIG instead of the mounted token"
    if probe.returncode != 0:
        return False, (f"service accounts: unshare --mount failed ({probe.stderr.decode().strip()}); "
                       "pods get a KUBECONFIG instead of the mounted token")
    return True, f"service accounts: tokens mounted at {MOUNT_PATH} in each pod's mount namespace"


def write_volume(directory: Path, token: str, ca_cert: str, namespace: str) -> Path:
    """Write ``token``, ``ca.crt`` and ``namespace`` (what the projected volume holds)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "token").write_text(token)
    shutil.copyfile(ca_cert, directory / "ca.crt")
    (directory / "namespace").write_text(namespace)
    for f in directory.iterdir():
        f.chmod(0o600)
    return directory


def service_env(server: str) -> dict[str, str]:
    """``KUBERNETES_SERVICE_HOST`` / ``_PORT`` pointing at the API server ``https://host:port``."""
    url = urlparse(server)
    return {"KUBERNETES_SERVICE_HOST": url.hostname or "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(url.port or 443)}


def mounted_argv(directory: Path, argv: list[str]) -> list[str]:
    """``argv`` run in a new mount namespace with ``directory`` bind-mounted at the standard path."""
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
            str(directory), str(MOUNT_PATH), *argv]
