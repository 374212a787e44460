"""Following the wave in flight (pure, part of the rollout planner): await every group of the
wave, count a group as updated only once its leader is Ready on the target, then decide what
follows (the next wave, the canary gate, a pause, a rollback or Failed).

When the spec moves on while the wave loads (a revert, a second target), each group still
loading the old target is cancelled (``/abort_weight_update``): aborted before its commit, it
keeps serving what it served; committed already, it counts as updated to the old target and the
planner sends it on to the new one in the same pass, before it is ever counted available."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from .phases import GroupPhase
from .rollout_state import FAILED, PAUSED, ROLLING_BACK, UPDATING, VERIFYING, RolloutState
from .rollout_view import PHASE_BY_WEIGHTS_PHASE, POLL_SECONDS, GroupView, RolloutPlan, update_body
from .runtime_args import ServedModel
from .spec import WeightUpdateSpec
from .weights import WeightsPhase


def wave_target(state: RolloutState, view: GroupView) -> ServedModel:
    """What a group of the wave in flight is being updated to."""
    if state.phase == FAILED and view.declared is not None:  # a repair: its last good weights
        return view.declared
    return (state.previous or state.target) if state.phase == ROLLING_BACK else state.target


def superseded(state: RolloutState, view: GroupView, desired: ServedModel | None) -> bool:
    """The spec changed since the wave began, away from what ``view``'s group is loading (a
    rollback loading the previous model while the spec still names the failed target is not)."""
    return desired is not None and state.target != desired and wave_target(state, view) != desired


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
    if target.served_by(leader.model_path, leader.revision, leader.draft_model_path):
        return "success", ""
    return "unknown", ""


def _confirmed(view: GroupView, target: ServedModel) -> bool:
    """The group's pods are Ready (none terminating) and its leader serves ``target`` (a leader
    that cannot be asked is judged by its pods alone)."""
    if not (view.live and view.ready):
        return False
    leader = view.leader
    return leader is None or (
        leader.weights_phase == WeightsPhase.SERVING
        and target.served_by(leader.model_path, leader.revision, leader.draft_model_path)
    )


def _went_away(view: GroupView, result: str) -> bool:
    """Whether an ``aborted`` or ``failure`` result came from the leader going away rather than
    from the update: an abort while a pod is terminating or unready (a drain aborts the load);
    a failed request only while the leader pod is being deleted or gone (killed while it
    drained; a crash that leaves the pod fails the update, as it always did). A leader that
    stays may be unready during an update longer than its readiness probe's failure threshold
    (``/ready`` answers 503 while an update sent without ``keep_ready`` runs), so unready alone
    does not excuse a failure: that would turn a bad checkpoint into a wait until the timeout."""
    if result == "aborted":
        return not (view.live and view.ready)
    return result == "failure" and not view.leader_pod


def follow_wave(
    state: RolloutState,
    views: Mapping[int, GroupView],
    policy: WeightUpdateSpec,
    now: float,
    out: RolloutPlan,
    desired: ServedModel | None = None,
) -> RolloutPlan:
    """Await every group of the wave in flight; then decide what follows. A group counts as
    updated only once it is available on its target (:meth:`GroupView.serves`): a reply from a
    leader that is not Ready, or is terminating, does not count. ``desired``: what the spec
    asks for now; a group still loading another target is cancelled (see the module notes)."""
    target = (state.previous or state.target) if state.phase == ROLLING_BACK else state.target
    still, phases, failures = [], {}, []
    started = state.started_at if state.started_at is not None else now
    for index in state.wave:
        view = views.get(index)
        if view is None:  # scaled away meanwhile
            continue
        target = wave_target(state, view)
        cancel = superseded(state, view, desired)
        result, message = _result(view, target)
        if result == "success" and not _confirmed(view, target):
            result, message = "pending", f"waiting for the leader to be Ready on {target.revision}"
        last = state.group_phases.get(index)  # None: nothing was seen loading yet
        trail = _trail(last, view.phases)
        if result == "unknown" and cancel:  # nothing loads the old target: nothing to cancel
            result = "aborted"
        elif result == "unknown":  # nobody is updating it: send the request (again)
            out.start[index] = update_body(view.served, target)
            result = "pending"
            out.events.append(
                (
                    "Normal",
                    "UpdateSent",
                    f"group {index}: no update was running; sending the update to "
                    f"{target.revision} again",
                )
            )
        elif _went_away(view, result):
            # the leader went away mid-update (a drained pod aborts its load; one killed or
            # crashed while draining drops the request): its new pod is updated once it serves,
            # and a failure the runtime reports is read from that leader on the next pass
            result, message = "pending", "the leader was replaced during the update"
        elif result == "aborted" and not cancel:  # another client aborted it
            result, message = "failure", f"aborted ({message})"
        if result == "pending" and cancel:
            assert desired is not None  # cancel implies it
            out.abort.append(index)
            out.notes[index] = (
                f"loading {target.revision}; cancelling (the target is now {desired.revision})"
            )
        if result == "pending" and now - started > policy.timeout_seconds:
            result, message = "failure", f"timed out after {policy.timeout_seconds}s"
        if result == "aborted":
            served = view.served.revision if view.served is not None else "its weights"
            out.events.append(
                (
                    "Normal",
                    "UpdateCancelled",
                    f"group {index}: update to {target.revision} cancelled before it "
                    f"committed; it serves {served}",
                )
            )
        elif result == "pending":
            phase = _shown_phase(view, index in out.start, trail[-1] if trail else last)
            if phase is not None and phase != (trail[-1] if trail else last):
                trail.append(phase)  # first seen now (say, after a restart): a transition too
            out.trail += [(index, p) for p in trail]  # each with its status write and event
            if phase is not None:
                out.group_phases[index] = phases[index] = phase
            still.append(index)
        elif result == "success":
            # Recapturing is a step only when the runtime did it: a phase it reported (already in
            # the trail) or recapture time in its reply, shorter than the sampling interval.
            # A CPU pod captures nothing, so its trail has no such step.
            recaptured = view.update_seconds.get("recapture_seconds", 0.0) > 0
            if recaptured and (trail[-1] if trail else last) != GroupPhase.RECAPTURING_GRAPHS:
                trail.append(GroupPhase.RECAPTURING_GRAPHS)
            out.trail += [(index, p) for p in trail]
            out.apply[index] = target
            out.forget_digest.append(index)
            out.group_update_seconds.append((index, now - started))
            if "recapture_seconds" in view.update_seconds:
                out.group_recapture_seconds.append(
                    (index, view.update_seconds["recapture_seconds"])
                )
            out.events.append(("Normal", "GroupUpdated", f"group {index} serves {target.revision}"))
            if cancel:
                assert desired is not None  # cancel implies it
                late = (
                    f"group {index} committed {target.revision} before the cancel could stop "
                    f"it; sending it to {desired.revision}"
                )
                out.events.append(("Warning", "UpdateCommittedBeforeCancel", late))
                out.notes[index] = late
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
        return fail(done, views, policy, "; ".join(failures), out, updated=bool(updated))
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


def fail(
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


def _shown_phase(view: GroupView, just_sent: bool, last: str | None) -> str | None:
    """The phase status shows for a group of the wave whose update has not ended: what its
    leader reports (``loading`` -> UpdatingWeights, ``recapturing`` -> RecapturingGraphs), else
    ``last`` while this process's request is on its way or the leader cannot be asked (the
    runtime reports ``loading`` as soon as a request arrives), else None: nothing loads, and the
    group shows what its pods show (after an operator restart, or an update sent again)."""
    leader = view.leader
    if leader is not None and leader.weights_phase in PHASE_BY_WEIGHTS_PHASE:
        return PHASE_BY_WEIGHTS_PHASE[leader.weights_phase]
    own_request = view.update[0] == "pending" and not just_sent
    return last if own_request else None


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
