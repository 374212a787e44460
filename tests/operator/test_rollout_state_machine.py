"""rollout.py: one group at a time, phase mirroring, timeout, rollback, resume after restart."""

from __future__ import annotations

from shardline_operator import labels
from shardline_operator.observed import GroupObservation, PodObservation
from shardline_operator.rollout import FAILED, ROLLING_BACK, UPDATING, RolloutState, advance, update_body
from shardline_operator.runtime_args import ServedModel
from shardline_operator.spec import CudaGraphSpec, WeightUpdateSpec

GRAPHS = CudaGraphSpec(True, 160)
REV_A = ServedModel("/models/m/rev-a", "rev-a", GRAPHS)
REV_B = ServedModel("/models/m/rev-b", "rev-b", GRAPHS)
POLICY = WeightUpdateSpec(strategy="InPlace", timeout_seconds=60, rollback_on_failure=True)


class FakeLeaders:
    """Records requests; results and server info are set by the test."""

    def __init__(self):
        self.sent: list[tuple[str, str, dict]] = []
        self.results: dict[str, tuple[str, str]] = {}
        self.info: dict[str, dict] = {}
        self.phases: dict[str, list[str]] = {}

    def start_update(self, key, url, body, timeout_seconds):
        self.sent.append((key, url, dict(body)))
        self.results[key] = ("pending", "")

    def poll(self, key):
        return self.results.get(key, ("unknown", ""))

    def server_info(self, url):
        return self.info.get(url)

    def observed_phases(self, key):
        return self.phases.pop(key, [])


def group(index, served, make_pod, ready=True, pods=2):
    sts = {"metadata": {"annotations": {labels.ANNOTATION_MODEL_PATH: served.path,
                                        labels.ANNOTATION_MODEL_REVISION: served.revision,
                                        labels.ANNOTATION_CUDA_GRAPH: served.cuda_graph.key()}}}
    members = tuple(PodObservation.from_api(make_pod(index, r, ready=ready)) for r in range(pods))
    return GroupObservation(index, 2, sts, members)


def pending(groups, target):
    return [g.index for g in groups if g.served != target]


def step(state, groups, leaders, now, target=REV_B, policy=POLICY):
    return advance(state, target, groups, pending(groups, target), policy, leaders, "ns/llama", now)


def test_full_rollout_one_group_at_a_time(make_pod):
    leaders = FakeLeaders()
    groups = [group(0, REV_A, make_pod), group(1, REV_A, make_pod)]
    out = step(None, groups, leaders, now=0.0)
    assert out.state.phase == UPDATING and out.state.group == 0
    assert out.group_phases == {0: "UpdatingWeights"}
    assert leaders.sent == [("ns/llama/g0", "http://127.0.0.1:8000",
                             {"model_path": "/models/m/rev-b", "revision": "rev-b", "recapture_cuda_graph": True})]
    leaders.info["http://127.0.0.1:8000"] = {"weights_phase": "recapturing"}
    out = step(out.state, groups, leaders, now=1.0)
    assert out.group_phases == {0: "RecapturingGraphs"} and not out.apply
    leaders.results["ns/llama/g0"] = ("success", "")
    out = step(out.state, groups, leaders, now=2.0)
    assert out.apply == {0: REV_B} and out.state.group is None and out.trail == []
    groups[0] = group(0, REV_B, make_pod)
    out = step(out.state, groups, leaders, now=3.0)
    assert out.state.group == 1 and leaders.sent[-1][0] == "ns/llama/g1"
    leaders.results["ns/llama/g1"] = ("success", "")
    out = step(out.state, groups, leaders, now=4.0)
    assert out.apply == {1: REV_B}
    groups[1] = group(1, REV_B, make_pod)
    out = step(out.state, groups, leaders, now=5.0)
    assert out.state is None and out.events[0][1] == "RolloutComplete"


def test_failure_rolls_back_updated_groups_then_holds(make_pod):
    leaders = FakeLeaders()
    groups = [group(0, REV_B, make_pod), group(1, REV_A, make_pod)]
    state = RolloutState(UPDATING, REV_B, group=1, started_at=0.0)
    leaders.results["ns/llama/g1"] = ("failure", "shape mismatch: model.embed_tokens.weight [64, 32] vs [64, 48]")
    out = step(state, groups, leaders, now=1.0)
    assert out.state.phase == ROLLING_BACK and out.state.previous == REV_A
    assert "shape mismatch" in out.state.message and out.events[0][0] == "Warning"
    out = step(out.state, groups, leaders, now=2.0)
    assert leaders.sent[-1][0] == "ns/llama/g0" and leaders.sent[-1][2]["revision"] == "rev-a"
    leaders.results["ns/llama/g0"] = ("success", "")
    out = step(out.state, groups, leaders, now=3.0)
    assert out.apply == {0: REV_A}
    groups[0] = group(0, REV_A, make_pod)
    out = step(out.state, groups, leaders, now=4.0)
    assert out.state.phase == FAILED and "shape mismatch" in out.state.message
    sent = len(leaders.sent)
    held = step(out.state, groups, leaders, now=5.0)
    assert held.state.phase == FAILED and len(leaders.sent) == sent and not held.apply
    # A new target starts a new rollout.
    rev_c = ServedModel("/models/m/rev-c", "rev-c", GRAPHS)
    fresh = step(held.state, groups, leaders, now=6.0, target=rev_c)
    assert fresh.state.phase == UPDATING and leaders.sent[-1][2]["revision"] == "rev-c"


def test_failure_without_rollback_keeps_updated_groups(make_pod):
    leaders = FakeLeaders()
    groups = [group(0, REV_B, make_pod), group(1, REV_A, make_pod)]
    policy = WeightUpdateSpec(rollback_on_failure=False, timeout_seconds=60)
    leaders.results["ns/llama/g1"] = ("failure", "bad")
    out = step(RolloutState(UPDATING, REV_B, group=1, started_at=0.0), groups, leaders, 1.0, policy=policy)
    assert out.state.phase == FAILED and not out.apply


def test_timeout_is_a_failure(make_pod):
    leaders = FakeLeaders()
    leaders.results["ns/llama/g0"] = ("pending", "")
    groups = [group(0, REV_A, make_pod)]
    out = step(RolloutState(UPDATING, REV_B, group=0, started_at=0.0), groups, leaders, now=61.0)
    assert out.state.phase == FAILED and "timed out after 60s" in out.state.message


def test_resume_after_operator_restart(make_pod):
    groups = [group(0, REV_A, make_pod)]
    state = RolloutState(UPDATING, REV_B, group=0, started_at=0.0)
    leaders = FakeLeaders()  # a new process: no request in flight
    leaders.info["http://127.0.0.1:8000"] = {"weights_phase": "loading"}
    out = step(state, groups, leaders, now=1.0)
    assert out.group_phases == {0: "UpdatingWeights"} and not leaders.sent
    leaders.info["http://127.0.0.1:8000"] = {"weights_phase": "serving", "weights_revision": "rev-b",
                                             "model_path": "/models/m/rev-b"}
    out = step(state, groups, leaders, now=2.0)
    assert out.apply == {0: REV_B}
    leaders.info["http://127.0.0.1:8000"] = {"weights_phase": "serving", "weights_revision": "rev-a",
                                             "model_path": "/models/m/rev-a"}
    out = step(state, groups, leaders, now=3.0)  # the request was lost: send it again
    assert len(leaders.sent) == 1 and out.state.group == 0


def test_waits_for_ready_group_and_adopts_empty_one(make_pod):
    leaders = FakeLeaders()
    starting = [group(0, REV_A, make_pod, ready=False)]
    out = step(None, starting, leaders, now=0.0)
    assert not leaders.sent and "waiting for group 0" in out.state.message
    empty = [GroupObservation(0, 2, starting[0].statefulset, ())]
    out = step(None, empty, leaders, now=0.0)
    assert out.apply == {0: REV_B} and not leaders.sent


def test_graph_change_body():
    target = ServedModel(REV_A.path, REV_A.revision, CudaGraphSpec(True, 8))
    assert update_body(REV_A, target) == {"model_path": REV_A.path, "revision": "rev-a", "recapture_cuda_graph": True,
                                         "cuda_graph_max_bs": 8, "disable_cuda_graph": False}


def test_state_round_trips_through_status():
    state = RolloutState(ROLLING_BACK, REV_B, previous=REV_A, group=1, started_at=1_700_000_000.0, message="m")
    assert RolloutState.from_status(state.to_status()) == state


def test_short_phases_are_reported_in_order(make_pod):
    """Phases shorter than a pass (sampled by the client) come back as a trail of transitions."""
    leaders = FakeLeaders()
    groups = [group(0, REV_A, make_pod)]
    out = step(None, groups, leaders, now=0.0)
    assert out.state.group_phase == "UpdatingWeights"
    leaders.phases["ns/llama/g0"] = ["loading", "recapturing", "serving"]
    leaders.results["ns/llama/g0"] = ("success", "")
    done = step(out.state, groups, leaders, now=1.0)
    assert done.trail == [(0, "RecapturingGraphs")] and done.apply == {0: REV_B}


def test_success_without_sampled_recapture_still_reports_it(make_pod):
    leaders = FakeLeaders()
    groups = [group(0, REV_A, make_pod)]
    out = step(None, groups, leaders, now=0.0)
    leaders.results["ns/llama/g0"] = ("success", "")
    done = step(out.state, groups, leaders, now=1.0)
    assert done.trail == [(0, "RecapturingGraphs")]
    no_graphs = ServedModel(REV_B.path, REV_B.revision, CudaGraphSpec(False, 160))
    leaders = FakeLeaders()
    out = step(None, groups, leaders, now=0.0, target=no_graphs)
    leaders.results["ns/llama/g0"] = ("success", "")
    assert step(out.state, groups, leaders, now=1.0, target=no_graphs).trail == []
