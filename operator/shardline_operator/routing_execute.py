"""Performing the routing actions of a pass (``routing.py`` plans them): pod label patches, the
wait for a leader to leave the Services' EndpointSlices (and the gateway settle: at least
:data:`GATEWAY_SETTLE_SECONDS` after its label flip, for gateways that watch the label, before
the leader holds new requests), and the health check before it returns.

The settle does not delay the update: what is left of it once the EndpointSlices dropped the
leader goes into the update request as ``admit_seconds`` (``execute.py``). The runtime starts
staging the new weights at once and goes on admitting new requests on the old weights for that
long, so a request a gateway still sends in the settle is served, not held, while the staging
that the update waits for anyway runs beside it. A leader that left routing is also updated
with ``keep_ready``: its ``/ready`` stays 200, so the kubelet does not mark it NotReady and the
pass after the update's reply need not wait for a probe to see it Ready again."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from . import labels
from .kube import KubeClient, KubeError
from .pass_plan import EnterRouting, LabelLeader, LeaveRouting

logger = logging.getLogger(__name__)

SLICE_POLL_SECONDS = 0.1
# A leaving leader's update is sent no sooner than this after its routable label flipped, so a
# gateway watching the label drops it first: the GIE endpoint picker did in 0.20-0.31 s
# (tests/e2e/test_gie_epp_e2e.py). The EndpointSlice wait alone can end at once (a cluster
# whose slices never listed the pod), before such a gateway saw the flip.
GATEWAY_SETTLE_SECONDS = 1.0
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # set by the EndpointSlice controller


def listed_addresses(kube: KubeClient, namespace: str, service: str) -> set[str]:
    """Every endpoint address in the EndpointSlices of ``service`` (ready or not)."""
    slices = kube.list(
        "discovery.k8s.io/v1", "EndpointSlice", namespace, {SERVICE_NAME_LABEL: service}
    )
    return {
        address
        for piece in slices
        for endpoint in piece.get("endpoints") or []
        for address in endpoint.get("addresses") or []
    }


def _patch_labels(kube: KubeClient, namespace: str, pod: str, values: dict[str, Any]) -> None:
    """Merge ``values`` into the pod's labels; a pod already gone (a group restart deleted it
    this pass) has nothing left to route."""
    try:
        kube.merge_patch("v1", "Pod", namespace, pod, {"metadata": {"labels": values}})
    except KubeError as exc:
        if exc.status != 404:
            raise


def perform_routing(
    kube: KubeClient,
    client: Any,
    namespace: str,
    action: LabelLeader | LeaveRouting | EnterRouting,
    sleep: Callable[[float], None] = time.sleep,
) -> float | None:
    """Perform one routing action (raises ``KubeError`` on an API failure). ``client`` is the
    pass's leader client (its ``verify(url, None)`` is the ``/health_generate`` check).

    Returns the seconds of the gateway settle still to run after a :class:`LeaveRouting`
    (0.0 .. :data:`GATEWAY_SETTLE_SECONDS`; 0.0 for the other actions): the leader must go on
    admitting requests that long before its update holds them (the update's ``admit_seconds``).
    None when the EndpointSlices still list the leader after ``action.timeout_seconds``: it
    did not leave routing, so its update must not keep it Ready (``keep_ready``)."""
    if isinstance(action, LabelLeader):
        _patch_labels(kube, namespace, action.pod, dict(action.labels))
    elif isinstance(action, LeaveRouting):
        _patch_labels(kube, namespace, action.pod, {labels.LABEL_ROUTABLE: "false"})
        started = time.monotonic()
        settled = started + GATEWAY_SETTLE_SECONDS
        deadline = started + action.timeout_seconds
        while any(action.ip in listed_addresses(kube, namespace, s) for s in action.services):
            if time.monotonic() >= deadline:
                logger.warning(
                    "group %d: %s still listed by %s after %.0fs; updating anyway (requests "
                    "that still arrive are held by the runtime)",
                    action.group,
                    action.ip,
                    action.services,
                    action.timeout_seconds,
                )
                return None
            sleep(SLICE_POLL_SECONDS)
        logger.info(
            "group %d: %s left %s in %.2f s",
            action.group,
            action.ip,
            action.services,
            time.monotonic() - started,
        )
        return max(0.0, settled - time.monotonic())
    else:
        started = time.monotonic()
        passed, message = client.verify(action.url, None)
        if passed:
            _patch_labels(kube, namespace, action.pod, {labels.LABEL_ROUTABLE: "true"})
            logger.info(
                "group %d back in routing (health check %.2f s)",
                action.group,
                time.monotonic() - started,
            )
        else:
            logger.info("group %d stays out of routing: %s", action.group, message)
    return 0.0
