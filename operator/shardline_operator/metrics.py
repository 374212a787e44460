"""Operator Prometheus metrics: rollout duration, per-group update and recapture time,
rollbacks, failed updates, groups per revision, mixed versions.

Every metric is labelled with the InferenceDeployment's ``namespace`` and ``name``. The
functions here are the only way the rest of the operator touches metrics, so the names
below are the whole exported surface (the chart's rules and dashboard use exactly these).
Served over HTTP by :func:`serve` (``shardline-operator --metrics-port``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

_LABELS = ("namespace", "name")
_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)

ROLLOUT_DURATION = Histogram(
    "shardline_operator_rollout_duration_seconds",
    "Seconds from a rollout's start to every group serving the target.",
    _LABELS,
    buckets=_BUCKETS,
)
GROUP_UPDATE = Histogram(
    "shardline_operator_group_update_seconds",
    "Seconds one group spent loading new weights in place.",
    _LABELS,
    buckets=_BUCKETS,
)
GROUP_RECAPTURE = Histogram(
    "shardline_operator_group_recapture_seconds",
    "Seconds one group spent recapturing CUDA graphs after a weight update, as its leader reported "
    "(recapture_seconds of /update_weights_from_disk; 0 when it had no graphs).",
    _LABELS,
    buckets=_BUCKETS,
)
ROLLBACKS = Counter(
    "shardline_operator_rollbacks_total",
    "Rollouts rolled back (failed update or failed gate).",
    _LABELS,
)
FAILED_UPDATES = Counter(
    "shardline_operator_failed_updates_total", "In-place group updates that failed.", _LABELS
)
GROUPS_PER_REVISION = Gauge(
    "shardline_operator_groups", "Groups serving each revision.", (*_LABELS, "revision")
)
MIXED_VERSIONS = Gauge(
    "shardline_operator_mixed_version_groups",
    "Groups whose leader serves another weights digest than status records.",
    _LABELS,
)


def observe_rollout(namespace: str, name: str, seconds: float) -> None:
    """A rollout finished (every group on the target) after ``seconds``."""
    ROLLOUT_DURATION.labels(namespace, name).observe(seconds)


def observe_group_update(
    namespace: str, name: str, update_seconds: float, recapture_seconds: float | None = None
) -> None:
    """One group's in-place update took ``update_seconds`` (operator wall time, from the request to
    the reply) and its leader reported ``recapture_seconds`` (None: not reported, no sample)."""
    GROUP_UPDATE.labels(namespace, name).observe(update_seconds)
    if recapture_seconds is not None:
        GROUP_RECAPTURE.labels(namespace, name).observe(recapture_seconds)


def inc_rollback(namespace: str, name: str) -> None:
    ROLLBACKS.labels(namespace, name).inc()


def inc_failed_update(namespace: str, name: str) -> None:
    FAILED_UPDATES.labels(namespace, name).inc()


def set_groups_per_revision(namespace: str, name: str, counts: Mapping[str, int]) -> None:
    """Replace the per-revision group counts of one deployment (revisions absent drop out)."""
    for labels in list(GROUPS_PER_REVISION._metrics):  # noqa: SLF001 (no public API to list children)
        if labels[:2] == (namespace, name) and labels[2] not in counts:
            GROUPS_PER_REVISION.remove(*labels)
    for revision, count in counts.items():
        GROUPS_PER_REVISION.labels(namespace, name, revision).set(count)


def set_mixed_versions(namespace: str, name: str, count: int) -> None:
    MIXED_VERSIONS.labels(namespace, name).set(count)


def forget(namespace: str, name: str) -> None:
    """Drop a deleted deployment's gauges (counters and histograms keep their history)."""
    set_groups_per_revision(namespace, name, {})
    try:
        MIXED_VERSIONS.remove(namespace, name)
    except KeyError:
        pass


def serve(
    port: int, addr: str = "0.0.0.0", registry: CollectorRegistry = REGISTRY
) -> tuple[Any, Any]:
    """Serve ``/metrics`` on ``addr:port`` from a daemon thread; returns ``(server, thread)``
    (``server.shutdown()`` stops it). Raises OSError when the port is taken."""
    return start_http_server(port, addr=addr, registry=registry)


# Facts the chart's alerts need, read from the status a pass wrote (see observe_status).
ROLLOUT_IN_PROGRESS = Gauge(
    "shardline_operator_rollout_in_progress",
    "1 while a rollout has groups left to update or roll back (status.rollout), else 0.",
    _LABELS,
)
FAILED_GROUPS = Gauge(
    "shardline_operator_failed_groups",
    "Groups in phase Failed (restart budget exhausted).",
    _LABELS,
)
GROUP_RESTARTS = Gauge(
    "shardline_operator_group_restarts",
    "Whole-group restarts counted against the restart budget since the spec last changed.",
    (*_LABELS, "group"),
)
RESTART_BUDGET = Gauge(
    "shardline_operator_restart_budget",
    "spec.restartPolicy.maxGroupRestarts of the deployment.",
    _LABELS,
)
_SETTLED_ROLLOUT_PHASES = ("", "Failed", "Complete", "Completed")


def observe_status(
    namespace: str, name: str, status: Mapping[str, Any], max_group_restarts: int
) -> None:
    """Mirror one written ``status`` (and the spec's restart budget) into the alerting gauges.

    ``status``: the InferenceDeployment's status as a pass wrote it (``groups[].index``,
    ``groups[].phase``, ``groups[].restarts``, ``rollout.phase``); missing keys read as empty.
    """
    groups = status.get("groups") or []
    rollout_phase = str((status.get("rollout") or {}).get("phase") or "")
    ROLLOUT_IN_PROGRESS.labels(namespace, name).set(
        0 if rollout_phase in _SETTLED_ROLLOUT_PHASES else 1
    )
    FAILED_GROUPS.labels(namespace, name).set(sum(1 for g in groups if g.get("phase") == "Failed"))
    RESTART_BUDGET.labels(namespace, name).set(max_group_restarts)
    current = {str(g.get("index")) for g in groups}
    for labels in list(GROUP_RESTARTS._metrics):  # noqa: SLF001 (no public API to list children)
        if labels[:2] == (namespace, name) and labels[2] not in current:
            GROUP_RESTARTS.remove(*labels)
    for group in groups:
        GROUP_RESTARTS.labels(namespace, name, str(group.get("index"))).set(
            int(group.get("restarts") or 0)
        )


def forget_status(namespace: str, name: str) -> None:
    """Drop a deleted deployment's :func:`observe_status` gauges."""
    for gauge in (ROLLOUT_IN_PROGRESS, FAILED_GROUPS, RESTART_BUDGET):
        try:
            gauge.remove(namespace, name)
        except KeyError:
            pass
    for labels in list(GROUP_RESTARTS._metrics):  # noqa: SLF001
        if labels[:2] == (namespace, name):
            GROUP_RESTARTS.remove(*labels)
