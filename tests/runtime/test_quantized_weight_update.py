"""update_weights_from_disk on a quantized server: another revision of the same scheme is
copied in place (scales included) and serves what a cold start on it serves; a change of scheme
is refused and nothing changes; the served scheme is in the weights record."""

from __future__ import annotations

import pytest

from quant_checkpoint import quantize_checkpoint
from shardline_runtime.sampling import SamplingParams
from tests.runtime.engine_driver import make_worker, run_engine

pytest.importorskip("compressed_tensors")

PROMPTS = [[5, 17, 33, 80, 9], [300, 12, 55, 66, 77, 88]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def revisions(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-revisions")
    return {
        "fp8_a": quantize_checkpoint(tiny_checkpoint("llama", seed=0), root / "fp8_a", "FP8_DYNAMIC"),
        "fp8_b": quantize_checkpoint(tiny_checkpoint("llama", seed=1), root / "fp8_b", "FP8_DYNAMIC"),
        "w4": quantize_checkpoint(
            tiny_checkpoint("llama", seed=1), root / "w4", "W4A16", group_size=32
        ),
    }


def scales(worker):
    return {
        name: p.detach().clone()
        for name, p in worker.model_runner.model.named_parameters()
        if name.endswith("weight_scale")
    }


def test_update_to_another_revision_of_the_scheme_equals_cold_start(revisions):
    cold_b = run_engine(make_worker(revisions["fp8_b"], dtype="float32"), PROMPTS, GREEDY)
    worker = make_worker(revisions["fp8_a"], dtype="float32")
    before = run_engine(worker, PROMPTS, GREEDY)
    assert before != cold_b
    ptrs = {n: p.data_ptr() for n, p in worker.model_runner.model.named_parameters()}
    ok, message = worker.update_weights_from_disk(str(revisions["fp8_b"]))
    assert ok, message
    assert {n: p.data_ptr() for n, p in worker.model_runner.model.named_parameters()} == ptrs
    assert run_engine(worker, PROMPTS, GREEDY) == cold_b


def test_update_copies_the_scales(revisions):
    worker = make_worker(revisions["fp8_a"], dtype="float32")
    fresh_b = scales(make_worker(revisions["fp8_b"], dtype="float32"))
    ok, message = worker.update_weights_from_disk(str(revisions["fp8_b"]))
    assert ok, message
    after = scales(worker)
    assert all(after[n].equal(fresh_b[n]) for n in fresh_b), "scales differ from a cold start"


def test_change_of_scheme_is_refused_and_nothing_changes(revisions):
    worker = make_worker(revisions["fp8_a"], dtype="float32")
    before = run_engine(worker, PROMPTS, GREEDY)
    ok, message = worker.update_weights_from_disk(str(revisions["w4"]))
    assert not ok
    assert "quantization" in message
    assert run_engine(worker, PROMPTS, GREEDY) == before
