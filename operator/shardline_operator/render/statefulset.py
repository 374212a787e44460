"""The StatefulSet of one TP group (pure)."""

from __future__ import annotations

from typing import Any

from .. import labels
from ..runtime_args import ServedModel
from ..spec import DeploymentSpec
from .meta import child_metadata
from .pod_template import build_pod_template


def build_statefulset(spec: DeploymentSpec, group: int, served: ServedModel) -> dict[str, Any]:
    """StatefulSet ``<name>-g<group>``: ``tensor x pipeline / gpusPerPod`` pods, node rank = ordinal.

    ``Parallel`` pod management starts all ranks together (they rendezvous with each other);
    ``OnDelete`` updates leave restarts to the operator, which restarts a group as a whole so TP
    ranks (all TP and pipeline ranks) never mix revisions. The annotations record what the group serves (read back by the
    reconciler after an operator restart).
    """
    annotations = {
        labels.ANNOTATION_RESTART_HASH: spec.restart_hash(),
        labels.ANNOTATION_MODEL_PATH: served.path,
        labels.ANNOTATION_MODEL_REVISION: served.revision,
        labels.ANNOTATION_CUDA_GRAPH: served.cuda_graph.key(),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": child_metadata(
            spec,
            labels.statefulset_name(spec.name, group),
            labels.group_labels(spec.name, group, served.revision),
            annotations,
        ),
        "spec": {
            "replicas": spec.parallelism.pods_per_group,
            "serviceName": labels.rank_service_name(spec.name, group),
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": labels.group_selector_labels(spec.name, group)},
            "template": build_pod_template(spec, group, served),
        },
    }
