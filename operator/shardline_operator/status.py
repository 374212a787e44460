"""Observed state -> ``InferenceDeployment.status`` (pure).

Phases (DESIGN 3.1): Pending, Initializing, Ready, UpdatingWeights, RecapturingGraphs,
Degraded, Failed; per group also Restarting. Conditions have the standard shape
(type, status, reason, message, lastTransitionTime, observedGeneration), and a condition's
``lastTransitionTime`` changes only when its status does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from . import labels
from .clock import from_rfc3339, to_rfc3339
from .group_health import GroupRecord
from .observed import GroupObservation
from .rollout import FAILED, RolloutState
from .runtime_args import ServedModel
from .spec import DeploymentSpec

ROLLOUT_PHASES = ("UpdatingWeights", "RecapturingGraphs")


@dataclass(frozen=True)
class GroupReport:
    """A group's observation with its bookkeeping and any phase set by a running action."""

    observation: GroupObservation
    record: GroupRecord
    phase_override: str | None = None
    weight_version: str | None = None  # the leader's /get_server_info weight_version (RL weight sync)


def group_phase(report: GroupReport) -> str:
    """Phase of one group: Failed / override (Restarting, UpdatingWeights, ...) / observed."""
    group = report.observation
    if report.record.failed_message is not None:
        return "Failed"
    if report.phase_override:
        return report.phase_override
    if group.statefulset is None or not group.live_pods:
        return "Pending"
    if group.ready:
        return "Ready"
    return "Initializing" if any(p.phase == "Running" for p in group.live_pods) else "Pending"


def group_status(report: GroupReport, phase: str) -> dict[str, Any]:
    """One ``status.groups[]`` item."""
    group, record = report.observation, report.record
    served = group.served
    item: dict[str, Any] = {
        "index": group.index, "phase": phase, "pods": len(group.live_pods), "readyPods": group.ready_pods,
        "revision": served.revision if served else "", "restarts": record.restarts,
        "podUIDs": dict(record.pod_uids),
        "message": record.failed_message or "",
    }
    if record.last_restart_time is not None:
        item["lastRestartTime"] = to_rfc3339(record.last_restart_time)
    if report.weight_version is not None:
        item["weightVersion"] = report.weight_version
    return item


def record_from_status(item: Mapping[str, Any] | None) -> GroupRecord:
    """Inverse of the bookkeeping part of :func:`group_status`."""
    if not item:
        return GroupRecord()
    failed = item.get("message") if item.get("phase") == "Failed" else None
    return GroupRecord(restarts=int(item.get("restarts") or 0),
                       last_restart_time=from_rfc3339(item.get("lastRestartTime")),
                       pod_uids=dict(item.get("podUIDs") or {}), failed_message=failed or None)


def served_revision(groups: Sequence[GroupObservation]) -> str:
    """Revisions served now, in group order without repeats: ``rev-a`` or ``rev-b,rev-a`` (mixed)."""
    seen: list[str] = []
    for group in groups:
        if group.served is not None and group.served.revision not in seen:
            seen.append(group.served.revision)
    return ",".join(seen)


def deployment_phase(phases: Sequence[str], ready: int, replicas: int, rollout: RolloutState | None) -> str:
    """Aggregate phase of the deployment from its group phases."""
    for phase in ROLLOUT_PHASES:
        if phase in phases:
            return phase
    if "Failed" in phases:
        return "Failed" if ready == 0 else "Degraded"
    if "Restarting" in phases:
        return "Degraded"
    if ready == replicas:
        return "Degraded" if rollout is not None and rollout.phase == FAILED else "Ready"
    if ready == 0 and all(p == "Pending" for p in phases):
        return "Pending"
    return "Initializing"


def condition(ctype: str, ok: bool, reason: str, message: str, generation: int,
              previous: Sequence[Mapping[str, Any]], now: str) -> dict[str, Any]:
    """A standard condition; keeps the previous ``lastTransitionTime`` when the status is unchanged."""
    status = "True" if ok else "False"
    old = next((c for c in previous if c.get("type") == ctype), None)
    since = old.get("lastTransitionTime", now) if old is not None and old.get("status") == status else now
    return {"type": ctype, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": since, "observedGeneration": generation}


def build_status(spec: DeploymentSpec, generation: int, reports: Sequence[GroupReport],
                 rollout: RolloutState | None, previous: Mapping[str, Any], now: float) -> dict[str, Any]:
    """The whole ``status`` written after a reconcile (``now`` in Unix seconds)."""
    stamp = to_rfc3339(now)
    old_conditions = previous.get("conditions") or []
    phases = [group_phase(r) for r in reports]
    groups = [r.observation for r in reports]
    ready = sum(1 for p in phases if p == "Ready")
    phase = deployment_phase(phases, ready, spec.replicas, rollout)
    desired = ServedModel.desired(spec)
    failed_messages = [f"group {r.observation.index}: {r.record.failed_message}"
                       for r in reports if r.record.failed_message]
    all_updated = all(g.served is not None and g.served.path == desired.path
                      and g.served.revision == desired.revision for g in groups)
    graphs_current = all(g.served is not None and g.served.cuda_graph == desired.cuda_graph for g in groups)
    if rollout is not None and rollout.phase == FAILED:
        weights = (False, "UpdateFailed", rollout.message)
    elif all_updated:
        weights = (True, "Updated", f"all groups serve {desired.revision}")
    else:
        weights = (False, "Updating", rollout.message if rollout else f"rolling out {desired.revision}")
    if not desired.cuda_graph.enabled:
        graphs = (False, "Disabled", "spec.runtime.cudaGraph.enabled is false")
    elif graphs_current and ready == spec.replicas:
        graphs = (True, "Captured", f"decode graphs up to batch size {desired.cuda_graph.max_batch_size}")
    else:
        graphs = (False, "Capturing", "groups are starting or recapturing")
    progressing = phase in ("Pending", "Initializing", *ROLLOUT_PHASES) or (
        rollout is not None and rollout.phase != FAILED)
    message = "; ".join(failed_messages) or (rollout.message if rollout else "")
    conditions = [
        condition("Ready", ready == spec.replicas, "AllGroupsReady" if ready == spec.replicas else "GroupsNotReady",
                  f"{ready}/{spec.replicas} groups ready", generation, old_conditions, stamp),
        condition("Progressing", progressing, "RolloutInProgress" if progressing else "Stable", phase,
                  generation, old_conditions, stamp),
        condition("WeightsUpdated", *weights, generation, old_conditions, stamp),
        condition("GraphsCaptured", *graphs, generation, old_conditions, stamp),
        condition("Degraded", phase in ("Degraded", "Failed"), phase if phase in ("Degraded", "Failed") else "Healthy",
                  message, generation, old_conditions, stamp),
    ]
    status: dict[str, Any] = {
        "phase": phase,
        "message": message,
        "observedGeneration": generation,
        "replicas": spec.replicas,
        "readyReplicas": ready,
        "selector": labels.label_selector_string(labels.selector_labels(spec.name)),
        "servedRevision": served_revision(groups),
        "targetRevision": desired.revision,
        "groups": [group_status(r, p) for r, p in zip(reports, phases)],
        "conditions": conditions,
        "rollout": rollout.to_status() if rollout is not None else None,
    }
    return status


def invalid_spec_status(error: str, generation: int, previous: Mapping[str, Any], now: float) -> dict[str, Any]:
    """Status for a spec the operator cannot run: phase Failed, Ready=False/InvalidSpec."""
    stamp = to_rfc3339(now)
    old = previous.get("conditions") or []
    return {
        "phase": "Failed",
        "message": error,
        "observedGeneration": generation,
        "conditions": [condition("Ready", False, "InvalidSpec", error, generation, old, stamp),
                       condition("Degraded", True, "InvalidSpec", error, generation, old, stamp)],
    }


def status_patch(previous: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """JSON merge patch turning ``previous`` into ``new``: keys gone from ``new`` become None.

    Lists are replaced whole by a merge patch, so only nested objects need the deletions.
    """
    patch: dict[str, Any] = {}
    for key, value in new.items():
        old = previous.get(key)
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            patch[key] = status_patch(old, value)
        else:
            patch[key] = value
    for key in previous:
        if key not in new:
            patch[key] = None
    return patch
