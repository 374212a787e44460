"""What a pass does to a deployment's children (pure, part of ``decide``).

Remove groups beyond ``replicas``; apply the NetworkPolicies, Services and PDB; create missing
StatefulSets; restart a whole group whose health (``group_health``) or pod template says so;
re-render a group's StatefulSet for the model it serves now. Each function appends typed
actions and events to a :class:`PassBuilder`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from . import labels
from .group_health import GroupRecord
from .group_health import decide as decide_health
from .observed import GroupObservation
from .pass_plan import (
    Action,
    ApplyObject,
    DeleteObject,
    DeletePods,
    Event,
    Observation,
    RelabelPods,
)
from .phases import GroupPhase
from .render import (
    build_client_service,
    build_network_policy,
    build_pod_disruption_budget,
    build_rank_service,
    build_statefulset,
)
from .rollout_state import RolloutState
from .runtime_args import ServedModel
from .spec import DeploymentSpec
from .status import record_from_status


@dataclass
class PassBuilder:
    """The plan being built (local to one :func:`decide` call)."""

    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue: float | None = None  # soonest time-based reason for the next pass

    def requeue_within(self, seconds: float) -> None:
        self.requeue = seconds if self.requeue is None else min(self.requeue, seconds)


def children(
    spec: DeploymentSpec, observed: Observation, operator_namespace: str | None, out: PassBuilder
) -> None:
    """Remove groups beyond ``replicas``; apply the NetworkPolicies, Services and PDB."""
    for index, group in sorted(observed.groups.items()):
        if index < spec.replicas or group.statefulset is None:
            continue
        out.actions.append(
            DeleteObject("apps/v1", "StatefulSet", labels.statefulset_name(spec.name, index))
        )
        out.actions.append(
            DeleteObject("v1", "Service", labels.rank_service_name(spec.name, index))
        )
        out.events.append(
            ("Normal", "GroupRemoved", f"group {index} removed (replicas={spec.replicas})")
        )
    wanted = set()
    if spec.network_policy.enabled:
        for index in range(spec.replicas):
            policy = build_network_policy(spec, index, operator_namespace)
            out.actions.append(ApplyObject(policy))
            wanted.add(policy["metadata"]["name"])
    for name in observed.network_policies:
        if name not in wanted:
            out.actions.append(DeleteObject("networking.k8s.io/v1", "NetworkPolicy", name))
    for index in range(spec.replicas):
        out.actions.append(ApplyObject(build_rank_service(spec, index)))
    out.actions.append(ApplyObject(build_client_service(spec)))
    out.actions.append(ApplyObject(build_pod_disruption_budget(spec)))


def new_group_model(
    spec: DeploymentSpec, observed: Observation, rollout: RolloutState | None
) -> ServedModel:
    """What a group created now loads: the spec's model, except while a rollout is unfinished
    (or failed), when it joins the lowest existing group and is rolled with the rest."""
    if rollout is not None:
        for index, group in sorted(observed.groups.items()):
            if group.served is not None and index < spec.replicas:
                return group.served
    return ServedModel.desired(spec)


def groups_of(
    spec: DeploymentSpec,
    observed: Observation,
    previous: Mapping[str, Any],
    rollout: RolloutState | None,
    out: PassBuilder,
) -> tuple[list[GroupObservation], dict[int, GroupRecord]]:
    """Each group below ``replicas`` with its bookkeeping; a missing StatefulSet is created."""
    reset = previous.get("restartBudgetGeneration") != observed.generation
    old = {item.get("index"): item for item in previous.get("groups") or []}
    model = new_group_model(spec, observed, rollout)
    size = spec.parallelism.pods_per_group
    groups, records = [], {}
    for index in range(spec.replicas):
        record = record_from_status(old.get(index))
        records[index] = GroupRecord(pod_uids=record.pod_uids) if reset else record
        group = observed.groups.get(index) or GroupObservation(index, size, None, ())
        if group.statefulset is None:
            sts = build_statefulset(spec, index, model)
            out.actions.append(ApplyObject(sts, cached=False))
            name = sts["metadata"]["name"]
            out.events.append(("Normal", "GroupCreated", f"group {index}: StatefulSet {name}"))
            group = replace(group, statefulset=sts)
        groups.append(group)
    return groups, records


def health(
    spec: DeploymentSpec,
    groups: list[GroupObservation],
    records: dict[int, GroupRecord],
    now: float,
    out: PassBuilder,
) -> dict[int, GroupPhase]:
    """Whole-group restarts (health, then pods from an older template); the phase overrides."""
    overrides: dict[int, GroupPhase] = {}
    budget = spec.restart_policy.max_group_restarts
    for group in groups:
        decision = decide_health(group, records[group.index], spec.restart_policy, now)
        records[group.index] = decision.record
        if decision.action == "restart":
            out.actions.append(DeletePods(group.index))
            overrides[group.index] = GroupPhase.RESTARTING
            restarts = decision.record.restarts
            out.events.append(
                (
                    "Warning",
                    "GroupRestart",
                    f"group {group.index} restart {restarts}/{budget}: {decision.reason}",
                )
            )
        elif decision.action == "wait":
            overrides[group.index] = GroupPhase.RESTARTING
            if decision.retry_in_seconds is not None:  # no event ends a backoff: come back then
                out.requeue_within(decision.retry_in_seconds)
        elif decision.action == "fail":
            out.events.append(("Warning", "GroupFailed", f"group {group.index}: {decision.reason}"))
        hashes = {p.restart_hash for p in group.live_pods}
        drifted = hashes and hashes != {group.restart_hash}
        if drifted and overrides.get(group.index) != GroupPhase.RESTARTING:
            out.actions.append(DeletePods(group.index))
            records[group.index] = replace(records[group.index], pod_uids={})
            overrides[group.index] = GroupPhase.RESTARTING
            out.events.append(
                ("Normal", "GroupRestart", f"group {group.index}: pods from an older pod template")
            )
    return overrides


def apply_group(
    spec: DeploymentSpec,
    group: GroupObservation,
    served: ServedModel,
    out: PassBuilder,
    relabel: bool,
) -> GroupObservation:
    """Re-render the group's StatefulSet for ``served`` (and relabel its running pods)."""
    sts = build_statefulset(spec, group.index, served)
    out.actions.append(ApplyObject(sts, cached=False))
    if not relabel:
        return replace(group, statefulset=sts)
    live = tuple(p.name for p in group.live_pods)
    if live:
        out.actions.append(RelabelPods(live, served.revision))
    pods = tuple(p if p.deleting else replace(p, revision=served.revision) for p in group.pods)
    return replace(group, statefulset=sts, pods=pods)
