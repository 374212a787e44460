"""In-place rollout of weights (``spec.model``) and CUDA-graph settings: a pure planner.

Plan, then execute, as LWS's disaggregated-set controller does: ``observe`` first gathers what
each group's leader reports (weights phase, revision, digest, the state of an update request
this process sent, a canary's gate result); ``decide`` turns that into :class:`GroupView`
records and :func:`plan_rollout` computes the next step from them and ``status.rollout``
(:class:`RolloutState`) alone; ``execute`` performs it (start updates, re-render StatefulSets,
record metrics). Rules:

- Availability (issue 23): a group is available when its pods are Ready (none terminating), its
  leader serves the revision and digest recorded for it, and it is back in routing
  (:attr:`GroupView.available`). A wave starts only while the unavailable groups (restarting,
  terminating, unready, updating, or out of routing), the wave included, number at most
  ``maxUnavailable`` (:func:`unavailable_groups`). A group whose update ended is still out of
  routing in the pass that counts it updated (it returns after that pass's status, once its
  ``/health_generate`` passes), so that pass takes no further group out, and a failed return
  check holds the rollout until a later pass returns it. A group counts as updated only once it
  is Ready on the target (a reply from a leader that is not Ready does not count); the rollout
  completes, with one ``RolloutComplete``, once every group serves the target and is back in
  routing.
- The TP group is the unit. A wave updates at most ``weightUpdate.maxUnavailable`` groups at
  once; with ``canary`` the first wave is one group, which must then pass the gate
  (``/health_generate`` plus the optional ``verify`` prompt and latency bound) before the rest
  follow; ``pauseSeconds`` separates waves.
- A wave in flight is always awaited; when the spec moves on meanwhile (a revert, a second
  target) each group still loading the old target is cancelled (``/abort_weight_update``: it
  keeps its old weights), and one that committed first is sent on to the latest spec in the same
  pass, before it counts as available. Then the target is the *latest* spec (a revert
  mid-rollout sends the groups that reached the old target back).
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
from dataclasses import replace

from .phases import GroupPhase
from .rollout_state import FAILED, PAUSED, ROLLING_BACK, UPDATING, VERIFYING, RolloutState
from .rollout_view import POLL_SECONDS, GroupView, RolloutPlan, update_body
from .rollout_wave import fail, follow_wave
from .runtime_args import ServedModel
from .spec import WeightUpdateSpec

__all__ = ["GroupView", "RolloutPlan", "plan_rollout", "unavailable_groups", "update_body"]

RESUMABLE = (UPDATING, PAUSED, VERIFYING)  # a rollout the planner may redirect to a new target


def plan_rollout(
    state: RolloutState | None,
    desired: ServedModel,
    groups: Sequence[GroupView],
    policy: WeightUpdateSpec,
    now: float,
    exclude: frozenset[int] = frozenset(),
    mixed: Mapping[int, str] | None = None,
    restarting: frozenset[int] = frozenset(),
    failed: frozenset[int] = frozenset(),
) -> RolloutPlan:
    """The next step towards ``desired`` (pure). ``exclude``: groups a restart rollout owns;
    ``mixed``: group -> why it is a mixed version (``decide.mixed_versions``; by default every
    group outside the wave in flight is judged here); ``restarting``: groups whose pods are
    being replaced (unavailable whatever their pods say); ``failed``: groups out of their
    restart budget (out of service until the spec changes: neither counted nor awaited).

    Availability invariant: a wave starts only while the groups that are not available
    (:func:`unavailable_groups`), the wave included, number at most ``maxUnavailable``; the
    rollout completes only once every group serves the target.
    """
    views = {g.index: g for g in groups}
    wave = set(state.wave) if state is not None else set()
    if mixed is None:
        mixed = {g.index: r for g in groups if g.index not in wave for r in [g.mixed_reason()] if r}
    out = RolloutPlan(state, mixed=dict(mixed))
    if state is not None and state.wave:
        out = follow_wave(state, views, policy, now, out, desired)
        ended = out.state
        if ended is None or ended.wave or ended.phase not in RESUMABLE:
            return out
        if ended.target == desired and ended.phase != UPDATING:
            return out  # the canary gate or a pause comes first
        # The wave ended (the spec may have moved on): plan the next step in this same pass,
        # with the groups just updated seen as what they now are. They are still out of routing
        # (they return after this pass's status), so they count against maxUnavailable: a group
        # they committed to an old target is sent on now, but no other group leaves yet.
        groups = [_updated(g, out.apply[g.index]) if g.index in out.apply else g for g in groups]
        views = {g.index: g for g in groups}
        state = ended
    if state is not None and state.phase == VERIFYING and state.target == desired:
        canary = views.get(state.canary) if state.canary is not None else None
        if canary is None or canary.gate is None:
            out.requeue_after_seconds = POLL_SECONDS
            return out
        passed, message = canary.gate
        if not passed:
            return fail(
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
        if state is None or state.target != desired or state.phase not in RESUMABLE:
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
        return _finish(state, target, groups, now, out, failed)
    gated = state.phase == UPDATING and not state.canary_passed
    size = 1 if gated else policy.max_unavailable
    for g in todo:
        if not g.live:  # nothing runs: the next start loads the target from the template
            out.apply[g.index] = target
            out.forget_digest.append(g.index)
    unavailable = unavailable_groups(groups, restarting, failed)
    ready: list[GroupView] = []
    blocked = False
    for g in todo:
        if not (g.live and g.ready) or g.index in restarting or len(ready) == size:
            continue
        if len(unavailable | {r.index for r in ready} | {g.index}) > policy.max_unavailable:
            blocked = True
            continue
        ready.append(g)
    if not ready:
        if not out.apply:
            out.state = replace(state, message=_waiting(groups, todo, unavailable, blocked, policy))
            out.requeue_after_seconds = None
        else:  # a wave ended (0.0: the next pass at once, after the returns to routing)
            asked = out.requeue_after_seconds
            out.requeue_after_seconds = POLL_SECONDS if asked is None else min(asked, POLL_SECONDS)
        return out
    for g in ready:
        out.start[g.index] = update_body(g.served, target)
        out.group_phases[g.index] = GroupPhase.UPDATING_WEIGHTS
    names = ", ".join(str(g.index) for g in ready)
    progress = f"updating group{'s' if len(ready) > 1 else ''} {names} to {target.revision}" + (
        " (canary)" if gated else ""
    )
    out.state = replace(
        state,
        wave=tuple(g.index for g in ready),
        started_at=now,
        group_phases={g.index: GroupPhase.UPDATING_WEIGHTS for g in ready},
        canary=ready[0].index if gated else None,
        message=progress if state.phase == UPDATING else state.message,
    )
    out.events.append(("Normal", GroupPhase.UPDATING_WEIGHTS.value, progress))
    out.requeue_after_seconds = POLL_SECONDS
    return out


def unavailable_groups(
    groups: Sequence[GroupView], restarting: frozenset[int], failed: frozenset[int]
) -> set[int]:
    """The groups that count against ``maxUnavailable`` (issue 23's invariant, in this one
    place): every group that is not :attr:`GroupView.available` (unready, terminating, loading,
    a mixed version, or out of routing: its return check pending or failed) or is
    ``restarting``; not those in ``failed`` (out of service until the spec changes)."""
    return {
        g.index
        for g in groups
        if g.index not in failed and (g.index in restarting or not g.available)
    }


def _updated(view: GroupView, served: ServedModel) -> GroupView:
    """``view`` once its update to ``served`` was counted: declared and labelled ``served``
    (the StatefulSet and pods are re-rendered in this pass), its digest to be recorded afresh."""
    return replace(view, declared=served, pod_revision=served.revision, recorded_digest=None)


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
        out.group_phases[g.index] = GroupPhase.UPDATING_WEIGHTS
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
        group_phases={g.index: GroupPhase.UPDATING_WEIGHTS for g in repair},
    )
    out.requeue_after_seconds = POLL_SECONDS
    return out


def _waiting(
    groups: Sequence[GroupView],
    todo: Sequence[GroupView],
    unavailable: set[int],
    blocked: bool,
    policy: WeightUpdateSpec,
) -> str:
    """Why no wave starts: the unavailable groups fill ``maxUnavailable`` (all of them only out
    of routing: "returning to routing"), or none is Ready."""
    if not blocked:
        return f"waiting for group {todo[0].index} to be Ready"
    names = ", ".join(str(i) for i in sorted(unavailable))
    plural = "s" if len(unavailable) > 1 else ""
    returning = {g.index for g in groups if g.index in unavailable and g.returning}
    why = "returning to routing" if returning == unavailable else "unavailable"
    return f"waiting: group{plural} {names} {why} (maxUnavailable {policy.max_unavailable})"


def _finish(
    state: RolloutState,
    target: ServedModel,
    groups: Sequence[GroupView],
    now: float,
    out: RolloutPlan,
    failed: frozenset[int],
) -> RolloutPlan:
    """Nothing left to update: a rollback ends Failed; a rollout ends (state cleared) once every
    group is available on the target, back in routing included (the last wave's groups return
    after the pass that counts them updated, so the rollout, and ``RollingOut``, last until the
    pass after that), with one ``RolloutComplete``."""
    waiting = [g.index for g in groups if g.index not in failed and not g.serves(target)]
    if waiting and state.phase != ROLLING_BACK:
        message = f"waiting for group {waiting[0]} to be available on {target.revision}"
        out.state = replace(state, message=message)
        return out
    returning = [g.index for g in groups if g.index not in failed and not g.routable]
    if returning and state.phase != ROLLING_BACK:  # the last wave's groups return after this pass
        names = ", ".join(map(str, returning))
        plural = "s" if len(returning) > 1 else ""
        message = f"waiting for group{plural} {names} to return to routing on {target.revision}"
        out.state = replace(state, message=message)  # the next pass: at once after a wave ended
        return out
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
