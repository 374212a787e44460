"""In-place rollout of weights (``spec.model``) and CUDA-graph settings: a pure planner.

Plan, then execute, as LWS's disaggregated-set controller does: the executor
(``rollout_executor.py``) first gathers what each group's leader reports (weights phase,
revision, digest, the state of an update request this process sent, a canary's gate result);
:func:`plan_rollout` then computes the next step from that and ``status.rollout``
(:class:`RolloutState`) alone; the executor performs it (start updates, re-render StatefulSets,
record metrics). Rules:

- The TP group is the unit. A wave updates at most ``weightUpdate.maxUnavailable`` groups at
  once; with ``canary`` the first wave is one group, which must then pass the gate
  (``/health_generate`` plus the optional ``verify`` prompt and latency bound) before the rest
  follow; ``pauseSeconds`` separates waves.
- A wave in flight is always awaited, whatever the spec says meanwhile; then the target is the
  *latest* spec (a revert mid-rollout sends the groups that reached the old target back).
- What a group serves is what its leader reports when it reports it, else its StatefulSet's
  annotations. A leader serving another model or digest than recorded is a mixed version:
  reported (Degraded) and repaired by updating that group to the target.
- A failed update or gate with ``rollbackOnFailure`` sends the groups on the failed target back
  to the previous model the same way, then Failed, with the reason.
- Failed holds: the failed target is not retried, and a fleet the failure left split (no
  rollback, or a rollback that failed too) stays as it is, reported as such, until the spec
  changes. A mixed version seen while Failed (e.g. an update the operator gave up on that the
  runtime finished later) is repaired in place to the group's last good weights: what its
  StatefulSet declares (a group's declared model changes only when an update to it succeeded).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .rollout_state import FAILED, PAUSED, ROLLING_BACK, UPDATING, VERIFYING, RolloutState
from .runtime_args import ServedModel
from .spec import WeightUpdateSpec
from .weights import LeaderReport, WeightsPhase

PHASE_BY_WEIGHTS_PHASE = {
    WeightsPhase.LOADING: "UpdatingWeights",
    WeightsPhase.RECAPTURING: "RecapturingGraphs",
}
POLL_SECONDS = 0.5  # next pass while a wave is in flight: a group's end is seen within this


@dataclass(frozen=True)
class GroupView:
    """One group as gathered before planning.

    ``declared``: what its StatefulSet says it serves; ``recorded_digest``: status's
    ``weightsDigest`` from the last pass; ``update``: ``(state, message)`` of an update request
    this process sent (``pending``, ``success``, ``failure``, or ``unknown`` when it sent none);
    ``phases``: weights phases sampled while it ran; ``gate``: ``(passed, message)`` of the
    canary verification when it was run this pass; ``pod_revision``: the revision label of the
    leader pod (what it was started with or last relabelled to), if known; ``update_seconds``:
    the runtime's ``load_seconds`` / ``recapture_seconds`` for the update that ``update`` reports
    ended (empty otherwise).
    """

    index: int
    declared: ServedModel | None
    ready: bool = True
    live: bool = True
    leader: LeaderReport | None = None
    recorded_digest: str | None = None
    update: tuple[str, str] = ("unknown", "")
    phases: tuple[WeightsPhase, ...] = ()
    gate: tuple[bool, str] | None = None
    pod_revision: str | None = None
    update_seconds: Mapping[str, float] = field(default_factory=dict)

    @property
    def served(self) -> ServedModel | None:
        """The leader's model when it reports one (serving or failed), else ``declared``."""
        leader, declared = self.leader, self.declared
        if (
            declared is not None
            and leader is not None
            and leader.weights_phase in (WeightsPhase.SERVING, WeightsPhase.FAILED)
            and leader.model_path
            and leader.revision is not None
        ):
            return ServedModel(leader.model_path, leader.revision, declared.cuda_graph)
        return declared

    def mixed_reason(self) -> str | None:
        """Why the leader serves something else than recorded, or None."""
        served, declared, leader = self.served, self.declared, self.leader
        if served is None or declared is None or leader is None:
            return None
        expected = self.pod_revision or declared.revision
        if served.revision != expected or (
            expected == declared.revision and served.path != declared.path
        ):
            return f"group {self.index}: leader serves {served.revision} ({served.path}), expected {expected}"
        if self.recorded_digest and leader.digest and leader.digest != self.recorded_digest:
            return f"group {self.index}: leader serves digest {leader.digest[:19]}, status records {self.recorded_digest[:19]}"
        return None


@dataclass
class RolloutPlan:
    """The next step: new state, updates to start, StatefulSets to re-render, status and metrics.

    ``trail`` lists (group, phase) passed through since the last pass (written as status
    transitions before ``group_phases``); ``mixed`` maps groups to their mixed-version reason;
    ``forget_digest`` lists groups whose recorded digest is stale (re-recorded from the leader);
    ``group_update_seconds`` / ``group_recapture_seconds``: (group, seconds) of updates that
    ended this pass (the operator's wall time; the runtime's reported recapture time).
    """

    state: RolloutState | None
    start: dict[int, dict[str, Any]] = field(default_factory=dict)
    apply: dict[int, ServedModel] = field(default_factory=dict)
    group_phases: dict[int, str] = field(default_factory=dict)
    trail: list[tuple[int, str]] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    mixed: dict[int, str] = field(default_factory=dict)
    forget_digest: list[int] = field(default_factory=list)
    requeue_after_seconds: float | None = None
    group_update_seconds: list[tuple[int, float]] = field(default_factory=list)
    group_recapture_seconds: list[tuple[int, float]] = field(default_factory=list)
    rollout_seconds: float | None = None
    rolled_back: bool = False
    failed_updates: int = 0


def update_body(current: ServedModel | None, target: ServedModel) -> dict[str, Any]:
    """JSON body of ``/update_weights_from_disk`` (DESIGN 2.4) moving ``current`` to ``target``."""
    body: dict[str, Any] = {
        "model_path": target.path,
        "revision": target.revision,
        "recapture_cuda_graph": target.cuda_graph.enabled,
    }
    if current is None or target.cuda_graph != current.cuda_graph:
        body.update(
            cuda_graph_max_bs=target.cuda_graph.max_batch_size,
            disable_cuda_graph=not target.cuda_graph.enabled,
        )
    return body


def plan_rollout(
    state: RolloutState | None,
    desired: ServedModel,
    groups: Sequence[GroupView],
    policy: WeightUpdateSpec,
    now: float,
    exclude: frozenset[int] = frozenset(),
    mixed: Mapping[int, str] | None = None,
) -> RolloutPlan:
    """The next step towards ``desired`` (pure). ``exclude``: groups a restart rollout owns;
    ``mixed``: group -> why it is a mixed version (``decide.mixed_versions``; by default every
    group outside the wave in flight is judged here)."""
    views = {g.index: g for g in groups}
    wave = set(state.wave) if state is not None else set()
    if mixed is None:
        mixed = {g.index: r for g in groups if g.index not in wave for r in [g.mixed_reason()] if r}
    out = RolloutPlan(state, mixed=dict(mixed))
    if state is not None and state.wave:
        return _follow_wave(state, views, policy, now, out)
    if state is not None and state.phase == VERIFYING and state.target == desired:
        canary = views.get(state.canary) if state.canary is not None else None
        if canary is None or canary.gate is None:
            out.requeue_after_seconds = POLL_SECONDS
            return out
        passed, message = canary.gate
        if not passed:
            return _fail(
                state,
                views,
                policy,
                f"canary group {state.canary} failed verification: {message}",
                out,
            )
        state = replace(
            state,
            phase=UPDATING,
            canary=None,
            canary_passed=True,
            message=f"canary group {canary.index} passed verification",
        )
        out.events.append(("Normal", "CanaryPassed", state.message))
    if state is not None and state.phase == PAUSED and state.target == desired:
        if state.pause_until is not None and now < state.pause_until:
            out.requeue_after_seconds = state.pause_until - now
            return out
        state = replace(state, phase=UPDATING, pause_until=None)
    if state is not None and state.phase == FAILED and state.target == desired:
        if all(g.served == desired for g in groups if g.served is not None):
            out.state = (
                None  # the target was reached another way (a restart rollout): nothing failed now
            )
            return out
        return _repair_while_failed(state, groups, now, exclude, out)
    if state is not None and state.phase == ROLLING_BACK and state.target == desired:
        target = state.previous or desired
        todo = [g for g in groups if g.served == state.target and g.index not in exclude]
    else:
        target = desired
        todo = [
            g
            for g in groups
            if g.index not in exclude
            and g.served is not None
            and (g.served != desired or g.index in out.mixed)
        ]
        if (
            state is None
            or state.target != desired
            or state.phase not in (UPDATING, PAUSED, VERIFYING)
        ):
            if not todo:
                out.state = None
                return out
            counts = Counter(g.served for g in todo if g.served != desired)
            previous = counts.most_common(1)[0][0] if counts else None
            state = RolloutState(
                UPDATING,
                desired,
                previous,
                rollout_started_at=now,
                canary_passed=policy.canary is None or len(todo) < 2,
            )
    out.state = state
    if not todo:
        return _finish(state, target, now, out)
    gated = state.phase == UPDATING and not state.canary_passed
    size = 1 if gated else policy.max_unavailable
    for g in todo:
        if not g.live:  # nothing runs: the next start loads the target from the template
            out.apply[g.index] = target
            out.forget_digest.append(g.index)
    ready = [g for g in todo if g.live and g.ready][:size]
    if not ready:
        if not out.apply:
            out.state = replace(state, message=f"waiting for group {todo[0].index} to be Ready")
        out.requeue_after_seconds = POLL_SECONDS if out.apply else None
        return out
    for g in ready:
        out.start[g.index] = update_body(g.served, target)
        out.group_phases[g.index] = "UpdatingWeights"
    names = ", ".join(str(g.index) for g in ready)
    progress = f"updating group{'s' if len(ready) > 1 else ''} {names} to {target.revision}" + (
        " (canary)" if gated else ""
    )
    out.state = replace(
        state,
        wave=tuple(g.index for g in ready),
        started_at=now,
        group_phases={g.index: "UpdatingWeights" for g in ready},
        canary=ready[0].index if gated else None,
        message=progress if state.phase == UPDATING else state.message,
    )
    out.events.append(("Normal", "UpdatingWeights", progress))
    out.requeue_after_seconds = POLL_SECONDS
    return out


def _repair_while_failed(
    state: RolloutState,
    groups: Sequence[GroupView],
    now: float,
    exclude: frozenset[int],
    out: RolloutPlan,
) -> RolloutPlan:
    """Failed: send each mixed-version group back to what its StatefulSet declares (its last good
    weights), as a wave that keeps the phase Failed; nothing else moves."""
    repair = [
        g
        for g in groups
        if g.index in out.mixed
        and g.index not in exclude
        and g.live
        and g.ready
        and g.declared is not None
        and g.served is not None
    ]
    if not repair:
        return out
    for g in repair:
        assert g.declared is not None and g.served is not None  # selected above
        out.start[g.index] = update_body(g.served, g.declared)
        out.group_phases[g.index] = "UpdatingWeights"
        out.events.append(
            (
                "Warning",
                "RepairingMixedVersion",
                f"{out.mixed[g.index]}; updating it back to {g.declared.revision}",
            )
        )
    out.state = replace(
        state,
        wave=tuple(g.index for g in repair),
        started_at=now,
        group_phases={g.index: "UpdatingWeights" for g in repair},
    )
    out.requeue_after_seconds = POLL_SECONDS
    return out


def _wave_target(state: RolloutState, view: GroupView) -> ServedModel:
    """What a group of the wave in flight is being updated to."""
    if state.phase == FAILED and view.declared is not None:  # a repair: its last good weights
        return view.declared
    return (state.previous or state.target) if state.phase == ROLLING_BACK else state.target


def _result(view: GroupView, target: ServedModel) -> tuple[str, str]:
    """Outcome of a group's update: this process's request first, else what the leader says
    (the operator restarted, or the request was lost)."""
    state, message = view.update
    if state != "unknown":
        return state, message
    leader = view.leader
    if leader is None:
        return "pending", "leader unreachable"
    if leader.weights_phase.updating:
        return "pending", leader.weights_phase.value
    if leader.weights_phase == WeightsPhase.FAILED:
        return "failure", leader.message or "runtime reports weights_phase=failed"
    if (leader.model_path, leader.revision) == (target.path, target.revision):
        return "success", ""
    return "unknown", ""


def _follow_wave(
    state: RolloutState,
    views: Mapping[int, GroupView],
    policy: WeightUpdateSpec,
    now: float,
    out: RolloutPlan,
) -> RolloutPlan:
    """Await every group of the wave in flight; then decide what follows."""
    target = (state.previous or state.target) if state.phase == ROLLING_BACK else state.target
    still, phases, failures = [], {}, []
    started = state.started_at if state.started_at is not None else now
    for index in state.wave:
        view = views.get(index)
        if view is None:  # scaled away meanwhile
            continue
        target = _wave_target(state, view)
        result, message = _result(view, target)
        last = state.group_phases.get(index, "UpdatingWeights")
        trail = _trail(last, view.phases)
        if result == "unknown":  # nobody is updating it: send the request (again)
            out.start[index] = update_body(view.served, target)
            result = "pending"
        if result == "pending" and now - started > policy.timeout_seconds:
            result, message = "failure", f"timed out after {policy.timeout_seconds}s"
        if result == "pending":
            reported = view.leader.weights_phase if view.leader else WeightsPhase.SERVING
            phase = PHASE_BY_WEIGHTS_PHASE.get(reported, trail[-1] if trail else last)
            if trail and trail[-1] == phase:
                trail.pop()
            out.trail += [(index, p) for p in trail]
            out.group_phases[index], phases[index] = phase, phase
            still.append(index)
        elif result == "success":
            if target.cuda_graph.enabled and (trail[-1] if trail else last) != "RecapturingGraphs":
                trail.append(
                    "RecapturingGraphs"
                )  # shorter than the sampling interval, still a step
            out.trail += [(index, p) for p in trail]
            out.apply[index] = target
            out.forget_digest.append(index)
            out.group_update_seconds.append((index, now - started))
            if "recapture_seconds" in view.update_seconds:
                out.group_recapture_seconds.append(
                    (index, view.update_seconds["recapture_seconds"])
                )
            out.events.append(("Normal", "GroupUpdated", f"group {index} serves {target.revision}"))
        else:
            out.failed_updates += 1
            failures.append(f"group {index}: update to {target.revision} failed: {message}")
    if still:
        out.state = replace(state, wave=tuple(still), group_phases=phases)
        out.requeue_after_seconds = POLL_SECONDS
        return out
    done = replace(state, wave=(), started_at=None, group_phases={})
    if (
        done.phase == FAILED
    ):  # a repair wave ended; the rollout stays Failed, the next pass checks again
        out.state = done
        for failure in failures:
            out.events.append(("Warning", "MixedVersionRepairFailed", failure))
        return out
    if failures:
        updated = set(out.apply) | {i for i, v in views.items() if v.served == target}
        if done.phase == ROLLING_BACK:  # a rollback that fails stops where it is
            updated = set()
        return _fail(done, views, policy, "; ".join(failures), out, updated=bool(updated))
    out.requeue_after_seconds = 0.0
    if done.phase == UPDATING and not done.canary_passed and done.canary is not None:
        out.state = replace(
            done,
            phase=VERIFYING,
            message=f"verifying canary group {done.canary} on {target.revision}",
        )
        out.events.append(("Normal", "VerifyingCanary", out.state.message))
        return out
    message = f"groups {', '.join(map(str, sorted(out.apply)))} serve {target.revision}"
    if done.phase == UPDATING and policy.pause_seconds > 0:
        out.state = replace(
            done,
            phase=PAUSED,
            pause_until=now + policy.pause_seconds,
            message=f"{message}; next wave in {policy.pause_seconds}s",
        )
        return out
    out.state = replace(done, message=message if done.phase == UPDATING else done.message)
    return out


def _fail(
    state: RolloutState,
    views: Mapping[int, GroupView],
    policy: WeightUpdateSpec,
    reason: str,
    out: RolloutPlan,
    updated: bool | None = None,
) -> RolloutPlan:
    """A wave or the gate failed: roll back the groups already on the target, or stop."""
    if updated is None:
        updated = any(v.served == state.target for v in views.values())
    if (
        state.phase != ROLLING_BACK
        and policy.rollback_on_failure
        and updated
        and state.previous is not None
    ):
        out.state = replace(state, phase=ROLLING_BACK, canary=None, message=reason)
        out.rolled_back = True
        out.requeue_after_seconds = 0.0
        out.events.append(("Warning", "WeightUpdateFailed", reason + "; rolling back"))
        return out
    out.state = replace(state, phase=FAILED, wave=(), canary=None, message=reason)
    out.events.append(("Warning", "WeightUpdateFailed", reason))
    return out


def _finish(state: RolloutState, target: ServedModel, now: float, out: RolloutPlan) -> RolloutPlan:
    """Nothing left to update: a rollback ends Failed, a rollout ends (state cleared)."""
    if state.phase == ROLLING_BACK:
        message = f"{state.message}; rolled back to {target.revision}"
        out.state = replace(state, phase=FAILED, wave=(), message=message)
        out.events.append(("Warning", "RolledBack", message))
        return out
    out.state = None
    if state.rollout_started_at is not None:
        out.rollout_seconds = now - state.rollout_started_at
    out.events.append(("Normal", "RolloutComplete", f"all groups serve {target.revision}"))
    return out


def _trail(reported: str | None, weights_phases: Sequence[WeightsPhase]) -> list[str]:
    """Operator phases for sampled runtime phases, without repeats of the one last reported."""
    trail: list[str] = []
    last = reported
    for weights_phase in weights_phases:
        phase = PHASE_BY_WEIGHTS_PHASE.get(weights_phase)
        if phase is not None and phase != last:
            trail.append(phase)
            last = phase
    return trail
