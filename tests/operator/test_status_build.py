"""status.py: phases, conditions (standard shape, stable transition times), merge-patch deletions."""

from __future__ import annotations

import pytest

from shardline_operator import labels
from shardline_operator.group_health import GroupRecord
from shardline_operator.observed import GroupObservation, PodObservation
from shardline_operator.rollout_state import FAILED, RolloutState
from shardline_operator.runtime_args import ServedModel
from shardline_operator.weights import LeaderReport, ReportedGraphs, WeightsPhase
from shardline_operator.rollout import GroupView
from tests.operator.conftest import BASE_SPEC
from shardline_operator.status import (GroupReport, build_status, deployment_phase, record_from_status,
                                       served_revision, status_patch)


def observed(spec, index, make_pod, revision="rev-a", ready=True, pods=2):
    served = ServedModel.desired(spec)
    path = served.path.replace("rev-a", revision)
    sts = {"metadata": {"annotations": {labels.ANNOTATION_MODEL_PATH: path, labels.ANNOTATION_MODEL_REVISION: revision,
                                        labels.ANNOTATION_CUDA_GRAPH: served.cuda_graph.key()}}}
    members = tuple(PodObservation.from_api(make_pod(index, r, ready=ready)) for r in range(pods))
    return GroupObservation(index, 2, sts, members)


CAPTURED = ReportedGraphs(decode_batch_sizes=(1, 2, 4, 8), piecewise_token_buckets=())
ON_CPU = ReportedGraphs(reason="cpu: no CUDA graphs")


def reported(spec, index, make_pod, graphs):
    """A Ready group whose leader's ``/get_server_info`` reported ``graphs``."""
    observation = observed(spec, index, make_pod)
    leader = LeaderReport(WeightsPhase.SERVING, observation.served.path, "rev-a", graphs=graphs)
    return GroupReport(observation, GroupRecord(), view=GroupView(index, observation.served, leader=leader))


def graphs_condition_of(spec, reports):
    status = build_status(spec, 1, reports, None, {}, now=1_700_000_000.0)
    return next(c for c in status["conditions"] if c["type"] == "GraphsCaptured")


def test_graphs_captured_is_true_when_every_leader_reported_graphs(make_spec, make_pod):
    spec = make_spec()
    condition = graphs_condition_of(spec, [reported(spec, g, make_pod, CAPTURED) for g in range(2)])
    assert (condition["status"], condition["message"]) == ("True", "decode batch sizes 1-8 (4 graphs)")


def test_graphs_captured_on_cpu_pods_says_nothing_was_captured_and_why(make_spec, make_pod):
    """The spec asks for graphs (cudaGraph.enabled defaults to true); the CPU runtime captured none."""
    spec = make_spec()
    condition = graphs_condition_of(spec, [reported(spec, g, make_pod, ON_CPU) for g in range(2)])
    assert (condition["status"], condition["reason"]) == ("False", "NotCaptured")


def test_graphs_captured_on_cpu_pods_carries_the_runtimes_reason(make_spec, make_pod):
    spec = make_spec({"replicas": 1})
    condition = graphs_condition_of(spec, [reported(spec, 0, make_pod, ON_CPU)])
    assert condition["message"] == "group 0: none: cpu: no CUDA graphs"


def test_graphs_disabled_by_the_runtimes_flag_reads_disabled(make_spec, make_pod):
    spec = make_spec({"runtime": {**BASE_SPEC["runtime"], "cudaGraph": {"enabled": False}}})
    off = ReportedGraphs(reason="disabled by flag: --disable-cuda-graph")
    assert graphs_condition_of(spec, [reported(spec, g, make_pod, off) for g in range(2)])["reason"] == "Disabled"


def test_graphs_captured_waits_for_every_leaders_report(make_spec, make_pod):
    spec = make_spec()
    reports = [reported(spec, 0, make_pod, CAPTURED), GroupReport(observed(spec, 1, make_pod), GroupRecord())]
    assert graphs_condition_of(spec, reports)["reason"] == "Pending"


def test_a_group_lists_the_graphs_its_leader_reported(make_spec, make_pod):
    spec = make_spec()
    status = build_status(spec, 1, [reported(spec, g, make_pod, ON_CPU) for g in range(2)], None, {}, now=0.0)
    assert [g["graphs"] for g in status["groups"]] == ["none: cpu: no CUDA graphs"] * 2


def test_all_ready(make_spec, make_pod):
    spec = make_spec()
    reports = [reported(spec, g, make_pod, CAPTURED) for g in range(2)]
    status = build_status(spec, 3, reports, None, {}, now=1_700_000_000.0)
    assert status["phase"] == "Ready" and status["readyReplicas"] == 2 and status["replicas"] == 2
    assert status["observedGeneration"] == 3
    assert status["servedRevision"] == "rev-a" and status["targetRevision"] == "rev-a"
    assert status["selector"] == "shardline.dev/deployment=llama"
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True" and conditions["WeightsUpdated"]["status"] == "True"
    assert conditions["GraphsCaptured"]["status"] == "True" and conditions["Degraded"]["status"] == "False"
    for c in status["conditions"]:
        assert set(c) == {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}
    assert [g["phase"] for g in status["groups"]] == ["Ready", "Ready"]


def test_transition_time_kept_while_status_unchanged(make_spec, make_pod):
    spec = make_spec()
    reports = [GroupReport(observed(spec, g, make_pod), GroupRecord()) for g in range(2)]
    first = build_status(spec, 1, reports, None, {}, now=1_700_000_000.0)
    second = build_status(spec, 1, reports, None, first, now=1_700_000_100.0)
    assert first["conditions"] == second["conditions"]
    reports[1] = GroupReport(observed(spec, 1, make_pod, ready=False), GroupRecord())
    third = build_status(spec, 1, reports, None, second, now=1_700_000_200.0)
    ready = next(c for c in third["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["lastTransitionTime"] == "2023-11-14T22:16:40Z"


def test_rollout_in_progress_and_mixed_revisions(make_spec, make_pod):
    spec = make_spec({"model": {"name": "tiny-llama", "path": "/var/lib/shardline/models/tiny-llama/rev-b",
                                "revision": "rev-b"}})
    reports = [GroupReport(observed(spec, 0, make_pod, "rev-b"), GroupRecord()),
               GroupReport(observed(spec, 1, make_pod, "rev-a"), GroupRecord(), "RecapturingGraphs")]
    state = RolloutState("Updating", ServedModel.desired(spec), wave=(1,), started_at=0.0, message="updating group 1")
    status = build_status(spec, 2, reports, state, {}, now=0.0)
    assert status["phase"] == "RecapturingGraphs"
    assert status["servedRevision"] == "rev-b,rev-a" and status["targetRevision"] == "rev-b"
    assert [g["revision"] for g in status["groups"]] == ["rev-b", "rev-a"]
    weights = next(c for c in status["conditions"] if c["type"] == "WeightsUpdated")
    assert weights["status"] == "False" and weights["reason"] == "Updating"


def test_failed_rollout_reports_message(make_spec, make_pod):
    spec = make_spec({"model": {"name": "tiny-llama", "path": "/var/lib/shardline/models/tiny-llama/rev-b",
                                "revision": "rev-b"}})
    reports = [GroupReport(observed(spec, g, make_pod, "rev-a"), GroupRecord()) for g in range(2)]
    state = RolloutState(FAILED, ServedModel.desired(spec), message="group 1: update to rev-b failed: bad shape")
    status = build_status(spec, 2, reports, state, {}, now=0.0)
    weights = next(c for c in status["conditions"] if c["type"] == "WeightsUpdated")
    assert weights["status"] == "False" and weights["reason"] == "UpdateFailed" and "bad shape" in weights["message"]
    assert status["servedRevision"] == "rev-a" and status["phase"] == "Degraded"


def test_failed_group(make_spec, make_pod):
    spec = make_spec()
    reports = [GroupReport(observed(spec, 0, make_pod), GroupRecord()),
               GroupReport(observed(spec, 1, make_pod, ready=False), GroupRecord(restarts=5, failed_message="OSError: x"))]
    status = build_status(spec, 1, reports, None, {}, now=0.0)
    assert status["phase"] == "Degraded" and "group 1: OSError: x" in status["message"]
    assert status["groups"][1]["phase"] == "Failed" and status["groups"][1]["message"] == "OSError: x"
    assert record_from_status(status["groups"][1]).failed_message == "OSError: x"


def test_deployment_phase_table():
    assert deployment_phase([], 0, 0, None) == "Ready"
    assert deployment_phase(["Pending", "Pending"], 0, 2, None) == "Pending"
    assert deployment_phase(["Initializing", "Pending"], 0, 2, None) == "Initializing"
    assert deployment_phase(["Ready", "Initializing"], 1, 2, None) == "Initializing"
    assert deployment_phase(["Ready", "Restarting"], 1, 2, None) == "Degraded"
    assert deployment_phase(["Failed", "Failed"], 0, 2, None) == "Failed"
    assert deployment_phase(["Ready", "UpdatingWeights"], 1, 2, None) == "UpdatingWeights"
    # Issue 9: mid-rollout is its own phase; a planned restart is not Degraded; mixed versions are.
    assert deployment_phase(["Ready", "Ready"], 2, 2, None, rolling=True) == "RollingOut"
    assert deployment_phase(["Ready", "Initializing"], 1, 2, None, rolling=True) == "RollingOut"
    assert deployment_phase(["Ready", "Restarting"], 1, 2, None, rolling=True, planned_restart=True) == "RollingOut"
    assert deployment_phase(["Ready", "Ready"], 2, 2, None, mixed=True) == "Degraded"


def test_rolling_out_lasts_until_every_group_is_ready_again(make_spec, make_pod):
    spec = make_spec()
    reports = [GroupReport(observed(spec, 0, make_pod), GroupRecord()),
               GroupReport(observed(spec, 1, make_pod, ready=False), GroupRecord())]
    assert build_status(spec, 1, reports, None, {"phase": "RollingOut"}, now=0.0)["phase"] == "RollingOut"
    assert build_status(spec, 1, reports, None, {"phase": "Ready"}, now=0.0)["phase"] == "Initializing"


@pytest.mark.parametrize("revisions, expected", [
    ([], ""),
    (["rev-a"], "rev-a"),
    (["rev-a", "rev-a"], "rev-a"),
    (["rev-b", "rev-a", "rev-b"], "rev-b,rev-a"),  # group order, each revision once
    (["rev-a", "rev-b"], "rev-a,rev-b"),
    (["", "rev-a", ""], "rev-a"),  # groups with no revision (not serving) are left out
])
def test_served_revision_lists_revisions_in_group_order_without_repeats(revisions, expected):
    assert served_revision(revisions) == expected


def test_status_patch_deletes_removed_keys():
    previous = {"rollout": {"phase": "Updating", "group": 1, "startedAt": "x"}, "message": "m", "groups": [1]}
    new = {"rollout": {"phase": "Updating"}, "groups": []}
    assert status_patch(previous, new) == {"rollout": {"phase": "Updating", "group": None, "startedAt": None},
                                           "groups": [], "message": None}
