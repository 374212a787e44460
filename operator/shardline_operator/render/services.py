"""Services: a headless rank Service per group and one client Service (pure)."""

from __future__ import annotations

from typing import Any

from .. import labels
from ..spec import DeploymentSpec
from .meta import child_metadata


def build_rank_service(spec: DeploymentSpec, group: int) -> dict[str, Any]:
    """Headless ``<name>-g<group>-ranks``: pod DNS names for the rendezvous.

    ``publishNotReadyAddresses`` is essential: ranks must resolve rank 0 before any of them is
    Ready (field case K1), since readiness needs the group to have formed.
    """
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(
            spec,
            labels.rank_service_name(spec.name, group),
            {**labels.common_labels(spec.name), labels.LABEL_GROUP: str(group)},
        ),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels.group_selector_labels(spec.name, group),
            "ports": [
                {
                    "name": "dist",
                    "port": labels.dist_port(group),
                    "targetPort": "dist",
                    "protocol": "TCP",
                },
                {"name": "http", "port": labels.HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def routable_leader_labels(name: str) -> dict[str, str]:
    """The labels every routing path selects: deployment ``name``'s rank-0 pods (the HTTP
    servers) that ``routing.py`` has not taken out (``shardline.dev/routable: "true"``). A
    gateway that discovers workers by label (SMG's ``--selector``) uses the same set."""
    return {
        **labels.selector_labels(name),
        labels.LABEL_POD_INDEX: "0",
        labels.LABEL_ROUTABLE: "true",
    }


def build_client_service(spec: DeploymentSpec) -> dict[str, Any]:
    """Client Service ``<name>`` over the routable rank-0 pod (the HTTP server) of every
    group; labelled ``shardline.dev/model-kind`` (generate / embed) when ``spec.model.kind``
    declares it."""
    meta_labels = labels.common_labels(spec.name)
    if spec.model.kind != "auto":
        meta_labels = {**meta_labels, labels.LABEL_MODEL_KIND: spec.model.kind}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(spec, spec.name, meta_labels),
        "spec": {
            "type": spec.service.type,
            "selector": routable_leader_labels(spec.name),
            "ports": [
                {"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def build_revision_service(spec: DeploymentSpec, revision: str) -> dict[str, Any]:
    """``<name>-rev-<revision>`` (ClusterIP, the client Service's port) over the routable
    leaders whose ``shardline.dev/served-revision`` label is ``revision`` (a label value,
    ``labels.label_value``): the endpoint of a client that must stay on one revision."""
    object_labels = {**labels.common_labels(spec.name), labels.LABEL_REVISION_SERVICE: revision}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(
            spec, labels.revision_service_name(spec.name, revision), object_labels
        ),
        "spec": {
            "type": "ClusterIP",
            "selector": {
                **routable_leader_labels(spec.name),
                labels.LABEL_SERVED_REVISION: revision,
            },
            "ports": [
                {"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
