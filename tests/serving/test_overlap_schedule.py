"""Overlap scheduling (step N+1 prepared and launched before step N's result is processed) gives
the same greedy outputs as ``--disable-overlap-schedule``, through the scheduler's own loop, over
a mix of prefill and decode, chunked prefill, prefix-cache hits, stop tokens, logprobs,
``max_new_tokens`` 0 and 1, aborts, retraction and a weight update."""

from __future__ import annotations

import random

import pytest
from scheduler_harness import greedy, make_scheduler, run_loop

from shardline_runtime.managers.io_struct import AbortReq, TokenizedGenerateReqInput, UpdateWeightsFromDiskReqInput
from shardline_runtime.sampling.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama", 0, max_position_embeddings=2048)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 500) for _ in range(n)]


def _both(ckpt, arrivals, **overrides) -> tuple[dict, dict, list]:
    """Run ``arrivals`` with and without overlap; returns both results and both schedulers."""
    out, schedulers = [], []
    for disable in (False, True):
        scheduler = make_scheduler(ckpt, disable_overlap_schedule=disable, **overrides)
        assert (scheduler.overlap.future_map is None) == disable
        assert scheduler.scheduler_info().overlap_schedule is not disable  # /get_server_info's value
        placeholders = _count_placeholders(scheduler) if not disable else None
        out.append(run_loop(scheduler, arrivals))
        if placeholders is not None:
            assert placeholders[0] > 0, "some decode input was a token still being sampled (the steps overlapped)"
        schedulers.append(scheduler)
    return out[0], out[1], schedulers


def _count_placeholders(scheduler) -> list[int]:
    """Count the input ids resolved from the future map (a spy on the real method)."""
    seen = [0]
    resolve = scheduler.overlap.future_map.resolve

    def counting(input_ids, *rest):
        seen[0] += int((input_ids < 0).sum())
        return resolve(input_ids, *rest)

    scheduler.overlap.future_map.resolve = counting
    return seen


def _assert_settled(scheduler) -> None:
    assert scheduler.overlap.in_flight is None
    assert scheduler.cache.used_tokens() == 0, "every KV slot is free or in the prefix cache"
    assert scheduler.cache.req_to_token_pool.available_size() == scheduler.cache.req_to_token_pool.size


def test_overlap_equals_no_overlap_over_a_mixed_workload(ckpt):
    rng = random.Random(0)
    shared = _prompt(rng, 90)
    first = [greedy(f"a{i}", _prompt(rng, rng.randint(3, 150)), rng.randint(1, 24)) for i in range(6)]
    first.append(greedy("prefill_only", _prompt(rng, 20), 0, return_logprob=True, logprob_start_len=0))
    first.append(greedy("logprobs", _prompt(rng, 150), 12, return_logprob=True, top_logprobs_num=2, logprob_start_len=5))
    first.append(greedy("shared0", shared + [7, 8], 10))
    stop_params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=tuple(range(5, 500, 3)))
    arrivals = {
        0: first,
        2: [greedy("late", _prompt(rng, 200), 15), TokenizedGenerateReqInput(rid="stops", input_ids=_prompt(rng, 12), sampling_params=stop_params)],
        4: [greedy("long", _prompt(rng, 40), 300)],
        25: [AbortReq("long")],
        50: [greedy("shared1", shared + [9, 10, 11], 10)],
    }
    overlap, plain, schedulers = _both(ckpt, arrivals, chunked_prefill_size=64, max_prefill_tokens=256)
    assert overlap.keys() == plain.keys()
    for rid in overlap:
        if rid == "long":
            continue
        assert overlap[rid]["ids"] == plain[rid]["ids"], f"{rid}: greedy tokens differ with overlap"
        assert overlap[rid]["finish"] == plain[rid]["finish"], rid
        assert overlap[rid]["logprobs"] == pytest.approx(plain[rid]["logprobs"], abs=1e-5), rid
    prompt_logprobs = [[lp for lp, _ in run["prompt_logprobs"]] for run in (overlap["logprobs"], plain["logprobs"])]
    assert len(prompt_logprobs[0]) == 145 and None not in prompt_logprobs[0][1:], "chunked prompt logprobs are complete"
    assert prompt_logprobs[0] == pytest.approx(prompt_logprobs[1], abs=1e-5)
    assert overlap["stops"]["finish"]["type"] == "stop"
    assert overlap["prefill_only"]["ids"] == [] and len(overlap["prefill_only"]["prompt_logprobs"]) == 20
    assert overlap["shared1"]["cached"] == plain["shared1"]["cached"] > 0
    for run in (overlap, plain):
        assert run["long"]["finish"]["type"] == "abort"
        assert 0 < len(run["long"]["ids"]) < 300
    shorter, longer = sorted((overlap["long"]["ids"], plain["long"]["ids"]), key=len)
    assert longer[: len(shorter)] == shorter, "an aborted request's tokens are the same up to the abort"
    for scheduler in schedulers:
        _assert_settled(scheduler)


def test_overlap_with_retraction_equals_a_big_pool(ckpt):
    rng = random.Random(2)
    reqs = [greedy(f"r{i}", _prompt(rng, rng.randint(20, 40)), 40) for i in range(8)]
    expected = run_loop(make_scheduler(ckpt, max_total_tokens=2048, disable_overlap_schedule=True), {0: reqs})
    small = make_scheduler(ckpt, max_total_tokens=256, disable_radix_cache=True)
    placeholders = _count_placeholders(small)
    got = run_loop(small, {0: reqs})
    assert placeholders[0] > 0
    assert small.decode_manager.num_retractions > 0
    assert {k: v["ids"] for k, v in got.items()} == {k: v["ids"] for k, v in expected.items()}
    _assert_settled(small)


def test_weight_update_drains_the_step_in_flight(ckpt, tiny_checkpoint):
    ckpt_b = tiny_checkpoint("llama", 1, max_position_embeddings=2048, tokenizer=False)
    rng = random.Random(3)
    old = [greedy(f"old{i}", _prompt(rng, 10 + 7 * i), 12) for i in range(3)]
    new = greedy("new", _prompt(rng, 9), 12)
    arrivals = {0: old, 4: [UpdateWeightsFromDiskReqInput(model_path=str(ckpt_b), revision="b"), new]}
    overlap, plain, schedulers = _both(ckpt, arrivals)
    assert {k: v["ids"] for k, v in overlap.items()} == {k: v["ids"] for k, v in plain.items()}
    on_a = run_loop(make_scheduler(ckpt, disable_overlap_schedule=True), {0: old})
    on_b = run_loop(make_scheduler(ckpt_b, disable_overlap_schedule=True), {0: [new]})
    assert {k: overlap[k]["ids"] for k in on_a} == {k: v["ids"] for k, v in on_a.items()}, "old requests finish on A"
    assert overlap["new"]["ids"] == on_b["new"]["ids"], "a request queued behind the update runs on B"
    for scheduler in schedulers:
        _assert_settled(scheduler)
