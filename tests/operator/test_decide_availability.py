"""decide() keeps the availability invariant and shows what the runtime does (issue 23 items 1-2),
and tells the truth at ``replicas: 0`` (field case F12). Rows as in test_decide_table.py."""

from __future__ import annotations

import pytest

from shardline_operator.decide import decide
from shardline_operator.observed import GroupObservation
from shardline_operator.pass_plan import Observation
from shardline_operator.render import build_statefulset

from test_decide_table import (NOW, REV_A, REV_B, _model, changes, leader, observation, pods, previous_status,
                               served)

ROLLOUT_B = {"phase": "Updating", "targetModelPath": REV_B, "targetRevision": "rev-b", "previousModelPath": REV_A,
             "previousRevision": "rev-a", "canaryPassed": True, "rolloutStartedAt": "2027-01-15T07:59:00Z"}
WAVE_0 = {**ROLLOUT_B, "wave": [0], "startedAt": "2027-01-15T08:00:00Z", "groupPhases": {"0": "UpdatingWeights"}}


def draining(spec, make_pod):
    """Groups 0 and 1, their StatefulSets gone and their leader pods still terminating."""
    return {i: GroupObservation(i, 2, None, pods(spec, make_pod, i, leader_deleting=True)) for i in range(2)}


def condition(plan, kind):
    return next(c for c in plan.status["conditions"] if c["type"] == kind)


@pytest.fixture
def spec_b(make_spec):
    return make_spec({"model": {**_model(), "path": REV_B, "revision": "rev-b"}})


# --- a wave starts only within maxUnavailable, counting every unavailable group


def test_no_wave_starts_while_another_group_is_unready(spec_b, make_pod):
    unready = {1: (pods(spec_b, make_pod, 1, ready=False), leader())}
    plan = decide(spec_b, observation(spec_b, make_pod, unready), previous_status(spec_b), NOW)
    assert changes(plan) == []


def test_no_wave_starts_while_another_group_s_leader_is_terminating(spec_b, make_pod):
    terminating = {1: (pods(spec_b, make_pod, 1, leader_deleting=True), None)}
    plan = decide(spec_b, observation(spec_b, make_pod, terminating), previous_status(spec_b), NOW)
    assert changes(plan) == [("DeletePods", 1)]  # the group restarts whole; group 0 waits


def test_no_wave_starts_while_another_group_restarts(spec_b, make_pod):
    crashed = {1: (pods(spec_b, make_pod, 1, restarts=1), leader())}
    plan = decide(spec_b, observation(spec_b, make_pod, crashed), previous_status(spec_b), NOW)
    assert changes(plan) == [("DeletePods", 1)]


def test_the_waiting_wave_says_which_group_is_unavailable(spec_b, make_pod):
    unready = {1: (pods(spec_b, make_pod, 1, ready=False), leader())}
    plan = decide(spec_b, observation(spec_b, make_pod, unready), previous_status(spec_b), NOW)
    assert "group 1 unavailable" in plan.status["rollout"]["message"]


def test_a_wave_starts_when_the_budget_has_room(make_spec, make_pod):
    spec = make_spec({"model": {**_model(), "path": REV_B, "revision": "rev-b"},
                      "weightUpdate": {"maxUnavailable": 2}})
    unready = {1: (pods(spec, make_pod, 1, ready=False), leader())}
    plan = decide(spec, observation(spec, make_pod, unready), previous_status(spec), NOW)
    assert changes(plan) == [("StartUpdate", 0, "rev-b")]


# --- a group counts as updated only when its leader is Ready on the target after the update


def test_a_success_reply_from_an_unready_leader_does_not_count(spec_b, make_pod):
    done = {0: (pods(spec_b, make_pod, 0, ready=False), leader("rev-b", update=("success", "")))}
    plan = decide(spec_b, observation(spec_b, make_pod, done), previous_status(spec_b, rollout=WAVE_0), NOW)
    assert changes(plan) == []


def test_a_success_reply_from_a_terminating_leader_does_not_count(spec_b, make_pod):
    done = {0: (pods(spec_b, make_pod, 0, leader_deleting=True), None)}
    plan = decide(spec_b, observation(spec_b, make_pod, done), previous_status(spec_b, rollout=WAVE_0), NOW)
    assert plan.status["rollout"]["wave"] == [0]


def test_a_success_reply_from_a_terminating_leader_emits_no_group_updated(spec_b, make_pod):
    done = {0: (pods(spec_b, make_pod, 0, leader_deleting=True), None)}
    plan = decide(spec_b, observation(spec_b, make_pod, done), previous_status(spec_b, rollout=WAVE_0), NOW)
    assert [e for e in plan.events if e[1] == "GroupUpdated"] == []


def test_rollout_complete_waits_until_every_group_is_available(spec_b, make_pod):
    observed = observation(spec_b, make_pod, {1: (pods(spec_b, make_pod, 1, ready=False, revision="rev-b"), None)},
                           declared="rev-b")
    plan = decide(spec_b, observed, previous_status(spec_b, "rev-b", rollout=ROLLOUT_B), NOW)
    assert [e for e in plan.events if e[1] == "RolloutComplete"] == []


def test_rollout_complete_comes_when_every_group_is_available(spec_b, make_pod):
    plan = decide(spec_b, observation(spec_b, make_pod, declared="rev-b"),
                  previous_status(spec_b, "rev-b", rollout=ROLLOUT_B), NOW)
    assert [e[1] for e in plan.events if e[1] == "RolloutComplete"] == ["RolloutComplete"]


def test_the_rollout_duration_runs_from_the_rollout_start(spec_b, make_pod):
    plan = decide(spec_b, observation(spec_b, make_pod, declared="rev-b"),
                  previous_status(spec_b, "rev-b", rollout=ROLLOUT_B), NOW)
    assert plan.metrics.rollout_seconds == 60.0  # rolloutStartedAt is a minute before NOW


# --- status follows the runtime, not the spec


def test_a_reverted_group_still_loading_shows_loading_the_old_target(make_spec, make_pod):
    spec_a = make_spec()  # reverted to rev-a while group 0 loads rev-b
    loading = {0: (pods(spec_a, make_pod, 0), leader("rev-a", phase="loading", update=("pending", "")))}
    plan = decide(spec_a, observation(spec_a, make_pod, loading), previous_status(spec_a, rollout=WAVE_0), NOW)
    assert plan.status["groups"][0]["message"].startswith("loading rev-b")


def test_a_reverted_group_still_loading_keeps_weights_updated_false(make_spec, make_pod):
    spec_a = make_spec()
    loading = {0: (pods(spec_a, make_pod, 0), leader("rev-a", phase="loading", update=("pending", "")))}
    plan = decide(spec_a, observation(spec_a, make_pod, loading), previous_status(spec_a, rollout=WAVE_0), NOW)
    assert condition(plan, "WeightsUpdated")["status"] == "False"


def test_a_reverted_group_still_loading_is_not_counted_on_the_target(make_spec, make_pod):
    spec_a = make_spec()
    loading = {0: (pods(spec_a, make_pod, 0), leader("rev-a", phase="loading", update=("pending", "")))}
    plan = decide(spec_a, observation(spec_a, make_pod, loading), previous_status(spec_a, rollout=WAVE_0), NOW)
    assert condition(plan, "Progressing")["message"] == "1/2 groups on rev-a"


# --- replicas: 0 (F12)


def test_zero_replicas_is_not_ready(make_spec):
    plan = decide(make_spec({"replicas": 0}), Observation(1), {}, NOW)
    assert condition(plan, "Ready")["status"] == "False"


def test_zero_replicas_says_scaled_to_zero(make_spec):
    plan = decide(make_spec({"replicas": 0}), Observation(1), {}, NOW)
    assert plan.status["phase"] == "ScaledToZero"


@pytest.mark.parametrize("kind", ["WeightsUpdated", "GraphsCaptured"])
def test_zero_replicas_claims_nothing_about_weights_or_graphs(make_spec, kind):
    plan = decide(make_spec({"replicas": 0}), Observation(1), {}, NOW)
    assert condition(plan, kind)["status"] != "True"


def test_zero_replicas_with_pods_draining_lists_the_draining_groups(make_spec, make_pod):
    spec = make_spec({"replicas": 0})
    plan = decide(spec, Observation(1, draining(spec, make_pod)), previous_status(make_spec()), NOW)
    assert [(g["index"], g["phase"]) for g in plan.status["groups"]] == [(0, "Terminating"), (1, "Terminating")]


def test_zero_replicas_with_pods_draining_is_progressing(make_spec, make_pod):
    spec = make_spec({"replicas": 0})
    plan = decide(spec, Observation(1, draining(spec, make_pod)), previous_status(make_spec()), NOW)
    assert condition(plan, "Progressing")["status"] == "True"


def test_zero_replicas_with_pods_draining_is_not_yet_scaled_to_zero(make_spec, make_pod):
    spec = make_spec({"replicas": 0})
    plan = decide(spec, Observation(1, draining(spec, make_pod)), previous_status(make_spec()), NOW)
    assert plan.status["phase"] != "ScaledToZero"


# --- at creation nothing serves yet: no revision, no weights claim (status follows the leaders)


def starting(spec, make_pod):
    """Every group's StatefulSet created, its pods scheduled but not Ready, no leader answering."""
    return observation(spec, make_pod, {i: (pods(spec, make_pod, i, ready=False), None) for i in range(spec.replicas)})


def test_a_deployment_whose_pods_still_start_serves_no_revision(make_spec, make_pod):
    spec = make_spec()
    plan = decide(spec, starting(spec, make_pod), {}, NOW)
    assert plan.status["servedRevision"] == ""


def test_a_group_whose_leader_still_starts_shows_no_revision(make_spec, make_pod):
    spec = make_spec()
    plan = decide(spec, starting(spec, make_pod), {}, NOW)
    assert [g["revision"] for g in plan.status["groups"]] == ["", ""]


def test_a_deployment_whose_pods_still_start_claims_no_weights(make_spec, make_pod):
    spec = make_spec()
    plan = decide(spec, starting(spec, make_pod), {}, NOW)
    assert condition(plan, "WeightsUpdated")["status"] == "False"


def test_a_deployment_whose_pods_still_start_is_not_ready(make_spec, make_pod):
    spec = make_spec()
    plan = decide(spec, starting(spec, make_pod), {}, NOW)
    assert plan.status["phase"] in ("Pending", "Initializing")


def test_the_served_revision_appears_once_a_leader_reports_it(make_spec, make_pod):
    spec = make_spec()
    one_up = {1: (pods(spec, make_pod, 1, ready=False), None)}
    plan = decide(spec, observation(spec, make_pod, one_up), {}, NOW)
    assert plan.status["servedRevision"] == "rev-a"


def test_a_ready_leader_that_did_not_answer_is_judged_by_its_pod(make_spec, make_pod):
    spec = make_spec()
    silent = {i: (pods(spec, make_pod, i), None) for i in range(spec.replicas)}
    plan = decide(spec, observation(spec, make_pod, silent), previous_status(spec), NOW)
    assert plan.status["servedRevision"] == "rev-a"
