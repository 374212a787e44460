"""decide() when the target changes while a group loads (issue 23 item 3): the load is cancelled
(``AbortUpdate``); aborted, the group keeps its weights; committed first, it is sent to the new
target in the same pass and never counted available on the reverted weights. Rows as in
test_decide_table.py."""

from __future__ import annotations

import pytest

from shardline_operator.decide import decide
from shardline_operator.pass_plan import AbortUpdate

from test_decide_availability import ROLLOUT_B, WAVE_0, condition
from test_decide_table import REV_A, _model, changes, leader, observation, pods, previous_status

REV_C = REV_A.replace("rev-a", "rev-c")
NOW = 1_800_000_000.0
ROLLBACK = {**WAVE_0, "phase": "RollingBack"}  # sending group 0 back to rev-a after a failure


def aborts(plan):
    return [a.group for a in plan.actions if isinstance(a, AbortUpdate)]


def events(plan, reason):
    return [e for e in plan.events if e[1] == reason]


@pytest.fixture
def spec_a(make_spec):
    return make_spec()  # reverted to rev-a while group 0 loads rev-b (WAVE_0)


@pytest.fixture
def spec_c(make_spec):
    return make_spec({"model": {**_model(), "path": REV_C, "revision": "rev-c"}})


def loading(spec, make_pod, update=("pending", "")):
    return {0: (pods(spec, make_pod, 0, ready=False), leader("rev-a", phase="loading", update=update))}


# --- while the old target loads


def test_a_revert_while_a_group_loads_cancels_its_load(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, loading(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert aborts(plan) == [0]


def test_a_second_target_while_a_group_loads_cancels_its_load(spec_c, make_pod):
    plan = decide(spec_c, observation(spec_c, make_pod, loading(spec_c, make_pod)),
                  previous_status(spec_c, rollout=WAVE_0), NOW)
    assert aborts(plan) == [0]


def test_a_cancelled_load_starts_no_other_update_while_it_runs(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, loading(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert changes(plan) == []


def test_the_group_being_cancelled_says_so(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, loading(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert plan.status["groups"][0]["message"] == "loading rev-b; cancelling (the target is now rev-a)"


def test_a_group_being_cancelled_keeps_weights_updated_false(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, loading(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert condition(plan, "WeightsUpdated")["status"] == "False"


def test_a_rollback_loading_the_previous_model_is_not_cancelled(make_spec, make_pod):
    spec_b = make_spec({"model": {**_model(), "path": REV_A.replace("rev-a", "rev-b"), "revision": "rev-b"}})
    plan = decide(spec_b, observation(spec_b, make_pod, loading(spec_b, make_pod)),
                  previous_status(spec_b, rollout=ROLLBACK), NOW)
    assert aborts(plan) == []


def test_a_load_without_a_change_of_target_is_not_cancelled(make_spec, make_pod):
    spec_b = make_spec({"model": {**_model(), "path": REV_A.replace("rev-a", "rev-b"), "revision": "rev-b"}})
    plan = decide(spec_b, observation(spec_b, make_pod, loading(spec_b, make_pod)),
                  previous_status(spec_b, rollout=WAVE_0), NOW)
    assert aborts(plan) == []


# --- the load was aborted before its commit


def aborted(spec, make_pod):
    return {0: (pods(spec, make_pod, 0), leader("rev-a", update=("aborted", "aborted before it committed")))}


def test_an_aborted_load_ends_the_wave_without_another_update(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, aborted(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert changes(plan) == []


def test_an_aborted_load_ends_the_rollout_when_every_group_serves_the_revert(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, aborted(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert plan.status.get("rollout") is None


def test_an_aborted_load_is_reported_as_cancelled(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, aborted(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert [e[2] for e in events(plan, "UpdateCancelled")] == [
        "group 0: update to rev-b cancelled before it committed; it serves rev-a"]


def test_an_aborted_load_is_not_a_failed_update(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, aborted(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert plan.metrics.failed_updates == 0


def test_an_aborted_load_leaves_the_group_ready_on_the_revert(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, aborted(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert (plan.status["groups"][0]["phase"], plan.status["groups"][0]["revision"]) == ("Ready", "rev-a")


def test_after_an_aborted_load_a_second_target_starts_its_own_wave(spec_c, make_pod):
    plan = decide(spec_c, observation(spec_c, make_pod, aborted(spec_c, make_pod)),
                  previous_status(spec_c, rollout=WAVE_0), NOW)
    assert changes(plan) == [("StartUpdate", 0, "rev-c")]


def test_an_update_aborted_by_someone_else_fails_the_wave(make_spec, make_pod):
    spec_b = make_spec({"model": {**_model(), "path": REV_A.replace("rev-a", "rev-b"), "revision": "rev-b"}})
    plan = decide(spec_b, observation(spec_b, make_pod, aborted(spec_b, make_pod)),
                  previous_status(spec_b, rollout=WAVE_0), NOW)
    assert plan.metrics.failed_updates == 1


def test_after_an_operator_restart_a_superseded_wave_is_not_sent_again(spec_a, make_pod):
    nothing_loads = {0: (pods(spec_a, make_pod, 0), leader("rev-a"))}  # poll knows no request
    plan = decide(spec_a, observation(spec_a, make_pod, nothing_loads), previous_status(spec_a, rollout=WAVE_0), NOW)
    assert changes(plan) == []


# --- the load committed before the cancel could stop it


def committed(spec, make_pod):
    return {0: (pods(spec, make_pod, 0), leader("rev-b", update=("success", "")))}


def test_a_load_that_committed_first_is_sent_back_in_the_same_pass(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, committed(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert ("StartUpdate", 0, "rev-a") in changes(plan)


def test_a_load_that_committed_first_is_never_shown_ready(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, committed(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert plan.status["groups"][0]["phase"] == "UpdatingWeights"


def test_a_load_that_committed_first_shows_the_revision_it_serves(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, committed(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert plan.status["groups"][0]["revision"] == "rev-b"


def test_a_load_that_committed_first_says_so_in_status(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, committed(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert plan.status["groups"][0]["message"] == (
        "group 0 committed rev-b before the cancel could stop it; sending it to rev-a")


def test_a_load_that_committed_first_warns(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, committed(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert len(events(plan, "UpdateCommittedBeforeCancel")) == 1


def test_a_load_that_committed_first_keeps_weights_updated_false(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, committed(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert condition(plan, "WeightsUpdated")["status"] == "False"


def test_a_load_that_committed_first_completes_no_rollout(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, committed(spec_a, make_pod)),
                  previous_status(spec_a, rollout=WAVE_0), NOW)
    assert events(plan, "RolloutComplete") == []


def test_the_rollout_after_a_revert_targets_the_revert(spec_a, make_pod):
    plan = decide(spec_a, observation(spec_a, make_pod, committed(spec_a, make_pod)),
                  previous_status(spec_a, rollout=ROLLOUT_B | {"wave": [0], "startedAt": WAVE_0["startedAt"]}), NOW)
    assert plan.status["rollout"]["targetRevision"] == "rev-a"


# --- after an operator restart, status follows the leaders (issue 23, the smaller lies)

RESTARTED = {**WAVE_0}  # what the killed operator wrote; the new one's leader client knows no request
FIRST_SEEN = {k: v for k, v in WAVE_0.items() if k != "groupPhases"}  # nothing seen loading yet


def spec_b_of(make_spec):
    return make_spec({"model": {**_model(), "path": REV_A.replace("rev-a", "rev-b"), "revision": "rev-b"}})


def test_after_a_restart_a_group_nothing_loads_is_not_shown_updating(make_spec, make_pod):
    spec_b = spec_b_of(make_spec)
    idle = {0: (pods(spec_b, make_pod, 0), leader("rev-a"))}
    plan = decide(spec_b, observation(spec_b, make_pod, idle), previous_status(spec_b, rollout=RESTARTED), NOW)
    assert plan.status["groups"][0]["phase"] == "Ready"


def test_after_a_restart_a_group_nothing_loads_does_not_say_loading(make_spec, make_pod):
    spec_b = spec_b_of(make_spec)
    idle = {0: (pods(spec_b, make_pod, 0), leader("rev-a"))}
    plan = decide(spec_b, observation(spec_b, make_pod, idle), previous_status(spec_b, rollout=RESTARTED), NOW)
    assert plan.status["groups"][0]["message"] == ""


def test_after_a_restart_an_update_nobody_runs_is_sent_again(make_spec, make_pod):
    spec_b = spec_b_of(make_spec)
    idle = {0: (pods(spec_b, make_pod, 0), leader("rev-a"))}
    plan = decide(spec_b, observation(spec_b, make_pod, idle), previous_status(spec_b, rollout=RESTARTED), NOW)
    assert changes(plan) == [("StartUpdate", 0, "rev-b")]


def test_an_update_sent_again_is_an_event(make_spec, make_pod):
    spec_b = spec_b_of(make_spec)
    idle = {0: (pods(spec_b, make_pod, 0), leader("rev-a"))}
    plan = decide(spec_b, observation(spec_b, make_pod, idle), previous_status(spec_b, rollout=RESTARTED), NOW)
    assert len(events(plan, "UpdateSent")) == 1


def test_a_group_first_seen_loading_emits_its_updating_weights_event(make_spec, make_pod):
    spec_b = spec_b_of(make_spec)
    busy = {0: (pods(spec_b, make_pod, 0, ready=False), leader("rev-a", phase="loading"))}
    plan = decide(spec_b, observation(spec_b, make_pod, busy), previous_status(spec_b, rollout=FIRST_SEEN), NOW)
    assert [e[2] for e in events(plan, "UpdatingWeights")] == ["group 0: UpdatingWeights"]


def test_a_group_first_seen_loading_is_shown_updating(make_spec, make_pod):
    spec_b = spec_b_of(make_spec)
    busy = {0: (pods(spec_b, make_pod, 0, ready=False), leader("rev-a", phase="loading"))}
    plan = decide(spec_b, observation(spec_b, make_pod, busy), previous_status(spec_b, rollout=FIRST_SEEN), NOW)
    assert plan.status["groups"][0]["phase"] == "UpdatingWeights"


def test_a_group_still_loading_emits_no_second_event(make_spec, make_pod):
    spec_b = spec_b_of(make_spec)
    busy = {0: (pods(spec_b, make_pod, 0, ready=False), leader("rev-a", phase="loading"))}
    plan = decide(spec_b, observation(spec_b, make_pod, busy), previous_status(spec_b, rollout=RESTARTED), NOW)
    assert [e for e in events(plan, "UpdatingWeights") if e[2].startswith("group 0")] == []


def test_recapturing_seen_without_samples_emits_its_event(make_spec, make_pod):
    spec_b = spec_b_of(make_spec)
    busy = {0: (pods(spec_b, make_pod, 0, ready=False), leader("rev-b", phase="recapturing"))}
    plan = decide(spec_b, observation(spec_b, make_pod, busy), previous_status(spec_b, rollout=RESTARTED), NOW)
    assert [e[2] for e in events(plan, "RecapturingGraphs")] == ["group 0: RecapturingGraphs"]


def test_an_unreachable_leader_with_this_operator_s_update_pending_stays_updating(make_spec, make_pod):
    spec_b = spec_b_of(make_spec)
    silent = {0: (pods(spec_b, make_pod, 0, ready=False), None)}
    observed = observation(spec_b, make_pod, silent)
    group = observed.groups[0]
    from dataclasses import replace
    from shardline_operator.observed import LeaderObservation
    groups = {**observed.groups, 0: replace(group, answers=LeaderObservation(None, ("pending", "")))}
    plan = decide(spec_b, replace(observed, groups=groups), previous_status(spec_b, rollout=RESTARTED), NOW)
    assert plan.status["groups"][0]["phase"] == "UpdatingWeights"


def test_an_unreachable_leader_after_a_restart_is_not_shown_updating(make_spec, make_pod):
    spec_b = spec_b_of(make_spec)
    silent = {0: (pods(spec_b, make_pod, 0, ready=False), None)}
    plan = decide(spec_b, observation(spec_b, make_pod, silent), previous_status(spec_b, rollout=RESTARTED), NOW)
    assert plan.status["groups"][0]["phase"] != "UpdatingWeights"


def test_an_update_aborted_by_its_leader_going_away_waits_for_the_new_pod(make_spec, make_pod):
    spec_b = spec_b_of(make_spec)
    gone = {0: (pods(spec_b, make_pod, 0, leader_deleting=True), leader("rev-a", update=("aborted", "aborted")))}
    plan = decide(spec_b, observation(spec_b, make_pod, gone), previous_status(spec_b, rollout=WAVE_0), NOW)
    assert (plan.metrics.failed_updates, plan.status["rollout"]["wave"]) == (0, [0])


def test_an_update_whose_request_failed_as_its_leader_went_away_waits_for_the_new_pod(make_spec, make_pod):
    # a leader killed (or crashed) while it drained drops the update request: not the update's failure
    spec_b = spec_b_of(make_spec)
    dropped = ("failure", "request to http://10.0.0.1:8000 failed: RemoteProtocolError: Server disconnected")
    gone = {0: (pods(spec_b, make_pod, 0, leader_deleting=True), leader("rev-a", update=dropped))}
    plan = decide(spec_b, observation(spec_b, make_pod, gone), previous_status(spec_b, rollout=WAVE_0), NOW)
    assert (plan.metrics.failed_updates, plan.status["rollout"]["wave"]) == (0, [0])


def test_an_update_that_failed_on_a_leader_that_stays_fails_the_wave(make_spec, make_pod):
    spec_b = spec_b_of(make_spec)
    failed = {0: (pods(spec_b, make_pod, 0), leader("rev-a", phase="failed", update=("failure", "bad checkpoint")))}
    plan = decide(spec_b, observation(spec_b, make_pod, failed), previous_status(spec_b, rollout=WAVE_0), NOW)
    assert plan.metrics.failed_updates == 1


def test_an_update_that_failed_on_a_leader_still_unready_from_it_fails_the_wave(make_spec, make_pod):
    # /ready answers 503 while the runtime updates: right after a real failure the pod may still
    # be unready, though nothing replaced it; the failure is the update's
    spec_b = spec_b_of(make_spec)
    failed = {0: (pods(spec_b, make_pod, 0, ready=False), leader("rev-a", phase="failed", update=("failure", "bad checkpoint")))}
    plan = decide(spec_b, observation(spec_b, make_pod, failed), previous_status(spec_b, rollout=WAVE_0), NOW)
    assert plan.metrics.failed_updates == 1
