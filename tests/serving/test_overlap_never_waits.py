"""The overlap loop prepares step N+1 (and processes step N) without reading the device while a
step is in flight: KV slots come from the allocator's host free list, finished requests' slots
from the host copy of ``req_to_token``, sampling flags from host lists, and a step's outputs are
read only after its own ``wait``. Device tensors are marked (``device_read_guard.OnDevice``) and
any host read of them during that time raises, over a mix of chunked prefill, prefix hits, stop
tokens, penalties, sampling filters, prompt logprobs, aborts and retraction."""

from __future__ import annotations

import random

import pytest
from device_read_guard import DeviceReadError, guard_scheduler
from scheduler_harness import greedy, make_scheduler, run_loop

from shardline_runtime.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from shardline_runtime.sampling.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama", 0, max_position_embeddings=2048)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 500) for _ in range(n)]


def _mixed_arrivals(rng: random.Random) -> dict[int, list]:
    shared = _prompt(rng, 90)
    stops = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=tuple(range(5, 500, 3)))
    filtered = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, top_k=20, seed=7,
                              frequency_penalty=0.5, ignore_eos=True)
    first = [greedy(f"a{i}", _prompt(rng, rng.randint(3, 150)), rng.randint(1, 24)) for i in range(5)]
    first.append(greedy("logprobs", _prompt(rng, 150), 8, return_logprob=True, top_logprobs_num=2,
                        logprob_start_len=5))
    first.append(greedy("shared0", shared + [7, 8], 10))
    return {
        0: first,
        2: [TokenizedGenerateReqInput(rid="stops", input_ids=_prompt(rng, 12), sampling_params=stops),
            TokenizedGenerateReqInput(rid="filtered", input_ids=_prompt(rng, 30), sampling_params=filtered)],
        4: [greedy("long", _prompt(rng, 40), 300)],
        20: [AbortReq("long")],
        40: [greedy("shared1", shared + [9, 10, 11], 10)],
    }


@pytest.fixture(scope="module")
def mixed_run(ckpt):
    """The mixed workload once through a guarded overlap scheduler: (guard state, results)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        scheduler = make_scheduler(ckpt, chunked_prefill_size=64, max_prefill_tokens=256)
        state = guard_scheduler(scheduler, monkeypatch)
        results = run_loop(scheduler, _mixed_arrivals(random.Random(0)))
    return state, results


@pytest.fixture(scope="module")
def retraction_run(ckpt):
    """Eight requests through a pool too small for them (retraction), guarded: (state, scheduler)."""
    rng = random.Random(2)
    with pytest.MonkeyPatch.context() as monkeypatch:
        scheduler = make_scheduler(ckpt, max_total_tokens=256, disable_radix_cache=True)
        state = guard_scheduler(scheduler, monkeypatch)
        run_loop(scheduler, {0: [greedy(f"r{i}", _prompt(rng, rng.randint(20, 40)), 40) for i in range(8)]})
    return state, scheduler


def test_mixed_workload_never_reads_the_device_while_a_step_is_in_flight(mixed_run):
    state, _ = mixed_run
    assert state.reads_blocked == 0


def test_mixed_workload_overlapped_its_steps(mixed_run):
    state, _ = mixed_run
    assert state.max_in_flight == 2, "step N+1 was launched before step N was waited for"


def test_mixed_workload_hits_the_prefix_cache(mixed_run):
    _, results = mixed_run
    assert results["shared1"]["cached"] > 0


def test_mixed_workload_stops_on_a_stop_token(mixed_run):
    _, results = mixed_run
    assert results["stops"]["finish"]["type"] == "stop"


def test_mixed_workload_aborts_the_long_request(mixed_run):
    _, results = mixed_run
    assert results["long"]["finish"]["type"] == "abort"


def test_mixed_workload_returns_every_chunked_prompt_logprob(mixed_run):
    _, results = mixed_run
    assert len(results["logprobs"]["prompt_logprobs"]) == 145


def test_retraction_never_reads_the_device_while_a_step_is_in_flight(retraction_run):
    state, _ = retraction_run
    assert state.reads_blocked == 0


def test_retraction_happened_under_the_guard(retraction_run):
    _, scheduler = retraction_run
    assert scheduler.decode_manager.num_retractions > 0


def test_the_guard_refuses_a_read_of_req_to_token_while_a_step_is_in_flight(ckpt, monkeypatch):
    scheduler = make_scheduler(ckpt)
    state = guard_scheduler(scheduler, monkeypatch)
    state.in_flight = 1
    with pytest.raises(DeviceReadError):
        scheduler.cache.req_to_token_pool.req_to_token[0, :4].cpu()


def test_the_guard_refuses_a_read_of_a_sampled_token_while_a_step_is_in_flight(ckpt, monkeypatch):
    scheduler = make_scheduler(ckpt)
    state = guard_scheduler(scheduler, monkeypatch)
    state.in_flight = 1
    with pytest.raises(DeviceReadError):
        bool(scheduler.overlap.future_map.token_ids[0] > 0)
