"""Contract: the operator reads back every field of the ``weights`` block the runtime writes.

The runtime serialises its one ``WeightsState`` record into ``/get_server_info`` as
``{"weights": state.model_dump(mode="json"), ...}``; the operator parses that block with its own
mirror of ``WeightsPhase`` (it never imports the runtime). A field renamed or a phase added on
one side fails here, not in a rollout.
"""

from __future__ import annotations

import json

import pytest

from shardline_operator.weights import LeaderReport, ReportedGraphs
from shardline_operator.weights import WeightsPhase as OperatorPhase
from shardline_runtime.weights_state import CapturedGraphs, UpdateTimings, WeightsPhase, WeightsState

DIGEST = "sha256:" + "ab" * 32
CAPTURED = CapturedGraphs(decode_batch_sizes=(1, 2, 4, 8, 16), piecewise_token_buckets=(16, 32))
NOTHING = CapturedGraphs(reason="cpu: no CUDA graphs")
TIMINGS = UpdateTimings(success=True, model_path="/m/rev-b", load_seconds=1.25, recapture_seconds=0.5)


def info_for(state: WeightsState) -> dict:
    """``/get_server_info`` as the operator receives it (the JSON round trip included)."""
    return json.loads(json.dumps({"weights": state.model_dump(mode="json")}))


def states() -> list[WeightsState]:
    out = []
    for phase in WeightsPhase:
        out.append(WeightsState(model_path="/m/rev-b", revision="rev-b", weight_version="step-7", phase=phase,
                                digest=DIGEST, last_update=TIMINGS, graphs=CAPTURED,
                                quantization="fp8-w8a8-dynamic-channel"))
    out.append(WeightsState(model_path="/m/rev-a"))  # defaults: no update yet, graphs not reported
    out.append(WeightsState(model_path="/m/rev-a", graphs=NOTHING))  # a CPU runtime at start
    out.append(WeightsState(model_path="/m/rev-a", phase=WeightsPhase.FAILED,
                            last_update=UpdateTimings(success=False, model_path="/m/broken")))
    out.append(WeightsState(model_path="hf://o/t@v2", revision="rev-d", draft_model_path="hf://o/d@v2",
                            draft_digest=DIGEST, draft_source_revision="c0ffee"))  # with a draft (issue 30)
    return out


def test_the_two_phase_enums_have_the_same_values():
    assert [p.value for p in OperatorPhase] == [p.value for p in WeightsPhase]


def test_the_two_phase_enums_agree_on_which_phases_are_updating():
    assert [OperatorPhase(p.value).updating for p in WeightsPhase] == [p.updating for p in WeightsPhase]


@pytest.mark.parametrize("state", states(), ids=lambda s: f"{s.phase.value}-{s.revision}-{s.last_update is not None}-{s.graphs is not None}")
class TestOperatorReadsTheBlock:
    def test_phase(self, state):
        assert LeaderReport.from_info(info_for(state)).weights_phase.value == state.phase.value

    def test_model_path(self, state):
        assert LeaderReport.from_info(info_for(state)).model_path == state.model_path

    def test_revision(self, state):
        assert LeaderReport.from_info(info_for(state)).revision == state.revision

    def test_digest(self, state):
        assert LeaderReport.from_info(info_for(state)).digest == state.digest

    def test_weight_version(self, state):
        assert LeaderReport.from_info(info_for(state)).weight_version == state.weight_version

    def test_draft(self, state):
        parsed = LeaderReport.from_info(info_for(state))
        assert (parsed.draft_model_path, parsed.draft_digest, parsed.draft_source_revision) == (
            state.draft_model_path, state.draft_digest, state.draft_source_revision)

    def test_quantization(self, state):
        assert LeaderReport.from_info(info_for(state)).quantization == state.quantization

    def test_last_update(self, state):
        parsed = LeaderReport.from_info(info_for(state)).last_update
        expected = state.last_update.model_dump() if state.last_update is not None else None
        assert (parsed.__dict__ if parsed is not None else None) == expected


    def test_graphs(self, state):
        parsed = LeaderReport.from_info(info_for(state)).graphs
        expected = None if state.graphs is None else ReportedGraphs(**state.graphs.model_dump())
        assert parsed == expected

    def test_whether_graphs_were_captured(self, state):
        parsed = LeaderReport.from_info(info_for(state)).graphs
        assert (parsed.captured if parsed else None) == (state.graphs.captured if state.graphs else None)


def test_the_graphs_report_has_the_same_fields_on_both_sides():
    assert list(CapturedGraphs.model_fields) == list(ReportedGraphs.__dataclass_fields__)


def test_the_block_wins_over_the_flat_keys():
    """A runtime writes both while the flat keys are kept for old readers; the block is the truth."""
    info = info_for(states()[0]) | {"weights_phase": "loading", "weights_revision": "stale"}
    assert LeaderReport.from_info(info).revision == "rev-b"


def test_a_runtime_without_the_block_is_read_from_the_flat_keys():
    info = {"weights_phase": "recapturing", "model_path": "/m/rev-b", "weights_revision": "rev-b",
            "weights_digest": DIGEST, "weight_version": "step-7"}
    report = LeaderReport.from_info(info)
    assert report.weights_phase is OperatorPhase.RECAPTURING


def test_the_graphs_block_is_what_get_server_info_serves():
    """``ServerState.weights_info`` (the route's body) carries the report the operator parses."""
    from shardline_runtime.managers.io_struct import SchedulerInfo
    from shardline_runtime.managers.server_state import ServerState

    state = ServerState(SchedulerInfo(0, 64, 63, 62, 64, 100, 4, WeightsState(model_path="/m", graphs=NOTHING)))
    info = json.loads(json.dumps(state.weights_info()))
    assert LeaderReport.from_info(info).graphs == ReportedGraphs(reason="cpu: no CUDA graphs")


def test_a_runtime_without_the_graphs_report_is_read_as_not_reported():
    assert LeaderReport.from_info(info_for(WeightsState(model_path="/m"))).graphs is None
