"""Object metadata shared by every rendered child: name, namespace, labels, owner reference."""

from __future__ import annotations

from typing import Any

from .. import labels
from ..spec import DeploymentSpec


def owner_reference(spec: DeploymentSpec) -> dict[str, Any]:
    """Controller owner reference to the ``InferenceDeployment`` (deletion cascades through it)."""
    return {
        "apiVersion": f"{labels.API_GROUP}/{labels.API_VERSION}",
        "kind": labels.KIND,
        "name": spec.name,
        "uid": spec.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(
    spec: DeploymentSpec,
    name: str,
    object_labels: dict[str, str],
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``metadata`` of a namespaced child object owned by the deployment."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": spec.namespace,
        "labels": dict(object_labels),
        "ownerReferences": [owner_reference(spec)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta
