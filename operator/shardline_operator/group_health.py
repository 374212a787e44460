"""Group health: when to restart a whole TP group, with exponential backoff and a budget (pure).

A TP group is one process group: if any rank dies, restarts or is replaced, the others hang
on collectives or serve nothing, so the group is restarted as a whole (all its pods deleted
and recreated by the StatefulSet controller). Restarts are spaced by
``backoffSeconds * 2**(restarts - 1)`` (capped at :data:`MAX_BACKOFF_SECONDS`), like kubelet's
CrashLoopBackOff; after ``maxGroupRestarts`` restarts the next failure marks the group
``Failed`` with the runtime's first error line, and it stays so until the spec is edited.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .observed import GroupObservation
from .spec import RestartPolicySpec

MAX_BACKOFF_SECONDS = 300.0


@dataclass(frozen=True)
class GroupRecord:
    """Per-group bookkeeping kept in ``status.groups[i]`` (times are Unix seconds)."""

    restarts: int = 0
    last_restart_time: float | None = None
    pod_uids: Mapping[str, str] = field(default_factory=dict)
    failed_message: str | None = None


@dataclass(frozen=True)
class HealthDecision:
    """``action``: ``none``, ``restart`` (delete all pods now), ``wait`` (backoff) or ``fail``."""

    action: str
    record: GroupRecord
    reason: str = ""
    retry_in_seconds: float | None = None


def backoff_seconds(restarts: int, policy: RestartPolicySpec) -> float:
    """Delay before restart number ``restarts + 1`` counted from the previous restart."""
    if restarts <= 0:
        return 0.0
    return min(float(policy.backoff_seconds) * 2 ** (restarts - 1), MAX_BACKOFF_SECONDS)


def _problem(group: GroupObservation, record: GroupRecord) -> str | None:
    """Why the group must restart, or None when it is healthy (or still forming)."""
    for pod in group.live_pods:
        if pod.phase in ("Failed", "Succeeded"):
            return f"pod {pod.name} is {pod.phase}"
        if pod.terminated or pod.restart_count > 0:
            return f"pod {pod.name} container exited (restarts: {pod.restart_count})"
    current = {p.name: p for p in group.pods}
    for name, uid in record.pod_uids.items():
        found = current.get(name)
        if found is not None and (found.uid != uid or found.deleting):
            return f"pod {name} was deleted or replaced"
    return None


def decide(
    group: GroupObservation, record: GroupRecord, policy: RestartPolicySpec, now: float
) -> HealthDecision:
    """Decide what to do about group ``group`` given its bookkeeping ``record``.

    Returns the decision with the updated record (membership recorded once every rank exists,
    restart counted and timed on ``restart``, the first error line kept on ``fail``).
    """
    if record.failed_message is not None:
        return HealthDecision("none", record)
    problem = _problem(group, record)
    if problem is None:
        live = group.live_pods
        members = {p.name: p.uid for p in live}
        if (
            len(live) == group.size
            and len(group.pods) == group.size
            and members != dict(record.pod_uids)
        ):
            record = replace(record, pod_uids=members)
        return HealthDecision("none", record)
    error_line = next((p.error_message for p in group.pods if p.error_message), None)
    if record.restarts >= policy.max_group_restarts:
        message = error_line or problem
        reason = f"restart budget of {policy.max_group_restarts} exhausted: {message}"
        return HealthDecision("fail", replace(record, failed_message=message, pod_uids={}), reason)
    delay = backoff_seconds(record.restarts, policy)
    since = now - record.last_restart_time if record.last_restart_time is not None else delay
    if since < delay:
        return HealthDecision("wait", record, problem, retry_in_seconds=delay - since)
    reason = problem if error_line is None else f"{problem}: {error_line}"
    restarted = replace(record, restarts=record.restarts + 1, last_restart_time=now, pod_uids={})
    return HealthDecision("restart", restarted, reason)
