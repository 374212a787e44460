"""ServerState alone: one WeightsState copy, replaced whole; /get_server_info's keys from it."""

from __future__ import annotations

from shardline_runtime.managers.io_struct import SchedulerInfo
from shardline_runtime.managers.server_state import ServerState
from shardline_runtime.weights_state import UpdateTimings, WeightsPhase, WeightsState


def _state() -> ServerState:
    weights = WeightsState(model_path="/ckpt/a", revision="rev-a", digest="sha256:a")
    info = SchedulerInfo(0, 2048, 2047, 2046, 4096, 256, 64, weights)
    return ServerState(info, {"ad": "/adapters/ad"})


def test_the_first_record_comes_from_the_schedulers_info():
    weights = _state().weights
    assert weights == WeightsState(model_path="/ckpt/a", revision="rev-a", digest="sha256:a")


def test_a_message_replaces_the_record_whole():
    state = _state()
    new = WeightsState(model_path="/ckpt/b", revision="rev-b", weight_version="v2",
                       phase=WeightsPhase.SERVING, digest="sha256:b",
                       last_update=UpdateTimings(success=True, model_path="/ckpt/b", load_seconds=1.5))
    state.set_weights(new)
    assert state.weights is new


def test_server_info_keeps_the_flat_keys_derived_from_the_one_record():
    state = _state()
    state.set_weights(WeightsState(model_path="/ckpt/b", revision="rev-b", weight_version="v2",
                                   phase=WeightsPhase.RECAPTURING, digest="sha256:b",
                                   last_update=UpdateTimings(success=True, model_path="/ckpt/b",
                                                             load_seconds=1.5, recapture_seconds=0.5)))
    info = state.weights_info()
    assert info["weights"] == state.weights.model_dump(mode="json")
    assert info["weights_phase"] == "recapturing"
    assert info["weights_revision"] == "rev-b"
    assert info["model_path"] == "/ckpt/b"
    assert info["weights_digest"] == "sha256:b"
    assert info["weight_version"] == "v2"
    assert info["last_weight_update"] == {"success": True, "model_path": "/ckpt/b", "load_seconds": 1.5,
                                          "recapture_seconds": 0.5}


def test_an_update_shows_loading_until_the_schedulers_record_arrives():
    state = _state()
    state.mark_updating()
    assert state.weights.phase is WeightsPhase.LOADING
    state.end_update_if_silent()
    assert state.weights.phase is WeightsPhase.SERVING


def test_a_record_that_arrived_is_not_overridden_when_the_update_ends():
    state = _state()
    state.mark_updating()
    state.set_weights(WeightsState(model_path="/ckpt/a", phase=WeightsPhase.FAILED))
    state.end_update_if_silent()
    assert state.weights.phase is WeightsPhase.FAILED


def test_an_openai_model_names_a_loaded_adapter_or_the_base_model():
    state = _state()
    assert state.lora_for_model("ad") == "ad"
    assert state.lora_for_model("tiny-llama") is None
