"""Graph settings in a weight update (``cuda_graph_max_bs``, ``disable_cuda_graph``; docs/api.md)
are applied by the scheduler: the decode graphs are recaptured with the new largest batch size,
or dropped, and decoding still equals a cold run of the new weights. GPU only (on CPU decoding
is eager and the settings have nothing to change)."""

from __future__ import annotations

import pytest
from scheduler_harness import greedy, make_scheduler, run_to_completion

from shardline_runtime.managers.io_struct import (
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromDiskReqOutput,
)
from shardline_runtime.weights_state import WeightsState

PROMPTS = {f"p{i}": [5 + i, 17, 29 + i, 41] for i in range(2)}  # one decode batch of 2


def _generate(scheduler) -> dict[str, list[int]]:
    scheduler.process_input_requests([greedy(rid, ids, 12) for rid, ids in PROMPTS.items()])
    return {rid: r["ids"] for rid, r in run_to_completion(scheduler).items() if rid in PROMPTS}


def _update(scheduler, **fields) -> list[str]:
    """Run one update; return the weights phases rank 0 reported for it."""
    scheduler.sender.socket.messages.clear()
    scheduler.process_input_requests([UpdateWeightsFromDiskReqInput(**fields)])
    run_to_completion(scheduler)
    msgs = scheduler.sender.socket.messages
    replies = [m for m in msgs if isinstance(m, UpdateWeightsFromDiskReqOutput)]
    assert len(replies) == 1 and replies[0].success, replies
    return [m.phase.value for m in msgs if isinstance(m, WeightsState)]


@pytest.mark.gpu
def test_update_applies_graph_settings(tiny_checkpoint):
    ckpt_a = tiny_checkpoint("llama", 0, max_position_embeddings=2048)
    ckpt_b = tiny_checkpoint("llama", 1, max_position_embeddings=2048)
    cold_b = _generate(make_scheduler(ckpt_b, device="cuda", disable_cuda_graph=True))
    scheduler = make_scheduler(ckpt_a, device="cuda", disable_cuda_graph=False, cuda_graph_max_bs=8)
    runner = scheduler.worker.model_runner
    assert runner.graphs.decode is not None and runner.graphs.decode.max_bs == 8

    phases = _update(scheduler, model_path=str(ckpt_b), revision="b", cuda_graph_max_bs=2)
    assert "recapturing" in phases and phases[-1] == "serving", phases
    graphs = runner.graphs.decode
    assert graphs is not None and graphs.max_bs == 2 and set(graphs.graphs) == set(graphs.capture_bs)
    assert _generate(scheduler) == cold_b  # decoded in the recaptured graph of batch size 2

    _update(scheduler, model_path=str(ckpt_b), revision="b", disable_cuda_graph=True)
    assert runner.graphs.decode is None
    assert _generate(scheduler) == cold_b

    _update(scheduler, model_path=str(ckpt_b), revision="b", disable_cuda_graph=False, cuda_graph_max_bs=8)
    assert runner.graphs.decode is not None and runner.graphs.decode.max_bs == 8
    assert _generate(scheduler) == cold_b
