"""Volumes of the runtime pod: the model, /dev/shm for NCCL, and every writable path (pure).

The runtime container runs with a read-only root file system, so each path it writes is an
``emptyDir``: HOME, one cache root (Triton, torch inductor, torch hub, Hugging Face) and /tmp.
The matching environment variables are rendered too, so any image (not only the project's,
whose Dockerfile sets the same values) writes where the volumes are.
"""

from __future__ import annotations

from typing import Any

from ..spec import DeploymentSpec
from ..spec_model import CREDENTIAL_KEYS, MODEL_CACHE_DIR, MODEL_CACHE_ENV

MODEL_VOLUME = "model"
MODEL_CACHE_VOLUME = "model-cache"
SHM_VOLUME = "dshm"
HOME_DIR = "/home/shardline"
CACHE_DIR = "/var/cache/shardline"
TMP_DIR = "/tmp"
# NCCL's troubleshooting guide asks for a 1 GiB /dev/shm per container (`--shm-size=1g`);
# one GiB per GPU of the pod leaves room for a rank per GPU. A memory-medium emptyDir without
# a limit is sized to the node's memory (or the pod's limit), which hides the need.
SHM_GIB_PER_GPU = 1
# (volume name, mount path) of each writable emptyDir.
WRITABLE_DIRS = (("home", HOME_DIR), ("cache", CACHE_DIR), ("tmp", TMP_DIR))
# Where the runtime's libraries write, all under the cache emptyDir (or HOME, /tmp).
WRITABLE_ENV = (
    ("HOME", HOME_DIR),
    ("TMPDIR", TMP_DIR),
    ("XDG_CACHE_HOME", CACHE_DIR),
    ("TRITON_HOME", CACHE_DIR),
    ("TRITON_CACHE_DIR", f"{CACHE_DIR}/triton"),
    ("TORCHINDUCTOR_CACHE_DIR", f"{CACHE_DIR}/torchinductor"),
    ("TORCH_HOME", f"{CACHE_DIR}/torch"),
    ("HF_HOME", f"{CACHE_DIR}/huggingface"),
)


def shm_size_limit(spec: DeploymentSpec) -> str:
    """``sizeLimit`` of the /dev/shm emptyDir: :data:`SHM_GIB_PER_GPU` GiB per GPU of the pod."""
    return f"{SHM_GIB_PER_GPU * spec.parallelism.gpus_per_pod}Gi"


def writable_env() -> list[dict[str, Any]]:
    """``env`` entries pointing HOME, TMPDIR and the library caches at the emptyDirs."""
    return [{"name": name, "value": value} for name, value in WRITABLE_ENV]


def pod_volumes(spec: DeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(volumes, volumeMounts)`` of the runtime pod: /dev/shm (memory, sized for NCCL), the
    writable emptyDirs, the user's model volume mounted read-only when set, and for an hf:// or
    s3:// uri the model cache (``spec.model.cache.volume``, default an emptyDir) the runtime
    fetches revisions into (``--download-dir``)."""
    volumes: list[dict[str, Any]] = [
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm_size_limit(spec)}}
    ]
    mounts: list[dict[str, Any]] = [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    for name, path in WRITABLE_DIRS:
        volumes.append({"name": name, "emptyDir": {}})
        mounts.append({"name": name, "mountPath": path})
    if spec.model.volume is not None:
        volumes.append({"name": MODEL_VOLUME, **dict(spec.model.volume)})
        mounts.append({"name": MODEL_VOLUME, "mountPath": spec.model.mount_path, "readOnly": True})
    if spec.model.is_remote:
        source = dict(spec.model.cache_volume or {"emptyDir": {}})
        volumes.append({"name": MODEL_CACHE_VOLUME, **source})
        mounts.append({"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_DIR})
    return volumes, mounts


def model_store_env(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """``env`` of an hf:// or s3:// model: the cache directory (``--download-dir`` reads it), the S3 endpoint and region from the spec, and each
    credential key (``HF_TOKEN``, ``AWS_*``) from ``spec.model.credentialsSecretRef`` as an
    optional ``secretKeyRef`` (a Secret holds only the keys its store needs)."""
    if not spec.model.is_remote:
        return []
    env: list[dict[str, Any]] = [{"name": MODEL_CACHE_ENV, "value": MODEL_CACHE_DIR}]
    if spec.model.s3_endpoint is not None:
        env.append({"name": "AWS_ENDPOINT_URL_S3", "value": spec.model.s3_endpoint})
    if spec.model.s3_region is not None:
        env.append({"name": "AWS_REGION", "value": spec.model.s3_region})
    secret = spec.model.credentials_secret
    if secret is not None:
        env += [
            {
                "name": key,
                "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}},
            }
            for key in CREDENTIAL_KEYS
        ]
    return env
