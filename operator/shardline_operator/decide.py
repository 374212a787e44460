"""The one decision of a pass (pure): spec + observation + previous status -> :class:`PassPlan`.

Order, as the actions run: remove groups beyond ``replicas`` -> NetworkPolicies, Services, PDB
-> create missing StatefulSets -> group health (whole-group restarts) and template drift ->
staging Jobs (``staging_step``: a new hf:// / s3:// revision is staged on every node first, and
holds the in-place rollout until it is) -> either the next group of a restart rollout
(``restart_plan``) or the next step of the in-place rollout (``rollout.plan_rollout``) -> LoRA
adapters -> routing (``routing.py``: each leader's served-revision labels, out of routing before
its update, back after it, per-revision Services) -> status (with the trail of phases a group
passed through since the last pass), events, metrics and the next pass's time.

The digest, mixed-version and phase-override rules are computed here once and handed to both
the planner and the status: a group's recorded ``weightsDigest`` is forgotten when its
incarnation ends (restart, no Ready leader) or its update ends, and re-read from a leader that
serves; a group is a mixed version when its leader serves another revision or digest than
recorded (groups of the wave in flight and groups a restart rollout owns are not judged).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from .group_actions import PassBuilder, apply_group, children, groups_of, health
from .group_health import GroupRecord
from .lora_sync import decide_lora
from .observed import GroupObservation, pod_url
from .pass_plan import (
    AbortUpdate,
    DeletePods,
    Event,
    MetricDeltas,
    Observation,
    PassPlan,
    StartUpdate,
)
from .phases import DeploymentPhase, GroupPhase
from .restart_plan import needs_restart, next_restart
from .rollout import GroupView, RolloutPlan, plan_rollout
from .rollout_state import RolloutState
from .rollout_wave import wave_target
from .routing import plan_routing, with_leave_before_start
from .runtime_args import ServedModel
from .spec import DeploymentSpec
from .staging_status import checkpoint_digest, with_staging
from .staging_step import decide_staging
from .status import GroupReport, build_status
from .weights import WeightsPhase

RESTART_POLL_SECONDS = 2.0  # follow a restart rollout's replaced pods until the group is Ready


def _views(
    groups: list[GroupObservation],
    observed: Observation,
    digests: Mapping[int, str | None],
) -> list[GroupView]:
    views = []
    for group in groups:
        seen = group.answers
        leader = group.leader
        views.append(
            GroupView(
                group.index,
                group.served,
                group.ready,
                bool(group.live_pods),
                seen.report,
                digests.get(group.index),
                seen.update,
                seen.phases,
                seen.gate,
                leader.revision if leader is not None else None,
                seen.update_seconds,
                leader is not None,
                routable=group.routable,
            )
        )
    return views


def _weight_versions(
    groups: list[GroupObservation], views: list[GroupView], previous: Mapping[str, Any]
) -> dict[int, str]:
    """Each ready group's ``weight_version`` from its leader (set by a trainer's weight sync);
    an unreachable leader keeps the last reported value."""
    old = {item.get("index"): item.get("weightVersion") for item in previous.get("groups") or []}
    versions: dict[int, str] = {}
    for group, view in zip(groups, views):
        reported = view.leader.weight_version if group.ready and view.leader else None
        version = reported or old.get(group.index)
        if isinstance(version, str):
            versions[group.index] = version
    return versions


def _metrics(plan: RolloutPlan, views: list[GroupView], mixed: Mapping[int, str]) -> MetricDeltas:
    recaptures = dict(plan.group_recapture_seconds)  # as the runtime reported them
    counts: dict[str, int] = {}
    for view in views:
        if view.served is not None:
            counts[view.served.revision] = counts.get(view.served.revision, 0) + 1
    return MetricDeltas(
        tuple((seconds, recaptures.get(i)) for i, seconds in plan.group_update_seconds),
        plan.rollout_seconds,
        int(plan.rolled_back),
        plan.failed_updates,
        counts,
        len(mixed),
    )


def recorded_digests(
    groups: list[GroupObservation],
    previous: Mapping[str, Any],
    overrides: Mapping[int, GroupPhase],
) -> dict[int, str | None]:
    """Status's ``weightsDigest`` per group, forgotten for a group whose incarnation ended (a
    restart, or no Ready leader): new pods report afresh."""
    digests = {
        item.get("index"): checkpoint_digest(item.get("weightsDigest"))
        for item in previous.get("groups") or []
    }
    for group in groups:
        if overrides.get(group.index) == GroupPhase.RESTARTING or not group.ready:
            digests[group.index] = None
        elif group.leader is None:
            digests[group.index] = None
    return digests


def mixed_versions(views: list[GroupView], skip: set[int]) -> dict[int, str]:
    """Groups whose leader serves another revision or digest than recorded (not judged: the
    groups in ``skip``, those of the wave in flight and those a restart rollout owns)."""
    return {
        v.index: reason
        for v in views
        if v.index not in skip
        for reason in [v.mixed_reason()]
        if reason
    }


def _reported_digest(
    view: GroupView,
    index: int,
    plan: RolloutPlan,
    mixed: Mapping[int, str],
    overrides: Mapping[int, GroupPhase],
) -> str | None:
    """The digest to record afresh for a group with none recorded: what its leader reports while
    it serves (not for a group whose update just ended, a mixed version, or a restarting one)."""
    leader = view.leader
    if (
        leader is None
        or leader.weights_phase != WeightsPhase.SERVING
        or index in plan.forget_digest
        or index in mixed
        or overrides.get(index) == GroupPhase.RESTARTING
    ):
        return None
    return leader.digest


def _loading(state: RolloutState | None, views: list[GroupView]) -> dict[int, str]:
    """The revision each group of the wave in flight is loading (not yet served): the groups
    whose update was just sent or whose leader reports it loading (``group_phases``)."""
    if state is None:
        return {}
    return {
        v.index: wave_target(state, v).revision
        for v in views
        if v.index in state.wave and v.index in state.group_phases
    }


def _rollout_step(
    spec: DeploymentSpec,
    groups: list[GroupObservation],
    records: dict[int, GroupRecord],
    overrides: dict[int, GroupPhase],
    views: list[GroupView],
    rollout_state: RolloutState | None,
    stale: list[int],
    mixed: Mapping[int, str],
    now: float,
    out: PassBuilder,
    hold: bool = False,
) -> tuple[RolloutPlan, set[int]]:
    """The next group of a restart rollout, or the in-place rollout's next step (neither while
    stale groups wait for a wave in flight to end); updates ``groups``, ``records`` and
    ``overrides`` for what it does. Returns the rollout plan and the groups restarted by plan.

    ``hold``: the spec's revision is not staged yet (``staging.py``): no wave starts towards
    it; a wave already in flight is followed to the end of its own target."""
    wave = set(rollout_state.wave) if rollout_state is not None else set()
    failed = {i: r.failed_message is not None for i, r in records.items()}
    restart = next_restart(spec, groups, failed, bool(wave))
    plan = RolloutPlan(rollout_state)
    planned: set[int] = set()
    if restart is not None:
        i = restart.index
        groups[i] = apply_group(spec, restart, ServedModel.desired(spec), out, relabel=False)
        out.actions.append(DeletePods(i))
        records[i] = replace(records[i], pod_uids={}, failed_message=None)
        overrides[i] = GroupPhase.RESTARTING
        out.events.append(
            ("Normal", "GroupRestart", f"group {i}: rolling out the new pod template")
        )
        planned.add(i)
    elif hold and not wave:
        pass  # the rollout waits for staging; status.rollout stays as it is
    elif not (stale and not wave):
        desired = ServedModel.desired(spec)
        if hold and rollout_state is not None:
            desired = rollout_state.target
        plan = plan_rollout(
            rollout_state,
            desired,
            views,
            spec.weight_update,
            now,
            exclude=frozenset(stale),
            mixed=mixed,
            restarting=frozenset(i for i, p in overrides.items() if p == GroupPhase.RESTARTING),
            failed=frozenset(i for i, r in records.items() if r.failed_message is not None),
        )
        for index, body in plan.start.items():
            url = pod_url(groups[index].leader)
            if url is not None:
                timeout = spec.weight_update.timeout_seconds
                out.actions.append(StartUpdate(index, url, body, timeout))
        for index in plan.abort:
            url = pod_url(groups[index].leader)
            if url is not None:
                out.actions.append(AbortUpdate(index, url))
        for index, served in plan.apply.items():
            groups[index] = apply_group(spec, groups[index], served, out, relabel=True)
        overrides.update({i: GroupPhase(p) for i, p in plan.group_phases.items()})
        out.events.extend(plan.events)
    return plan, planned


def decide(
    spec: DeploymentSpec,
    observed: Observation,
    previous_status: Mapping[str, Any],
    now: float,
    operator_namespace: str | None = None,
    staging_cluster_role: str | None = None,
) -> PassPlan:
    """The whole pass as data (pure; ``now`` in Unix seconds). ``operator_namespace``: where
    the operator runs (its pod is admitted by the groups' NetworkPolicies);
    ``staging_cluster_role``: the chart's ClusterRole the staging pods are bound to (they
    annotate their own pods with live progress; None: they cannot)."""
    out = PassBuilder()
    previous = previous_status
    generation = observed.generation
    rollout_state = RolloutState.from_status(previous.get("rollout"))
    children(spec, observed, operator_namespace, out)
    groups, records = groups_of(spec, observed, previous, rollout_state, out)
    overrides = health(spec, groups, records, now, out)
    digests = recorded_digests(groups, previous, overrides)
    views = _views(groups, observed, digests)
    wave = set(rollout_state.wave) if rollout_state is not None else set()
    stale = [g.index for g in groups if needs_restart(spec, g)]
    mixed = mixed_versions(views, wave | set(stale))
    staging, staging_actions = decide_staging(
        spec, groups, observed.staging_jobs, previous, generation, now, staging_cluster_role
    )
    out.actions.extend(staging_actions)
    out.events.extend(staging.events)
    plan, planned = _rollout_step(
        spec,
        groups,
        records,
        overrides,
        views,
        rollout_state,
        stale,
        mixed,
        now,
        out,
        hold=staging.holds_rollout,
    )
    for index in planned:
        digests[index] = None
    for index in plan.forget_digest:
        digests[index] = None
    shown_mixed = {i: r for i, r in mixed.items() if i not in plan.apply}
    loading = _loading(plan.state, views)
    draining = [
        GroupReport(group, GroupRecord(), draining=True)
        for i, group in sorted(observed.groups.items())
        if i >= spec.replicas and group.pods
    ]
    versions = _weight_versions(groups, views, previous)
    shown_digests = {
        g.index: digests.get(g.index) or _reported_digest(v, g.index, plan, shown_mixed, overrides)
        for g, v in zip(groups, views)
    }

    def reports(trail: tuple[int, str] | None = None) -> list[GroupReport]:
        # A trail step replays a moment before this pass: a group whose update this pass starts
        # (the next wave, planned in the pass that ended the last one) was not updating then.
        later = set(plan.start) if trail else set()
        return [
            GroupReport(
                g,
                records[g.index],
                trail[1]
                if trail and g.index == trail[0]
                else None
                if g.index in later
                else overrides.get(g.index),
                versions.get(g.index),
                view=v,
                digest=shown_digests[g.index],
                mixed=shown_mixed.get(g.index),
                planned=g.index in planned,
                loading=None if g.index in later else loading.get(g.index),
                note=plan.notes.get(g.index),
            )
            for g, v in zip(groups, views)
        ]

    starting = frozenset(plan.start)
    wave_after = frozenset(plan.state.wave) if plan.state is not None else frozenset()
    routing = plan_routing(
        spec, groups, wave_after | starting, starting, observed.revision_services
    )
    routed = {"revisionServices": routing.status}
    trail = []
    for index, phase in plan.trail:  # phases passed through since the last pass
        step = build_status(
            spec,
            generation,
            reports((index, phase)),
            plan.state,
            previous,
            now,
            len(stale),
            draining,
        )
        step = {**with_staging(step, staging.state, generation, previous, now), **routed}
        event: Event = ("Normal", phase, f"group {index}: {phase}")
        trail.append((step, event))
        out.events.append(event)
        previous = {**step, "restartBudgetGeneration": generation}
    busy = set(plan.state.wave) if plan.state is not None else set()
    lora_actions, lora = decide_lora(spec.lora_adapters, groups, observed, busy)
    out.actions.extend(lora_actions)
    status = build_status(
        spec, generation, reports(), plan.state, previous, now, len(stale), draining
    )
    status = {**with_staging(status, staging.state, generation, previous, now), **routed}
    if status["phase"] != previous.get("phase"):
        troubled = (DeploymentPhase.DEGRADED, DeploymentPhase.FAILED)
        kind = "Warning" if status["phase"] in troubled else "Normal"
        detail = f": {status['message']}" if status["message"] else ""
        old_phase = previous.get("phase", "None")
        out.events.append(
            (kind, status["phase"], f"phase {old_phase} -> {status['phase']}{detail}")
        )
    requeue = plan.requeue_after_seconds
    if staging.requeue_after_seconds is not None:
        requeue = min(requeue or staging.requeue_after_seconds, staging.requeue_after_seconds)
    if stale and requeue is None:
        requeue = RESTART_POLL_SECONDS
    if out.requeue is not None:  # a health backoff ends sooner
        requeue = min(requeue if requeue is not None else out.requeue, out.requeue)
    actions = with_leave_before_start(out.actions, routing.leave)
    return PassPlan(
        status,
        (*actions, *routing.labels, *routing.services),
        tuple(trail),
        tuple(out.events),
        _metrics(plan, views, shown_mixed),
        requeue,
        spec.restart_policy.max_group_restarts,
        replace(lora, shown=bool(spec.lora_adapters or previous_status.get("loraAdapters"))),
    )
