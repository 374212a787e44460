"""Issue 23: a group whose update ended is not available until it is back in routing.

A group leaves routing before its update and returns once its ``/health_generate`` passes
(``routing.py``). The next wave is planned only from groups that are available, back in routing
included: with ``maxUnavailable: 1``, the next group never leaves routing while the group just
updated is still out (its return check pending or failed), so at most one group is ever out.
Whole passes run through ``reconcile()`` (``reconcile_world``); the planner cases run
``rollout.plan_rollout`` on views.
"""

from __future__ import annotations

import pytest
from reconcile_world import REV_B, LiveLeaders, ready_world

from shardline_operator import labels
from shardline_operator.rollout import GroupView, plan_rollout
from shardline_operator.rollout_state import UPDATING, RolloutState
from shardline_operator.runtime_args import ServedModel
from shardline_operator.spec import CudaGraphSpec, WeightUpdateSpec
from shardline_operator.weights import LeaderReport

URL = {0: "http://127.0.0.2:8000", 1: "http://127.0.1.2:8000", 2: "http://127.0.2.2:8000"}


class CheckedLeaders(LiveLeaders):
    """:class:`LiveLeaders` whose return check (``verify(url, None)``) passes per URL as the test
    sets it, and which records, at each update it is sent, the groups out of routing."""

    def __init__(self, kube_of):
        super().__init__()
        self.health = {}  # url -> passes (default True)
        self.out_at_start: dict[str, list[int]] = {}  # update key -> groups out of routing then
        self._kube_of = kube_of

    def verify(self, url, verify):
        return (True, "ok") if self.health.get(url, True) else (False, "HTTP 503")

    def start_update(self, key, url, body, timeout_seconds):
        self.out_at_start[key] = out_of_routing(self._kube_of())
        super().start_update(key, url, body, timeout_seconds)


def out_of_routing(kube) -> list[int]:
    """Groups whose leader pod is not labelled routable (every routing path drops it)."""
    return sorted(
        int(name.split("-g")[1].split("-")[0])
        for name, pod in kube.pods().items()
        if name.endswith("-0") and pod["metadata"]["labels"].get(labels.LABEL_ROUTABLE) != "true"
    )


@pytest.fixture
def world(spec_dict):
    holder = {}
    leaders = CheckedLeaders(lambda: holder["passes"].kube)
    holder["passes"] = passes = ready_world(spec_dict, leaders)

    def start_rollout():
        passes.run(model=dict(spec_dict["model"], path=REV_B, revision="rev-b"))

    return passes, leaders, start_rollout


def sent_to(leaders, group: int) -> bool:
    return any(key == f"default/llama/g{group}" for key, _ in leaders.sent)


def test_next_group_stays_in_routing_while_the_updated_groups_return_check_fails(world):
    passes, leaders, start_rollout = world
    start_rollout()
    assert out_of_routing(passes.kube) == [0], "group 0 leaves routing for its update"
    leaders.health[URL[0]] = False  # group 0's update succeeds, its return check fails
    leaders.finish("default/llama/g0")
    for _ in range(4):  # the pass that counts group 0 updated, and the passes after it
        passes.run()
        assert not sent_to(leaders, 1), "group 1 was sent its update while group 0 was out"
        assert out_of_routing(passes.kube) == [0], "more than maxUnavailable groups out of routing"
    message = passes.body["status"]["rollout"]["message"]
    assert message == "waiting: group 0 returning to routing (maxUnavailable 1)"


def test_rollout_goes_on_once_the_updated_groups_return_check_passes(world):
    passes, leaders, start_rollout = world
    start_rollout()
    leaders.health[URL[0]] = False
    leaders.finish("default/llama/g0")
    passes.run()
    passes.run()
    leaders.health[URL[0]] = True
    passes.run()  # group 0 passes its check and returns
    assert out_of_routing(passes.kube) == []
    passes.run()
    assert sent_to(leaders, 1), "group 1 was not sent its update once group 0 was back"
    assert leaders.out_at_start["default/llama/g1"] == [1], "group 1's update began with another group out"


def test_next_group_starts_after_a_passed_return_check_with_one_group_out_at_a_time(world):
    passes, leaders, start_rollout = world
    start_rollout()
    leaders.finish("default/llama/g0")
    passes.run()  # counts group 0 updated; it returns after its check
    passes.run()
    assert sent_to(leaders, 1), "group 1 was not sent its update after group 0 returned"
    assert leaders.out_at_start["default/llama/g1"] == [1], "group 1's update began with group 0 out"
    leaders.finish("default/llama/g1")
    passes.run()
    result = passes.run()
    assert result.status["phase"] == "Ready"
    assert out_of_routing(passes.kube) == []


GRAPHS = CudaGraphSpec(True, 160)
REV_A_MODEL = ServedModel("/models/m/rev-a", "rev-a", GRAPHS)
REV_B_MODEL = ServedModel("/models/m/rev-b", "rev-b", GRAPHS)


def view(index: int, served: ServedModel, routable: bool = True, update=("unknown", "")) -> GroupView:
    leader = LeaderReport("serving", served.path, served.revision, f"sha256:{served.revision}")
    return GroupView(index, served, leader=leader, recorded_digest=f"sha256:{served.revision}",
                     update=update, routable=routable)


def test_planner_counts_a_group_out_of_routing_unavailable():
    assert not view(0, REV_B_MODEL, routable=False).available


@pytest.mark.parametrize("routable, started", [(False, []), (True, [1])])
def test_planner_starts_the_next_wave_only_once_the_updated_group_is_back(routable, started):
    state = RolloutState(UPDATING, REV_B_MODEL, REV_A_MODEL, canary_passed=True)
    groups = [view(0, REV_B_MODEL, routable=routable), view(1, REV_A_MODEL)]
    plan = plan_rollout(state, REV_B_MODEL, groups, WeightUpdateSpec(timeout_seconds=60), 0.0)
    assert sorted(plan.start) == started


def test_planner_ends_a_wave_without_starting_the_next_while_its_group_is_out_of_routing():
    """The pass that counts group 0 updated (it is still out: its return comes after this pass's
    status) starts nothing else, and asks for the next pass at once."""
    state = RolloutState(UPDATING, REV_B_MODEL, REV_A_MODEL, wave=(0,), started_at=0.0,
                         canary_passed=True)
    groups = [view(0, REV_B_MODEL, routable=False, update=("success", "")), view(1, REV_A_MODEL)]
    plan = plan_rollout(state, REV_B_MODEL, groups, WeightUpdateSpec(timeout_seconds=60), 1.0)
    assert list(plan.apply) == [0], "group 0 counted updated"
    assert plan.start == {}, "group 1 started while group 0 was out of routing"
    assert plan.requeue_after_seconds == 0.0


def test_planner_with_two_unavailable_allowed_starts_one_group_beside_one_returning():
    state = RolloutState(UPDATING, REV_B_MODEL, REV_A_MODEL, canary_passed=True)
    groups = [view(0, REV_B_MODEL, routable=False), view(1, REV_A_MODEL), view(2, REV_A_MODEL)]
    policy = WeightUpdateSpec(timeout_seconds=60, max_unavailable=2)
    plan = plan_rollout(state, REV_B_MODEL, groups, policy, 0.0)
    assert sorted(plan.start) == [1]


def test_rollout_is_not_complete_while_the_last_group_is_out_of_routing(world):
    """``RolloutComplete`` and ``Ready`` wait for the last wave's group to be back in routing:
    while its return check fails the deployment is still rolling out, and says why."""
    passes, leaders, start_rollout = world
    start_rollout()
    leaders.finish("default/llama/g0")
    passes.run()
    passes.run()
    leaders.health[URL[1]] = False  # group 1's update succeeds, its return check fails
    leaders.finish("default/llama/g1")
    for _ in range(3):
        result = passes.run()
        assert out_of_routing(passes.kube) == [1]
        assert result.status["phase"] != "Ready", "Ready while group 1 was out of routing"
        assert "RolloutComplete" not in [e[1] for e in result.events]
    rollout = result.status["rollout"]
    assert rollout["message"] == "waiting for group 1 to return to routing on rev-b"
    leaders.health[URL[1]] = True
    events = [e[1] for e in passes.run().events]  # group 1 returns
    result = passes.run()
    events += [e[1] for e in result.events]
    assert result.status["phase"] == "Ready"
    assert out_of_routing(passes.kube) == []
    assert events.count("RolloutComplete") == 1


def test_a_restart_takes_the_group_already_out_of_routing_first_and_never_a_second_group(world):
    """A restart counts against ``maxUnavailable`` too. Group 1 is updated but out of routing (its
    return check failing) when a new runtime image comes: group 1, already out, restarts first
    (its new pods are routable once Ready); group 0 leaves service only after that, never beside
    it."""
    passes, leaders, start_rollout = world
    start_rollout()
    leaders.finish("default/llama/g0")
    passes.run()  # counts group 0 updated; it returns after its check
    passes.run()  # group 1 leaves routing and is sent its update
    assert sent_to(leaders, 1)
    leaders.health[URL[1]] = False  # group 1's update succeeds, its return check fails
    leaders.finish("default/llama/g1")
    passes.run()
    assert out_of_routing(passes.kube) == [1]
    runtime = dict(passes.body["spec"]["runtime"], image="ghcr.io/shardline/shardline-runtime:0.2.0")
    result = passes.run(runtime=runtime)
    restarts = [e[2].split(":")[0] for e in result.events if e[1] == "GroupRestart"]
    assert restarts == ["group 1"], "the restart did not take the group already out first"
    assert "llama-g0-0" in passes.kube.pods(), "group 0 left service beside group 1"
    passes.kube.run_statefulsets()  # group 1's new pods come up Ready (routable from the start)
    for _ in range(3):
        result = passes.run()
        restarts += [e[2].split(":")[0] for e in result.events if e[1] == "GroupRestart"]
        if len(restarts) > 1:
            break
    assert restarts == ["group 1", "group 0"]


def test_next_restart_waits_for_a_group_that_is_ready_but_out_of_routing(make_spec):
    """``next_restart`` alone: the stale group does not go while another is Ready but not back in
    routing, and goes once it is."""
    from shardline_operator.observed import GroupObservation, PodObservation
    from shardline_operator.restart_plan import next_restart

    spec = make_spec()

    def group(index: int, routable: str, template: str) -> GroupObservation:
        pods = tuple(
            PodObservation(f"llama-g{index}-{rank}", f"uid-{index}-{rank}", rank, f"10.0.{index}.{rank}",
                           "Running", True, False, 0, False, None, template,
                           routable=routable if rank == 0 else None)
            for rank in range(spec.parallelism.pods_per_group)
        )
        sts = {"metadata": {"annotations": {labels.ANNOTATION_RESTART_HASH: template}}}
        return GroupObservation(index, spec.parallelism.pods_per_group, sts, pods)

    fresh = spec.restart_hash()
    for routable, expected in (("false", None), ("true", 1)):
        groups = [group(0, routable, fresh), group(1, "true", "old-template")]
        chosen = next_restart(spec, groups, {}, wave_in_flight=False)
        assert (chosen.index if chosen else None) == expected
