"""NetworkPolicy of one TP group (pure)."""

from __future__ import annotations

from typing import Any

from .. import labels
from ..spec import DeploymentSpec
from .meta import child_metadata

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace
# Labels of the operator's pod (charts/shardline/templates/_helpers.tpl selectorLabels).
OPERATOR_POD_LABELS = {labels.LABEL_NAME: "shardline", labels.LABEL_COMPONENT: "operator"}


def _namespace_peer(namespace: str) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}}}


def build_network_policy(
    spec: DeploymentSpec, group: int, operator_namespace: str | None
) -> dict[str, Any]:
    """Ingress policy ``<name>-g<group>`` of the group's pods.

    - From pods of the same group: every port (the rendezvous port ``29500 + group``, NCCL and
      gloo, which pick further ports at run time). Pods of other groups, other deployments or
      other namespaces get none of them.
    - The HTTP port (8000): from every pod of the deployment's namespace, of each namespace in
      ``spec.networkPolicy.allowedNamespaces``, and the operator's pod in
      ``operator_namespace`` (it calls the leaders' admin API). ``None`` (an operator running
      outside the cluster) adds no operator rule.

    Egress is not restricted. Kubelet probes come from the node, which network plugins admit.
    """
    group_selector = {"matchLabels": labels.group_selector_labels(spec.name, group)}
    http_from = [_namespace_peer(spec.namespace)]
    for namespace in spec.network_policy.allowed_namespaces:
        if namespace != spec.namespace:
            http_from.append(_namespace_peer(namespace))
    if operator_namespace:
        http_from.append(
            {
                **_namespace_peer(operator_namespace),
                "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)},
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(
            spec,
            labels.statefulset_name(spec.name, group),
            {**labels.common_labels(spec.name), labels.LABEL_GROUP: str(group)},
        ),
        "spec": {
            "podSelector": group_selector,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": group_selector}]},
                {"from": http_from, "ports": [{"protocol": "TCP", "port": labels.HTTP_PORT}]},
            ],
        },
    }
