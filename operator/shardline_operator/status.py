"""Observed state -> ``InferenceDeployment.status`` (pure).

Phases (DESIGN 3.1): Pending, Initializing, Ready, UpdatingWeights, RecapturingGraphs,
RollingOut, Degraded, Failed; per group also Restarting. Conditions have the standard shape
(type, status, reason, message, lastTransitionTime, observedGeneration), and a condition's
``lastTransitionTime`` changes only when its status does.

Truth rules (issue 9): ``Ready`` only when every group is Ready *and* serves the target;
mid-rollout (in place or by restart) the phase is ``RollingOut`` with the ``Progressing``
condition saying how far (``1/2 groups on rev-b``), never ``Ready``, ``Initializing`` or
``Degraded``; ``Degraded`` is kept for unplanned trouble (a health restart, a mixed version, a
failed rollout). A group's ``revision`` is what its leader reports, else its leader pod's label.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import labels
from .clock import from_rfc3339, to_rfc3339
from .group_health import GroupRecord
from .observed import GroupObservation, PodObservation
from .parallelism import ParallelismSpec
from .rollout import GroupView
from .rollout_state import FAILED, RolloutState
from .runtime_args import ServedModel
from .spec import DeploymentSpec

ROLLOUT_PHASES = ("UpdatingWeights", "RecapturingGraphs")
ROLLING_OUT = "RollingOut"


@dataclass(frozen=True)
class GroupReport:
    """A group's observation with its bookkeeping and any phase set by a running action.

    ``weight_version``: the leader's ``weight_version``; ``view``: what its leader reported this
    pass; ``digest``: the ``weightsDigest`` to record;
    ``mixed``: why it is a mixed version, or None; ``planned``: a ``Restarting`` override is part
    of a rollout (not Degraded).
    """

    observation: GroupObservation
    record: GroupRecord
    phase_override: str | None = None
    weight_version: str | None = (
        None  # the leader's /get_server_info weight_version (RL weight sync)
    )
    view: GroupView | None = None
    digest: str | None = None
    mixed: str | None = None
    planned: bool = False

    @property
    def revision(self) -> str:
        """The revision the group serves now: its leader's report, else the leader pod's label
        (else its StatefulSet's), and "" without a live leader pod."""
        if self.view is not None and self.view.leader is not None and self.view.served is not None:
            return self.view.served.revision
        leader, declared = self.observation.leader, self.observation.served
        if leader is None:  # no live leader (starting, or the old one terminating): serves nothing
            return ""
        return leader.revision or (declared.revision if declared is not None else "")


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


def rank_status(pod: PodObservation, parallelism: ParallelismSpec) -> dict[str, Any]:
    """One ``status.groups[].ranks[]`` item: which pod and node hold the node rank, its
    pipeline stages and TP ranks (``ppRanks`` x ``tpRanks``), and how it is."""
    item: dict[str, Any] = {
        "rank": pod.rank if pod.rank is not None else -1,
        "pod": pod.name,
        "node": pod.node or "",
        "ready": pod.ready,
        "phase": "Terminating" if pod.deleting else pod.phase,
    }
    if pod.rank is not None and 0 <= pod.rank < parallelism.pods_per_group:
        ranks = parallelism.pod_ranks(pod.rank)
        item["ppRanks"], item["tpRanks"] = list(ranks.pp_ranks), list(ranks.tp_ranks)
    if pod.error_message:
        item["lastError"] = pod.error_message[:256]
    return item


def restart_message(report: GroupReport, phase: str) -> str | None:
    """While a group restarts after a failure (not a rollout's planned restart): why, as the
    first error line one of its pods wrote to its termination log (None without one)."""
    if phase != "Restarting" or report.planned:
        return None
    error = next((p.error_message for p in report.observation.pods if p.error_message), None)
    return f"restarting after: {error}" if error else None


def group_status(report: GroupReport, phase: str, parallelism: ParallelismSpec) -> dict[str, Any]:
    """One ``status.groups[]`` item (``parallelism`` maps each pod to its pp and tp ranks)."""
    group, record = report.observation, report.record
    item: dict[str, Any] = {
        "index": group.index,
        "phase": phase,
        "pods": len(group.live_pods),
        "readyPods": group.ready_pods,
        "revision": report.revision,
        "restarts": record.restarts,
        "podUIDs": dict(record.pod_uids),
        "message": record.failed_message or report.mixed or restart_message(report, phase) or "",
        "ranks": [rank_status(p, parallelism) for p in group.pods],
    }
    if report.digest:
        item["weightsDigest"] = report.digest
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
    return GroupRecord(
        restarts=int(item.get("restarts") or 0),
        last_restart_time=from_rfc3339(item.get("lastRestartTime")),
        pod_uids=dict(item.get("podUIDs") or {}),
        failed_message=failed or None,
    )


def served_revision(revisions: Sequence[str]) -> str:
    """Revisions served now, in group order without repeats: ``rev-a`` or ``rev-b,rev-a`` (mixed)."""
    seen: list[str] = []
    for revision in revisions:
        if revision and revision not in seen:
            seen.append(revision)
    return ",".join(seen)


def deployment_phase(
    phases: Sequence[str],
    ready: int,
    replicas: int,
    rollout: RolloutState | None,
    rolling: bool = False,
    mixed: bool = False,
    planned_restart: bool = False,
) -> str:
    """Aggregate phase of the deployment from its group phases.

    ``rolling``: some group does not serve the target yet (or a rollout is running);
    ``mixed``: a leader serves another version than recorded; ``planned_restart``: every
    ``Restarting`` group is being replaced by a rollout (not a failure).
    """
    if mixed:  # detected this pass; the repair that starts now shows as UpdatingWeights next
        return "Degraded"
    for phase in ROLLOUT_PHASES:
        if phase in phases:
            return phase
    if "Failed" in phases:
        return "Failed" if ready == 0 else "Degraded"
    unplanned = "Restarting" in phases and not planned_restart
    if unplanned or (rollout is not None and rollout.phase == FAILED and ready == replicas):
        return "Degraded"
    if rolling:
        return ROLLING_OUT
    if ready == replicas:
        return "Ready"
    if ready == 0 and all(p == "Pending" for p in phases):
        return "Pending"
    return "Initializing"


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
) -> dict[str, Any]:
    """The whole ``status`` written after a reconcile (``now`` in Unix seconds).

    ``restarts_pending``: groups a restart rollout has still to replace (their pods are old).
    """
    stamp = to_rfc3339(now)
    old_conditions = previous.get("conditions") or []
    phases = [group_phase(r) for r in reports]
    desired = ServedModel.desired(spec)
    ready = sum(1 for r, p in zip(reports, phases) if r.observation.ready and p != "Failed")
    on_target = [
        r
        for r in reports
        if r.observation.served is not None
        and (r.observation.served.path, r.observation.served.revision)
        == (desired.path, desired.revision)
        and r.revision == desired.revision
        and not r.mixed
    ]
    graphs_current = all(
        r.observation.served is not None and r.observation.served.cuda_graph == desired.cuda_graph
        for r in reports
    )
    rollout_active = rollout is not None and rollout.phase != FAILED
    unplanned = any(p == "Restarting" and not r.planned for r, p in zip(reports, phases))
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
    if not desired.cuda_graph.enabled:
        graphs = (False, "Disabled", "spec.runtime.cudaGraph.enabled is false")
    elif graphs_current and ready == spec.replicas:
        graphs = (
            True,
            "Captured",
            f"decode graphs up to batch size {desired.cuda_graph.max_batch_size}",
        )
    else:
        graphs = (False, "Capturing", "groups are starting or recapturing")
    progressing = (
        phase in ("Pending", "Initializing", ROLLING_OUT, *ROLLOUT_PHASES) or rollout_active
    )
    message = "; ".join(failed_messages + mixed) or (rollout.message if rollout else "")
    serving = phase == "Ready"
    degraded = phase in ("Degraded", "Failed")
    degraded_reason = (
        "MixedVersions"
        if mixed
        else (
            "RolloutFailed"
            if rollout is not None
            and rollout.phase == FAILED
            and not failed_messages
            and not unplanned
            else phase
        )
    )
    conditions = [
        condition(
            "Ready",
            serving,
            "AllGroupsReady"
            if serving
            else ("RollingOut" if phase == ROLLING_OUT else "GroupsNotReady"),
            f"{ready}/{spec.replicas} groups ready; {progress}",
            generation,
            old_conditions,
            stamp,
        ),
        condition(
            "Progressing",
            progressing,
            "RolloutInProgress" if progressing else "Stable",
            progress if rolling else phase,
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
    return {
        "phase": phase,
        "message": message or (progress if rolling else ""),
        "observedGeneration": generation,
        "replicas": spec.replicas,
        "readyReplicas": ready,
        "selector": labels.label_selector_string(labels.selector_labels(spec.name)),
        "servedRevision": served_revision([r.revision for r in reports]),
        "targetRevision": desired.revision,
        "groups": [group_status(r, p, spec.parallelism) for r, p in zip(reports, phases)],
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
        "phase": "Failed",
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
