"""The staging Jobs' API access: a ServiceAccount and a RoleBinding (pure).

A staging Job's container annotates its own pod with its live progress
(``runtime/shardline_runtime/pod_progress.py``). For that, its pod runs as the deployment's
ServiceAccount ``<name>-staging``, bound in the deployment's namespace to the ClusterRole the
chart grants for it (``<release>-staging``: ``get`` and ``patch`` on pods, nothing else). The
operator may create the binding without the ``bind`` verb because it holds both permissions
itself (RBAC's escalation check). Without a ClusterRole name (an operator run outside the
chart) no access is rendered: the Jobs run without a token and report only when they end.
"""

from __future__ import annotations

from typing import Any

from ..spec import DeploymentSpec
from ..staging_state import LABEL_STAGING_ATTEMPT, LABEL_STAGING_KEY, StagingTarget
from .meta import child_metadata
from .staging_job import staging_labels


def staging_service_account_name(name: str) -> str:
    """``<name>-staging``, at most 63 characters."""
    return f"{name[:55].rstrip('-.')}-staging"


def build_staging_access(
    spec: DeploymentSpec, target: StagingTarget, cluster_role: str
) -> list[dict[str, Any]]:
    """``[ServiceAccount, RoleBinding]`` granting the staging pods ``cluster_role`` in the
    deployment's namespace (both owned by the deployment, so deletion cascades; the same
    objects serve every target)."""
    name = staging_service_account_name(spec.name)
    object_labels = {
        k: v
        for k, v in staging_labels(spec.name, target, 1).items()
        if k not in (LABEL_STAGING_KEY, LABEL_STAGING_ATTEMPT)
    }
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": child_metadata(spec, name, object_labels),
        "automountServiceAccountToken": False,  # the staging pod opts in
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": child_metadata(spec, name, object_labels),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": cluster_role,
        },
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": spec.namespace}],
    }
    return [account, binding]
