"""rollout.plan_rollout played as data: whole rollouts through the pure planner (issue 9).

A :class:`Fleet` holds what each group's StatefulSet declares, what its leader serves (model
and digest) and the updates in flight; each ``step`` gathers views, plans, and applies the
plan's effects the way the executor would. The test decides when an update ends and how.
"""

from __future__ import annotations

import pytest

from shardline_operator.rollout import GroupView, plan_rollout, update_body
from shardline_operator.weights import LeaderReport
from shardline_operator.rollout_state import FAILED, PAUSED, ROLLING_BACK, UPDATING, VERIFYING, RolloutState
from shardline_operator.runtime_args import ServedModel
from shardline_operator.spec import CanarySpec, CudaGraphSpec, VerifySpec, WeightUpdateSpec

GRAPHS = CudaGraphSpec(True, 160)
REV_A = ServedModel("/models/m/rev-a", "rev-a", GRAPHS)
REV_B = ServedModel("/models/m/rev-b", "rev-b", GRAPHS)
REV_C = ServedModel("/models/m/rev-c", "rev-c", GRAPHS)
POLICY = WeightUpdateSpec(timeout_seconds=60)


def digest(model: ServedModel) -> str:
    return f"sha256:{model.revision}"


class Fleet:
    def __init__(self, n: int, served: ServedModel = REV_A):
        self.declared = {i: served for i in range(n)}
        self.leader = {i: served for i in range(n)}
        self.digest = {i: digest(served) for i in range(n)}
        self.recorded: dict[int, str | None] = dict(self.digest)
        self.inflight: dict[int, list] = {}  # group -> [target, "pending" | "success" | "failure", message]
        self.ready = {i: True for i in range(n)}
        self.gate = (True, "/health_generate answered 200")
        self.state: RolloutState | None = None
        self.sent: list[tuple[int, str]] = []
        self.events: list[str] = []
        self.own_requests = True  # False after an operator restart: poll knows nothing

    def views(self) -> list[GroupView]:
        out = []
        for i in sorted(self.declared):
            flight = self.inflight.get(i)
            update = ("unknown", "")
            if flight is not None and self.own_requests:
                update = (flight[1], flight[2])
            phase = "loading" if flight is not None and flight[1] == "pending" else "serving"
            leader = LeaderReport(phase, self.leader[i].path, self.leader[i].revision, self.digest[i])
            gate = self.gate if self.state is not None and self.state.phase == VERIFYING and self.state.canary == i else None
            out.append(GroupView(i, self.declared[i], self.ready[i], True, leader, self.recorded[i], update, (), gate))
        return out

    def step(self, desired: ServedModel, now: float, policy: WeightUpdateSpec = POLICY):
        plan = plan_rollout(self.state, desired, self.views(), policy, now)
        for i, flight in list(self.inflight.items()):
            if flight[1] != "pending" and self.own_requests:
                del self.inflight[i]  # a finished request is reported once
        for i, body in plan.start.items():
            target = ServedModel(body["model_path"], body["revision"], GRAPHS)
            self.sent.append((i, body["revision"]))
            self.inflight[i] = [target, "pending", ""]
        for i, model in plan.apply.items():
            self.declared[i] = model
        for i in plan.forget_digest:
            self.recorded[i] = None
        for i in self.recorded:
            if self.recorded[i] is None and i not in self.inflight:
                self.recorded[i] = self.digest[i]
        self.events += [reason for _, reason, _ in plan.events]
        self.state = plan.state
        return plan

    def finish(self, i: int, ok: bool = True, message: str = "") -> None:
        flight = self.inflight[i]
        flight[1], flight[2] = ("success" if ok else "failure"), message
        if ok:
            self.leader[i] = flight[0]
            self.digest[i] = digest(flight[0])


def test_waves_of_max_unavailable_groups_step_as_soon_as_a_wave_ends():
    fleet, policy = Fleet(4), WeightUpdateSpec(timeout_seconds=60, max_unavailable=2)
    plan = fleet.step(REV_B, 0.0, policy)
    assert sorted(plan.start) == [0, 1] and plan.requeue_after_seconds == 0.5
    assert fleet.state.wave == (0, 1) and plan.group_phases == {0: "UpdatingWeights", 1: "UpdatingWeights"}
    fleet.finish(0)
    plan = fleet.step(REV_B, 1.0, policy)
    # A group that ended is recorded at once; the next wave starts when the whole wave ended.
    assert plan.apply == {0: REV_B} and fleet.state.wave == (1,) and not plan.start
    fleet.finish(1)
    plan = fleet.step(REV_B, 2.0, policy)
    assert plan.apply == {1: REV_B}
    assert plan.group_update_seconds == [(1, 2.0)]
    assert sorted(plan.start) == [2, 3]  # the next wave, in the pass that ended the last one
    fleet.finish(2), fleet.finish(3)
    plan = fleet.step(REV_B, 3.0, policy)  # the pass that counts the last wave completes
    assert fleet.state is None and plan.rollout_seconds == 3.0 and fleet.events[-1] == "RolloutComplete"
    assert fleet.sent == [(0, "rev-b"), (1, "rev-b"), (2, "rev-b"), (3, "rev-b")]


def test_canary_gate_failure_rolls_back_in_place_with_the_reason():
    fleet = Fleet(3)
    policy = WeightUpdateSpec(timeout_seconds=60, max_unavailable=2,
                              canary=CanarySpec(VerifySpec("hello", 4, 0.5)))
    assert list(fleet.step(REV_B, 0.0, policy).start) == [0]  # the canary goes alone
    fleet.finish(0)
    fleet.step(REV_B, 1.0, policy)
    assert fleet.state.phase == VERIFYING and fleet.state.canary == 0
    fleet.gate = (False, "verify prompt took 0.912s, over maxLatencySeconds 0.5")
    plan = fleet.step(REV_B, 2.0, policy)
    assert fleet.state.phase == ROLLING_BACK and plan.rolled_back and "maxLatencySeconds" in fleet.state.message
    plan = fleet.step(REV_B, 2.0, policy)
    assert plan.start == {0: update_body(REV_B, REV_A)}
    fleet.finish(0)
    fleet.step(REV_B, 3.0, policy)
    fleet.step(REV_B, 3.0, policy)
    assert fleet.state.phase == FAILED and "canary group 0 failed verification" in fleet.state.message
    assert fleet.events[-1] == "RolledBack" and set(fleet.leader.values()) == {REV_A}
    assert set(fleet.declared.values()) == {REV_A}  # StatefulSets name what the leaders serve
    sent = len(fleet.sent)
    fleet.step(REV_B, 4.0, policy)
    assert len(fleet.sent) == sent and fleet.state.phase == FAILED  # held until the spec changes
    assert list(fleet.step(REV_C, 5.0, policy).start) == [0]  # a new target: a new rollout, canary first


def test_a_failed_target_reached_by_restarts_clears_the_failure():
    fleet = Fleet(2, REV_B)
    fleet.state = RolloutState(FAILED, REV_B, REV_A, message="canary failed")
    plan = fleet.step(REV_B, 0.0)
    assert plan.state is None and not plan.start


def test_canary_pass_lets_the_rest_follow_in_waves():
    fleet = Fleet(3)
    policy = WeightUpdateSpec(timeout_seconds=60, max_unavailable=2, canary=CanarySpec())
    fleet.step(REV_B, 0.0, policy)
    fleet.finish(0)
    fleet.step(REV_B, 1.0, policy)
    plan = fleet.step(REV_B, 2.0, policy)
    assert fleet.state.canary_passed and sorted(plan.start) == [1, 2] and "CanaryPassed" in fleet.events


def test_pause_between_waves():
    fleet, policy = Fleet(2), WeightUpdateSpec(timeout_seconds=60, pause_seconds=10)
    fleet.step(REV_B, 0.0, policy)
    fleet.finish(0)
    fleet.step(REV_B, 1.0, policy)
    assert fleet.state.phase == PAUSED and fleet.state.pause_until == 11.0
    plan = fleet.step(REV_B, 5.0, policy)
    assert not plan.start and plan.requeue_after_seconds == 6.0
    assert list(fleet.step(REV_B, 11.0, policy).start) == [1]


def test_revert_mid_update_awaits_it_then_sends_the_group_back():
    """The issue's revert case: rev-a -> rev-b, reverted to rev-a while the update runs; the
    cancel came too late (the update committed), so the group is sent back at once."""
    fleet = Fleet(1)
    fleet.step(REV_B, 0.0)
    plan = fleet.step(REV_A, 1.0)  # reverted while loading: the load is cancelled and awaited
    assert not plan.start and fleet.state.wave == (0,) and fleet.state.target == REV_B
    assert plan.abort == [0]
    assert "RolloutComplete" not in fleet.events
    fleet.finish(0)
    plan = fleet.step(REV_A, 2.0)
    assert plan.apply == {0: REV_B}  # status records the truth: the group now serves rev-b
    assert plan.start == {0: update_body(REV_B, REV_A)}  # and it goes back in the same pass
    assert fleet.state.target == REV_A
    fleet.finish(0)
    fleet.step(REV_A, 3.0)
    fleet.step(REV_A, 3.0)
    assert fleet.state is None and fleet.leader[0] == REV_A and fleet.events[-1] == "RolloutComplete"


def test_operator_restart_resumes_from_status_and_the_leaders():
    fleet = Fleet(2)
    fleet.step(REV_B, 0.0)
    fleet.state = RolloutState.from_status(fleet.state.to_status())  # what a new process reads
    fleet.own_requests = False
    plan = fleet.step(REV_B, 1.0)
    assert not plan.start and plan.group_phases == {0: "UpdatingWeights"}  # the leader says loading
    fleet.finish(0)
    plan = fleet.step(REV_B, 2.0)
    assert plan.apply == {0: REV_B}  # the leader serves rev-b: success
    assert list(plan.start) == [1]
    fleet.inflight.clear()  # the request was lost with the old process
    fleet.state = RolloutState.from_status(fleet.state.to_status())
    assert list(fleet.step(REV_B, 3.0).start) == [1]  # nobody updates it: sent again


def test_mixed_version_is_reported_and_repaired():
    fleet = Fleet(2, REV_B)
    fleet.digest[1] = "sha256:other-files"  # the leader's checkpoint changed under it
    plan = fleet.step(REV_B, 0.0)
    assert "digest sha256:other-files" in plan.mixed[1] and list(plan.start) == [1]
    fleet.finish(1)
    fleet.digest[1] = "sha256:rev-b"
    plan = fleet.step(REV_B, 1.0)
    assert plan.apply == {1: REV_B} and plan.forget_digest == [1]
    plan = fleet.step(REV_B, 1.0)
    assert not plan.mixed and fleet.state is None


def test_leader_serving_another_model_than_declared_is_mixed_and_repaired():
    fleet = Fleet(2)
    fleet.leader[0], fleet.digest[0] = REV_C, digest(REV_C)  # someone POSTed an update by hand
    plan = fleet.step(REV_A, 0.0)
    assert "leader serves rev-c" in plan.mixed[0] and plan.start == {0: update_body(REV_C, REV_A)}


def test_failure_rolls_back_updated_groups_then_holds():
    fleet = Fleet(2)
    fleet.step(REV_B, 0.0)
    fleet.finish(0)
    fleet.step(REV_B, 1.0)
    fleet.step(REV_B, 1.0)
    fleet.finish(1, ok=False, message="shape mismatch: embed_tokens.weight [64, 32] vs [64, 48]")
    plan = fleet.step(REV_B, 2.0)
    assert fleet.state.phase == ROLLING_BACK and plan.failed_updates == 1 and plan.rolled_back
    assert list(fleet.step(REV_B, 2.0).start) == [0]
    fleet.finish(0)
    fleet.step(REV_B, 3.0), fleet.step(REV_B, 3.0)
    assert fleet.state.phase == FAILED and "shape mismatch" in fleet.state.message
    assert fleet.declared == fleet.leader == {0: REV_A, 1: REV_A}


def test_a_new_spec_during_rollback_wins():
    fleet = Fleet(2)
    fleet.step(REV_B, 0.0)
    fleet.finish(0)
    fleet.step(REV_B, 1.0), fleet.step(REV_B, 1.0)
    fleet.finish(1, ok=False, message="bad")
    fleet.step(REV_B, 2.0)
    assert fleet.state.phase == ROLLING_BACK
    plan = fleet.step(REV_C, 3.0)  # the user fixed the spec: roll forward to rev-c instead
    assert fleet.state.phase == UPDATING and fleet.state.target == REV_C and list(plan.start) == [0]


def test_failure_without_rollback_and_timeout():
    fleet, policy = Fleet(2), WeightUpdateSpec(timeout_seconds=60, rollback_on_failure=False)
    fleet.step(REV_B, 0.0, policy)
    plan = fleet.step(REV_B, 61.0, policy)
    assert fleet.state.phase == FAILED and "timed out after 60s" in fleet.state.message and not plan.apply


def test_waits_for_ready_group_and_adopts_one_without_pods():
    views = [GroupView(0, REV_A, ready=False, live=True)]
    plan = plan_rollout(None, REV_B, views, POLICY, 0.0)
    assert not plan.start and "waiting for group 0" in plan.state.message
    plan = plan_rollout(None, REV_B, [GroupView(0, REV_A, ready=False, live=False)], POLICY, 0.0)
    assert plan.apply == {0: REV_B} and not plan.start


def test_short_phases_come_back_as_a_trail():
    state = RolloutState(UPDATING, REV_B, REV_A, wave=(0,), started_at=0.0, group_phases={0: "UpdatingWeights"})
    view = GroupView(0, REV_A, update=("success", ""), phases=("loading", "recapturing", "serving"))
    plan = plan_rollout(state, REV_B, [view], POLICY, 1.0)
    assert plan.trail == [(0, "RecapturingGraphs")] and plan.apply == {0: REV_B}


def test_a_recapture_too_short_to_sample_is_a_trail_step_from_the_reported_seconds():
    state = RolloutState(UPDATING, REV_B, REV_A, wave=(0,), started_at=0.0)
    view = GroupView(0, REV_A, update=("success", ""), update_seconds={"recapture_seconds": 0.3})
    assert plan_rollout(state, REV_B, [view], POLICY, 1.0).trail == [(0, "RecapturingGraphs")]


def test_a_runtime_that_captured_no_graphs_has_no_recapturing_step_whatever_the_spec_says():
    """The spec asks for graphs (REV_B's cudaGraph is enabled); a CPU pod reports 0 s of recapture."""
    assert REV_B.cuda_graph.enabled
    state = RolloutState(UPDATING, REV_B, REV_A, wave=(0,), started_at=0.0)
    view = GroupView(0, REV_A, update=("success", ""), update_seconds={"load_seconds": 0.2, "recapture_seconds": 0.0})
    assert plan_rollout(state, REV_B, [view], POLICY, 1.0).trail == []


def test_graph_change_body():
    target = ServedModel(REV_A.path, REV_A.revision, CudaGraphSpec(True, 8))
    assert update_body(REV_A, target) == {"model_path": REV_A.path, "revision": "rev-a", "recapture_cuda_graph": True,
                                         "cuda_graph_max_bs": 8, "disable_cuda_graph": False}


@pytest.mark.parametrize("state", [
    RolloutState(ROLLING_BACK, REV_B, previous=REV_A, wave=(1, 2), started_at=1_700_000_000.0,
                 group_phases={1: "UpdatingWeights", 2: "RecapturingGraphs"}, message="m"),
    RolloutState(VERIFYING, REV_B, previous=REV_A, canary=0, rollout_started_at=1_700_000_000.0),
    RolloutState(PAUSED, REV_B, previous=REV_A, canary_passed=True, pause_until=1_700_000_010.0),
])
def test_state_round_trips_through_status(state):
    assert RolloutState.from_status(state.to_status()) == state


def test_state_written_before_waves_is_read():
    raw = {"phase": "Updating", "targetModelPath": REV_B.path, "targetRevision": "rev-b", "group": 1,
           "startedAt": "2023-11-14T22:13:20Z", "groupPhase": "RecapturingGraphs"}
    state = RolloutState.from_status(raw)
    assert state.wave == (1,) and state.group_phases == {1: "RecapturingGraphs"}


def test_reported_recapture_seconds_are_kept_per_group():
    """The runtime's ``recapture_seconds`` (from the update's reply) feeds the recapture metric."""
    state = RolloutState(UPDATING, REV_B, REV_A, wave=(0, 1), started_at=0.0, rollout_started_at=0.0)
    leader = LeaderReport("serving", REV_B.path, REV_B.revision, digest(REV_B))
    views = [GroupView(0, REV_A, leader=leader, update=("success", ""),
                       update_seconds={"load_seconds": 2.0, "recapture_seconds": 0.75}),
             GroupView(1, REV_A, leader=leader, update=("success", ""))]  # an older runtime: none reported
    plan = plan_rollout(state, REV_B, views, POLICY, 3.0)
    assert plan.group_update_seconds == [(0, 3.0), (1, 3.0)] and plan.group_recapture_seconds == [(0, 0.75)]


def test_failed_rollout_repairs_a_late_update_back_to_the_last_good_weights():
    """The operator gave up on group 0 (timeout, so Failed with nothing to roll back); the runtime
    then finished loading rev-b anyway: a mixed version while Failed, sent back to rev-a (what its
    StatefulSet declares), and the rollout stays Failed (the failed target is not retried)."""
    fleet = Fleet(2)
    fleet.step(REV_B, 0.0)
    fleet.step(REV_B, 61.0)
    assert fleet.state.phase == FAILED and "timed out" in fleet.state.message
    fleet.finish(0)  # the late load lands
    plan = fleet.step(REV_B, 62.0)
    assert "leader serves rev-b" in plan.mixed[0] and plan.start == {0: update_body(REV_B, REV_A)}
    assert fleet.state.phase == FAILED and fleet.state.wave == (0,) and "RepairingMixedVersion" in fleet.events
    assert "timed out" in fleet.state.message  # the reason the rollout failed is kept
    fleet.finish(0)
    plan = fleet.step(REV_B, 63.0)
    assert plan.apply == {0: REV_A} and fleet.state.phase == FAILED and fleet.state.wave == ()
    plan = fleet.step(REV_B, 64.0)
    assert not plan.mixed and not plan.start and fleet.leader == fleet.declared == {0: REV_A, 1: REV_A}


def test_a_repair_that_fails_keeps_failed_and_is_tried_again_later():
    fleet = Fleet(2)
    fleet.step(REV_B, 0.0), fleet.step(REV_B, 61.0)
    fleet.finish(0)
    fleet.step(REV_B, 62.0)
    fleet.finish(0, ok=False, message="disk gone")
    plan = fleet.step(REV_B, 63.0)
    assert fleet.state.phase == FAILED and not fleet.state.wave and plan.requeue_after_seconds is None
    assert "MixedVersionRepairFailed" in fleet.events and not plan.rolled_back
    assert list(fleet.step(REV_B, 93.0).start) == [0]  # still mixed at the next pass: tried again


def test_a_fleet_split_by_a_failure_without_rollback_is_held():
    """rollbackOnFailure false: group 0 on rev-b, group 1 failed on rev-a. Failed holds: no update
    is sent, and that split is not a mixed version (each leader serves what it declares)."""
    fleet, policy = Fleet(2), WeightUpdateSpec(timeout_seconds=60, rollback_on_failure=False)
    fleet.step(REV_B, 0.0, policy)
    fleet.finish(0)
    fleet.step(REV_B, 1.0, policy), fleet.step(REV_B, 1.0, policy)
    fleet.finish(1, ok=False, message="shape mismatch")
    fleet.step(REV_B, 2.0, policy)
    assert fleet.state.phase == FAILED and fleet.declared == {0: REV_B, 1: REV_A}
    for now in (3.0, 40.0):
        plan = fleet.step(REV_B, now, policy)
        assert not plan.start and not plan.mixed and fleet.state.phase == FAILED
