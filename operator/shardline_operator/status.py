"""Observed state -> ``InferenceDeployment.status`` (pure).

Phases (DESIGN 3.1): Pending, Initializing, Ready, UpdatingWeights, RecapturingGraphs,
RollingOut, Degraded, Failed; per group also Restarting. Conditions have the standard shape
(type, status, reason, message, lastTransitionTime, observedGeneration), and a condition's
``lastTransitionTime`` changes only when its status does.

Truth rules (issue 9): ``Ready`` only when every group is Ready *and* serves the target;
mid-rollout (in place or by restart) the phase is ``RollingOut`` with the ``Progressing``
condition saying how far (``1/2 groups on rev-b``), never ``Ready``, ``Initializing`` or
``Degraded``; ``Degraded`` is kept for unplanned trouble (a health restart, a mixed version, a
failed rollout). A group's ``revision`` is what its leader reports, else a Ready leader pod's
label, and empty while no leader serves; ``servedRevision`` lists the groups' revisions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import labels
from .clock import to_rfc3339
from .group_status import (
    GroupReport,
    graphs_condition,
    group_phase,
    group_status,
    record_from_status,
    restart_message,
)
from .phases import DeploymentPhase, GroupPhase
from .rollout_state import FAILED, RolloutState
from .runtime_args import ServedModel
from .spec import DeploymentSpec

__all__ = [
    "GroupReport",
    "build_status",
    "deployment_phase",
    "invalid_spec_status",
    "record_from_status",
    "served_revision",
    "status_patch",
]

ROLLOUT_PHASES = (DeploymentPhase.UPDATING_WEIGHTS, DeploymentPhase.RECAPTURING_GRAPHS)
ROLLING_OUT = DeploymentPhase.ROLLING_OUT


def served_revision(revisions: Sequence[str]) -> str:
    """Revisions served now, in group order without repeats: ``rev-a`` or ``rev-b,rev-a`` (mixed)."""
    seen: list[str] = []
    for revision in revisions:
        if revision and revision not in seen:
            seen.append(revision)
    return ",".join(seen)


def _model_kind(report: GroupReport) -> str | None:
    """What a group's leader says it serves (``generate`` / ``embed``), or None unheard."""
    leader = report.view.leader if report.view is not None else None
    return leader.model_kind if leader is not None else None


def deployment_phase(
    phases: Sequence[str],
    ready: int,
    replicas: int,
    rollout: RolloutState | None,
    rolling: bool = False,
    mixed: bool = False,
    planned_restart: bool = False,
) -> DeploymentPhase:
    """Aggregate phase of the deployment from its group phases.

    ``rolling``: some group does not serve the target yet (or a rollout is running);
    ``mixed``: a leader serves another version than recorded; ``planned_restart``: every
    ``Restarting`` group is being replaced by a rollout (not a failure).
    """
    if mixed:  # detected this pass; the repair that starts now shows as UpdatingWeights next
        return DeploymentPhase.DEGRADED
    for phase in ROLLOUT_PHASES:
        if phase in phases:
            return phase
    if GroupPhase.FAILED in phases:
        return DeploymentPhase.FAILED if ready == 0 else DeploymentPhase.DEGRADED
    unplanned = GroupPhase.RESTARTING in phases and not planned_restart
    if unplanned or (rollout is not None and rollout.phase == FAILED and ready == replicas):
        return DeploymentPhase.DEGRADED
    if rolling:
        return ROLLING_OUT
    if ready == replicas:
        return DeploymentPhase.READY
    if ready == 0 and all(p == GroupPhase.PENDING for p in phases):
        return DeploymentPhase.PENDING
    return DeploymentPhase.INITIALIZING


def condition(
    ctype: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int,
    previous: Sequence[Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    """A standard condition; keeps the previous ``lastTransitionTime`` when the status is unchanged."""
    status = "True" if ok else "False"
    old = next((c for c in previous if c.get("type") == ctype), None)
    since = (
        old.get("lastTransitionTime", now)
        if old is not None and old.get("status") == status
        else now
    )
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def build_status(
    spec: DeploymentSpec,
    generation: int,
    reports: Sequence[GroupReport],
    rollout: RolloutState | None,
    previous: Mapping[str, Any],
    now: float,
    restarts_pending: int = 0,
    draining: Sequence[GroupReport] = (),
) -> dict[str, Any]:
    """The whole ``status`` written after a reconcile (``now`` in Unix seconds).

    ``restarts_pending``: groups a restart rollout has still to replace (their pods are old);
    ``draining``: groups beyond ``replicas`` whose pods still terminate (listed, and the
    deployment is Progressing until they are gone). At ``replicas: 0`` the phase is
    ``ScalingDown`` then ``ScaledToZero``, and no condition claims serving, weights or graphs.
    """
    stamp = to_rfc3339(now)
    old_conditions = previous.get("conditions") or []
    phases = [group_phase(r) for r in reports]
    desired = ServedModel.desired(spec)
    ready = sum(
        1 for r, p in zip(reports, phases) if r.observation.ready and p != GroupPhase.FAILED
    )
    on_target = [
        r
        for r in reports
        if r.observation.served is not None
        and (r.observation.served.path, r.observation.served.revision)
        == (desired.path, desired.revision)
        and r.revision == desired.revision
        and not r.mixed
        and r.loading is None
    ]
    graphs_current = all(
        r.observation.served is not None and r.observation.served.cuda_graph == desired.cuda_graph
        for r in reports
    )
    rollout_active = rollout is not None and rollout.phase != FAILED
    unplanned = any(p == GroupPhase.RESTARTING and not r.planned for r, p in zip(reports, phases))
    mixed = [r.mixed for r in reports if r.mixed]
    all_updated = len(on_target) == len(reports) and graphs_current
    declared_behind = any(
        r.observation.served is not None and r.observation.served != desired for r in reports
    )
    # A group still starting has no leader to report yet: that is Initializing, not a rollout.
    restarting = restarts_pending > 0 or any(r.planned for r in reports)
    # A rollout is over when every group is Ready on the target: the last group a restart rollout
    # replaced is still part of it while it starts (not "Initializing").
    rolling = (
        rollout_active
        or restarting
        or declared_behind
        or (ready == spec.replicas and not all_updated)
        or (previous.get("phase") == ROLLING_OUT and ready < spec.replicas and not unplanned)
    )
    # While groups are being replaced, an earlier failed in-place rollout is not what is happening.
    phase = deployment_phase(
        phases,
        ready,
        spec.replicas,
        None if restarting else rollout,
        rolling,
        bool(mixed),
        not unplanned,
    )
    failed_messages = [
        f"group {r.observation.index}: {r.record.failed_message}"
        for r in reports
        if r.record.failed_message
    ]
    failed_messages += [
        f"group {r.observation.index}: {m}"
        for r, p in zip(reports, phases)
        if (m := restart_message(r, p)) is not None and not r.record.failed_message
    ]
    progress = f"{len(on_target)}/{spec.replicas} groups on {desired.revision}"
    if rollout is not None and rollout.phase == FAILED:
        weights = (False, "UpdateFailed", rollout.message)
    elif all_updated:
        weights = (True, "Updated", f"all groups serve {desired.revision}")
    else:
        weights = (
            False,
            "Updating",
            rollout.message if rollout else f"rolling out {desired.revision}",
        )
    if spec.replicas == 0:  # nothing serves: no claim about weights or graphs
        phase = DeploymentPhase.SCALING_DOWN if draining else DeploymentPhase.SCALED_TO_ZERO
        weights = (False, phase.value, "replicas is 0: no group runs")
        graphs = (False, phase.value, "replicas is 0: no group runs")
    else:  # what the leaders really captured, not what the spec asks for
        graphs = graphs_condition(reports, graphs_current and ready == spec.replicas)
    starting = (DeploymentPhase.PENDING, DeploymentPhase.INITIALIZING, ROLLING_OUT)
    progressing = phase in (*starting, *ROLLOUT_PHASES) or rollout_active or bool(draining)
    message = "; ".join(failed_messages + mixed) or (rollout.message if rollout else "")
    serving = phase == DeploymentPhase.READY
    degraded = phase in (DeploymentPhase.DEGRADED, DeploymentPhase.FAILED)
    if draining and not rolling:
        progress = f"{len(draining)} group{'s' if len(draining) > 1 else ''} terminating"
    if spec.replicas == 0:
        ready_reason = phase.value
    elif serving:
        ready_reason = "AllGroupsReady"
    else:
        ready_reason = "RollingOut" if phase == ROLLING_OUT else "GroupsNotReady"
    degraded_reason = (
        "MixedVersions"
        if mixed
        else (
            "RolloutFailed"
            if rollout is not None
            and rollout.phase == FAILED
            and not failed_messages
            and not unplanned
            else phase.value
        )
    )
    conditions = [
        condition(
            "Ready",
            serving,
            ready_reason,
            f"{ready}/{spec.replicas} groups ready; {progress}",
            generation,
            old_conditions,
            stamp,
        ),
        condition(
            "Progressing",
            progressing,
            "RolloutInProgress" if progressing else "Stable",
            progress if rolling or draining else phase.value,
            generation,
            old_conditions,
            stamp,
        ),
        condition("WeightsUpdated", *weights, generation, old_conditions, stamp),
        condition("GraphsCaptured", *graphs, generation, old_conditions, stamp),
        condition(
            "Degraded",
            degraded,
            degraded_reason if degraded else "Healthy",
            message if degraded else "",
            generation,
            old_conditions,
            stamp,
        ),
    ]
    groups = [group_status(r, p, spec.parallelism) for r, p in zip(reports, phases)]
    groups += [group_status(r, group_phase(r), spec.parallelism) for r in draining]
    return {
        "phase": phase.value,
        "message": message or (progress if rolling or draining else ""),
        "observedGeneration": generation,
        "replicas": spec.replicas,
        "readyReplicas": ready,
        "selector": labels.label_selector_string(labels.selector_labels(spec.name)),
        "servedRevision": served_revision([r.revision for r in reports]),
        "modelKind": served_revision([kind for r in reports if (kind := _model_kind(r))]),
        "targetRevision": desired.revision,
        "groups": groups,
        "conditions": conditions,
        "rollout": rollout.to_status() if rollout is not None else None,
    }


def invalid_spec_status(
    error: str, generation: int, previous: Mapping[str, Any], now: float
) -> dict[str, Any]:
    """Status for a spec the operator cannot run: phase Failed, Ready=False/InvalidSpec."""
    stamp = to_rfc3339(now)
    old = previous.get("conditions") or []
    return {
        "phase": DeploymentPhase.FAILED.value,
        "message": error,
        "observedGeneration": generation,
        "conditions": [
            condition("Ready", False, "InvalidSpec", error, generation, old, stamp),
            condition("Degraded", True, "InvalidSpec", error, generation, old, stamp),
        ],
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
