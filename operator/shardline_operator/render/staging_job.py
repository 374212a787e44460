"""The staging Job: ``shardline-runtime download`` of one model revision into one node's cache.

Pure: ``(spec, target, node, attempt) -> batch/v1 Job``. The pod runs the runtime image on
``node`` (node affinity on ``metadata.name``, as the DaemonSet controller pins its pods; no
node for the one Job of a shared claim) with the deployment's tolerations, mounts the same
model cache volume as the runtime pods (``spec.model.cache.volume``) at the same path, and
reads credentials only from ``spec.model.credentialsSecretRef`` (``model_store_env``). It needs
no GPU. Its pod carries no ``shardline.dev/deployment`` label, so no Service, PDB or
NetworkPolicy of the deployment selects it.

Failures a retry cannot fix (exit code 3 of ``download``: not found, refused, checksum) fail
the Job at once through ``podFailurePolicy``; others (network, 5xx, a full disk) are retried
``BACKOFF_LIMIT`` times and resume where they stopped.
"""

from __future__ import annotations

import hashlib
from typing import Any

from .. import labels
from ..spec import DeploymentSpec
from ..spec_model import MODEL_CACHE_DIR, MODEL_CACHE_ENV
from ..staging_state import (
    ANNOTATION_NODE,
    LABEL_STAGING_ATTEMPT,
    LABEL_STAGING_KEY,
    LABEL_STAGING_OF,
    StagingTarget,
)
from .meta import owner_reference
from .pod_template import container_security_context, pod_security_context
from .volumes import MODEL_CACHE_VOLUME, WRITABLE_DIRS, model_store_env, writable_env

COMPONENT_STAGING = "staging"
DOWNLOAD_COMMAND = ("shardline-runtime", "download")
BACKOFF_LIMIT = 2
EXIT_PERMANENT = 3  # download_cli.EXIT_PERMANENT (the operator never imports the runtime)
# A bound on one attempt, past any sane download (the Job then fails DeadlineExceeded).
DEADLINE_SECONDS = 6 * 3600


def staging_job_name(name: str, target: StagingTarget, attempt: int, node: str) -> str:
    """``<name>-stage-<key>-a<attempt>-<node hash>``, at most 63 characters (the Job controller
    copies it into a pod label)."""
    node_part = hashlib.sha256(node.encode()).hexdigest()[:6] if node else "shared"
    suffix = f"-stage-{target.key}-a{attempt}-{node_part}"
    return f"{name[: 63 - len(suffix)].rstrip('-.')}{suffix}"


def staging_labels(name: str, target: StagingTarget, attempt: int) -> dict[str, str]:
    """Labels of a staging Job and its pod (none that the deployment's selectors match)."""
    return {
        labels.LABEL_NAME: "shardline",
        labels.LABEL_INSTANCE: name,
        labels.LABEL_COMPONENT: COMPONENT_STAGING,
        labels.LABEL_PART_OF: "shardline",
        labels.LABEL_MANAGED_BY: labels.FIELD_MANAGER,
        LABEL_STAGING_OF: name,
        LABEL_STAGING_KEY: target.key,
        LABEL_STAGING_ATTEMPT: str(attempt),
    }


def staging_selector(name: str) -> dict[str, str]:
    """Selects every staging Job (and pod) of deployment ``name``."""
    return {LABEL_STAGING_OF: name}


def build_staging_job(
    spec: DeploymentSpec,
    target: StagingTarget,
    node: str,
    attempt: int,
    service_account: str | None = None,
) -> dict[str, Any]:
    """The staging Job of ``target`` on ``node`` ("" for the shared claim's one Job).
    ``service_account``: the pod runs as it with its token mounted, and annotates itself with
    its live progress (``render/staging_access.py``); None: no token at all."""
    object_labels = staging_labels(spec.name, target, attempt)
    cache = dict(spec.model.cache_volume or {"emptyDir": {}})
    volumes: list[dict[str, Any]] = [{"name": MODEL_CACHE_VOLUME, **cache}]
    mounts: list[dict[str, Any]] = [{"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_DIR}]
    for volume, path in WRITABLE_DIRS:
        volumes.append({"name": volume, "emptyDir": {}})
        mounts.append({"name": volume, "mountPath": path})
    container = {
        "name": "download",
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": list(DOWNLOAD_COMMAND),
        "args": [
            "--model-path",
            target.uri,
            "--download-dir",
            f"$({MODEL_CACHE_ENV})",
            *(["--draft-model-path", target.draft_uri] if target.draft_uri else []),
        ],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "POD_NAMESPACE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            },
            *writable_env(),
            *model_store_env(spec),
            *[dict(item) for item in spec.runtime.env],
        ],
        "volumeMounts": mounts,
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "securityContext": container_security_context(),
    }
    pod_spec: dict[str, Any] = {
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": volumes,
        "restartPolicy": "Never",
        "automountServiceAccountToken": service_account is not None,
    }
    if service_account is not None:
        pod_spec["serviceAccountName"] = service_account
    if node:
        term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        pod_spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
            }
        }
    if spec.scheduling.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.scheduling.tolerations]
    if spec.scheduling.priority_class_name:
        pod_spec["priorityClassName"] = spec.scheduling.priority_class_name
    meta = {
        "name": staging_job_name(spec.name, target, attempt, node),
        "namespace": spec.namespace,
        "labels": object_labels,
        "annotations": {ANNOTATION_NODE: node},
        "ownerReferences": [owner_reference(spec)],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "activeDeadlineSeconds": DEADLINE_SECONDS,
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "FailJob",
                        "onExitCodes": {
                            "containerName": "download",
                            "operator": "In",
                            "values": [EXIT_PERMANENT],
                        },
                    }
                ]
            },
            "template": {"metadata": {"labels": object_labels}, "spec": pod_spec},
        },
    }
