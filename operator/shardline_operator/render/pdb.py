"""The PodDisruptionBudget of a deployment (pure)."""

from __future__ import annotations

from typing import Any

from .. import labels
from ..spec import DeploymentSpec
from .meta import child_metadata


def build_pod_disruption_budget(spec: DeploymentSpec) -> dict[str, Any]:
    """PDB allowing voluntary disruption of at most one group's worth of pods at a time.

    Evicting any pod takes its whole group (every TP and pipeline rank) down, so the budget is counted in pods of one
    group: ``maxUnavailable = tensor x pipeline / gpusPerPod``.
    """
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(spec, spec.name, labels.common_labels(spec.name)),
        "spec": {
            "maxUnavailable": spec.parallelism.pods_per_group,
            "selector": {"matchLabels": labels.selector_labels(spec.name)},
        },
    }
