"""Pure manifest builders: ``DeploymentSpec`` -> Kubernetes objects (plain dicts).

One module per kind; :func:`render_children` lists every child of a deployment.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..runtime_args import ServedModel
from ..spec import DeploymentSpec
from .network_policy import build_network_policy
from .pdb import build_pod_disruption_budget
from .secret import build_admin_secret
from .services import build_client_service, build_rank_service, build_revision_service
from .statefulset import build_statefulset

__all__ = [
    "build_admin_secret",
    "build_client_service",
    "build_network_policy",
    "build_pod_disruption_budget",
    "build_rank_service",
    "build_revision_service",
    "build_statefulset",
    "render_children",
]


def render_children(
    spec: DeploymentSpec,
    served: Mapping[int, ServedModel] | None = None,
    operator_namespace: str | None = None,
) -> list[dict[str, Any]]:
    """Every child object: per group a rank Service, a StatefulSet and (``spec.networkPolicy.enabled``)
    a NetworkPolicy, then the client Service and PDB. The admin-token Secret is not listed: its
    content is drawn at random once (:func:`build_admin_secret`).

    ``served`` maps a group index to what that group serves now (during a rollout); groups not
    in it get the spec's model.
    """
    served = served or {}
    desired = ServedModel.desired(spec)
    children: list[dict[str, Any]] = []
    for group in range(spec.replicas):
        children.append(build_rank_service(spec, group))
        children.append(build_statefulset(spec, group, served.get(group, desired)))
        if spec.network_policy.enabled:
            children.append(build_network_policy(spec, group, operator_namespace))
    children.append(build_client_service(spec))
    children.append(build_pod_disruption_budget(spec))
    return children
