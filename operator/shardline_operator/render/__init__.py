"""Pure manifest builders: ``DeploymentSpec`` -> Kubernetes objects (plain dicts).

One module per kind; :func:`render_children` lists every child of a deployment.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..runtime_args import ServedModel
from ..spec import DeploymentSpec
from .pdb import build_pod_disruption_budget
from .services import build_client_service, build_rank_service
from .statefulset import build_statefulset

__all__ = [
    "build_client_service", "build_pod_disruption_budget", "build_rank_service",
    "build_statefulset", "render_children",
]


def render_children(spec: DeploymentSpec, served: Mapping[int, ServedModel] | None = None) -> list[dict[str, Any]]:
    """Every child object: per group a rank Service and a StatefulSet, then the client Service and PDB.

    ``served`` maps a group index to what that group serves now (during a rollout); groups not
    in it get the spec's model.
    """
    served = served or {}
    desired = ServedModel.desired(spec)
    children: list[dict[str, Any]] = []
    for group in range(spec.replicas):
        children.append(build_rank_service(spec, group))
        children.append(build_statefulset(spec, group, served.get(group, desired)))
    children.append(build_client_service(spec))
    children.append(build_pod_disruption_budget(spec))
    return children
