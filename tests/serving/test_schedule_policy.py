"""The batching policy on real pools and a real prefix cache, without a model: the KV reserve,
the prefill budget, chunking, admission order, retraction choice, rollback, aborts."""

from __future__ import annotations

import pytest

from shardline_runtime.managers.cache_manager import CacheManager
from shardline_runtime.managers.decode_manager import DecodeManager
from shardline_runtime.managers.prefill_manager import PrefillManager
from shardline_runtime.managers.req import FinishReason, Req
from shardline_runtime.managers.schedule_batch import ScheduleBatch
from shardline_runtime.managers.schedule_policy import (
    AddReqResult,
    BatchLimits,
    NewTokenRatio,
    PrefillAdder,
    choose_retraction_victim,
)
from shardline_runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from shardline_runtime.mem_cache.radix_cache import RadixCache
from shardline_runtime.sampling import SamplingParams

VOCAB = 32


def make_cache(kv_slots: int = 200, rows: int = 8, disable_cache: bool = False) -> CacheManager:
    allocator = TokenToKVPoolAllocator(kv_slots)
    return CacheManager(allocator, ReqToTokenPool(rows, 256), RadixCache(allocator.free, disable_cache), kv_slots)


def limits(**overrides) -> BatchLimits:
    values = dict(max_running_requests=8, max_prefill_tokens=1000, chunked_prefill_size=None, max_req_len=256)
    values.update(overrides)
    return BatchLimits(**values)


def req(rid: str, prompt_len: int, max_new_tokens: int = 10, first_token: int = 1, **kw) -> Req:
    prompt = list(range(first_token, first_token + prompt_len))
    return Req(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0), **kw)


def managers(cache: CacheManager, batch_limits: BatchLimits, ratio: NewTokenRatio | None = None):
    ratio = ratio or NewTokenRatio()

    def new_batch(reqs):
        return ScheduleBatch(reqs, cache.req_to_token_pool, cache.allocator, VOCAB)

    return PrefillManager(cache, ratio, batch_limits, new_batch), DecodeManager(cache, ratio, batch_limits.max_req_len)


def finish_extend(batch: ScheduleBatch, decode: DecodeManager, token: int = 5) -> None:
    """What the scheduler does after an EXTEND step: each request samples ``token`` and joins
    the running batch."""
    for r in batch.reqs:
        r.append_output(token)
    batch.filter_batch()
    decode.add(batch)


# ---------------------------------------------------------------- NewTokenRatio


def test_reserve_is_ratio_of_remaining_tokens_capped_by_max_req_len():
    ratio = NewTokenRatio(value=0.5)
    r = req("a", 4, max_new_tokens=100)
    r.append_output(7)
    assert ratio.reserve(r, max_req_len=1000) == 49
    assert ratio.reserve(r, max_req_len=20) == 10


def test_ratio_decays_per_decode_step_to_its_minimum():
    ratio = NewTokenRatio(value=0.105, minimum=0.1, decay=0.002)
    ratio.on_decode_step()
    assert ratio.value == pytest.approx(0.103)
    for _ in range(5):
        ratio.on_decode_step()
    assert ratio.value == 0.1


def test_ratio_rises_after_a_retraction_up_to_one():
    ratio = NewTokenRatio(value=0.95, retract_step=0.1)
    ratio.on_retract()
    assert ratio.value == 1.0


# ---------------------------------------------------------------- PrefillAdder


def test_adder_stops_at_the_prefill_token_budget_and_cuts_the_last_request():
    adder = PrefillAdder(limits(max_prefill_tokens=10), NewTokenRatio(value=0.0), make_cache(), [])
    first, second = req("a", 6), req("b", 8)
    assert adder.add_one_req(first) is AddReqResult.CONTINUE
    assert adder.add_one_req(second) is AddReqResult.CONTINUE
    assert second.extend_input_len == 4, "the second prompt is cut to the 4 tokens left in the budget"
    assert adder.new_chunked_req is second
    assert adder.add_one_req(req("c", 1)) is AddReqResult.BATCH_FULL


def test_adder_chunks_a_long_prompt_and_admits_nothing_after_it():
    adder = PrefillAdder(limits(chunked_prefill_size=16), NewTokenRatio(value=0.0), make_cache(), [])
    long = req("long", 40)
    assert adder.add_one_req(long) is AddReqResult.CONTINUE
    assert long.extend_input_len == 16
    assert adder.new_chunked_req is long
    assert adder.add_one_req(req("short", 2)) is AddReqResult.BATCH_FULL


def test_adder_counts_running_requests_against_max_running_requests():
    running = [req("r0", 3), req("r1", 3)]
    adder = PrefillAdder(limits(max_running_requests=3), NewTokenRatio(value=0.0), make_cache(), running)
    assert adder.add_one_req(req("a", 2)) is AddReqResult.CONTINUE
    assert adder.add_one_req(req("b", 2)) is AddReqResult.BATCH_FULL


def test_adder_stops_when_request_rows_run_out():
    adder = PrefillAdder(limits(), NewTokenRatio(value=0.0), make_cache(rows=1), [])
    assert adder.add_one_req(req("a", 2)) is AddReqResult.CONTINUE
    assert adder.add_one_req(req("b", 2)) is AddReqResult.BATCH_FULL


def test_adder_refuses_a_second_request_whose_prompt_and_reserve_do_not_fit():
    adder = PrefillAdder(limits(), NewTokenRatio(value=0.5), make_cache(kv_slots=100), [])
    assert adder.add_one_req(req("a", 40, max_new_tokens=40)) is AddReqResult.CONTINUE  # 40 + 20 reserved
    assert adder.rem_kv_tokens == 40
    assert adder.add_one_req(req("b", 30, max_new_tokens=40)) is AddReqResult.NO_KV  # 30 + 20 > 40
    assert [r.rid for r in adder.can_run_list] == ["a"]


def test_first_request_may_use_the_running_requests_reserve_but_not_more():
    running = [req("r", 4, max_new_tokens=100)]  # reserves 50 of 100 slots at ratio 0.5
    adder = PrefillAdder(limits(), NewTokenRatio(value=0.5), make_cache(kv_slots=100), running)
    assert adder.reserved_tokens == 50
    assert adder.add_one_req(req("fits", 90, max_new_tokens=1)) is AddReqResult.CONTINUE
    adder = PrefillAdder(limits(), NewTokenRatio(value=0.5), make_cache(kv_slots=100), running)
    assert adder.add_one_req(req("too_long", 101, max_new_tokens=1)) is AddReqResult.NO_KV


def test_adder_reuses_a_cached_prefix_and_locks_it():
    cache = make_cache()
    prefix = list(range(1, 21))
    slots = cache.allocator.alloc(20)
    cache.tree_cache.insert(prefix, slots)
    assert cache.tree_cache.evictable_size() == 20
    adder = PrefillAdder(limits(), NewTokenRatio(value=0.0), cache, [])
    r = Req("a", prefix + [30, 31, 32], SamplingParams(max_new_tokens=4))
    assert adder.add_one_req(r) is AddReqResult.CONTINUE
    # cached_tokens (reported) is taken from tree_prefix_len when the batch forms
    assert (r.cached_len, r.extend_input_len, r.tree_prefix_len) == (20, 3, 20)
    assert cache.tree_cache.evictable_size() == 0, "the matched prefix is locked"


def test_prompt_logprobs_keep_their_positions_out_of_the_prefix_match():
    cache = make_cache()
    prefix = list(range(1, 21))
    cache.tree_cache.insert(prefix, cache.allocator.alloc(20))
    r = Req("a", prefix + [30], SamplingParams(max_new_tokens=1), return_logprob=True, logprob_start_len=5)
    PrefillAdder(limits(), NewTokenRatio(value=0.0), cache, []).add_one_req(r)
    assert r.cached_len == 5


def test_caller_given_embeddings_never_match_the_prefix_cache():
    cache = make_cache()
    prefix = list(range(1, 21))
    cache.tree_cache.insert(prefix, cache.allocator.alloc(20))
    r = Req("a", prefix + [30], SamplingParams(max_new_tokens=1), input_embeds_positions=[0])
    PrefillAdder(limits(), NewTokenRatio(value=0.0), cache, []).add_one_req(r)
    assert r.cached_len == 0


# ---------------------------------------------------------------- PrefillManager


def test_chunked_prefill_continues_first_and_admits_the_queue_after_the_last_chunk():
    cache = make_cache()
    prefill, _ = managers(cache, limits(chunked_prefill_size=16), NewTokenRatio(value=0.0))
    long, short = req("long", 40), req("short", 3)
    prefill.add(long)
    prefill.add(short)
    chunks = []
    for _ in range(3):
        batch = prefill.schedule([])
        chunks.append(list(zip([r.rid for r in batch.reqs], batch.extend_lens)))
    assert chunks == [[("long", 16)], [("long", 16)], [("long", 8), ("short", 3)]]
    assert prefill.chunked_req is None and not prefill.waiting_queue


def test_a_pending_update_admits_what_it_allows_and_stops_at_the_first_it_refuses():
    cache = make_cache()
    prefill, _ = managers(cache, limits(), NewTokenRatio(value=0.0))
    retracted = req("old", 4)
    retracted.append_output(9)
    prefill.add(req("new", 4))
    prefill.requeue(retracted)
    batch = prefill.schedule([], admits=lambda r: bool(r.output_ids))
    assert [r.rid for r in batch.reqs] == ["old"]
    assert [r.rid for r in prefill.waiting_queue] == ["new"]


def test_a_batch_that_cannot_get_its_slots_leaves_queue_and_cache_as_they_were():
    # 10 free slots + a 10-token cached prefix: the request fits the budget (20 available),
    # but locking its prefix leaves 10 slots for its 15 new tokens.
    cache = make_cache(kv_slots=20)
    prefix = list(range(1, 11))
    cache.tree_cache.insert(prefix, cache.allocator.alloc(10))
    prefill, _ = managers(cache, limits(), NewTokenRatio(value=0.0))
    r = Req("a", prefix + list(range(11, 26)), SamplingParams(max_new_tokens=1))
    prefill.add(r)
    assert prefill.schedule([]) is None
    assert list(prefill.waiting_queue) == [r]
    assert cache.tree_cache.evictable_size() == 10, "the prefix lock was released"
    assert r.last_node is None and r.req_pool_idx is None


def test_abort_finishes_waiting_and_chunked_requests_and_frees_their_kv():
    cache = make_cache()
    prefill, _ = managers(cache, limits(chunked_prefill_size=8), NewTokenRatio(value=0.0))
    prefill.add(req("long", 20))
    prefill.add(req("queued", 3))
    prefill.schedule([])
    assert prefill.chunked_req is not None and cache.used_tokens() == 8
    hit = prefill.abort(None, FinishReason("abort", message="test"))
    assert sorted(r.rid for r in hit) == ["long", "queued"]
    assert all(r.finished_reason.type == "abort" for r in hit)
    assert not prefill.has_work() and cache.used_tokens() == 0


# ---------------------------------------------------------------- DecodeManager


def test_retraction_victim_is_the_most_recently_admitted_request():
    reqs = [req("a", 2), req("b", 2), req("c", 2)]
    assert choose_retraction_victim(reqs) == 2
    with pytest.raises(ValueError, match="no request"):
        choose_retraction_victim([])


def test_decode_retracts_the_newest_requests_until_one_slot_each_fits():
    cache = make_cache(kv_slots=31)
    ratio = NewTokenRatio(value=0.0, minimum=0.0)
    prefill, decode = managers(cache, limits(), ratio)
    for i in range(3):
        prefill.add(req(f"r{i}", 10))
    finish_extend(prefill.schedule([]), decode)
    assert cache.allocator.available_size() == 1
    step = decode.schedule()
    assert [r.rid for r in step.retracted] == ["r2"]
    assert [r.rid for r in step.batch.reqs] == ["r0", "r1"]
    assert step.retracted[0].output_ids == [5], "a retracted request keeps its output tokens"
    assert decode.num_retractions == 1
    assert ratio.value == pytest.approx(0.1), "the reserve estimate rises after a retraction"


def test_a_lone_request_that_cannot_grow_finishes_with_length():
    cache = make_cache(kv_slots=10)
    prefill, decode = managers(cache, limits(max_req_len=64), NewTokenRatio(value=0.0))
    prefill.add(req("only", 10))
    finish_extend(prefill.schedule([]), decode)
    step = decode.schedule()
    assert step.batch is None and [r.rid for r in step.finished] == ["only"]
    assert step.finished[0].finished_reason == FinishReason("length", 64)
    assert cache.used_tokens() == 0


def test_decode_abort_drops_the_request_and_frees_its_kv():
    cache = make_cache()
    prefill, decode = managers(cache, limits(), NewTokenRatio(value=0.0))
    prefill.add(req("a", 4))
    prefill.add(req("b", 4))
    finish_extend(prefill.schedule([]), decode)
    used = cache.used_tokens()
    hit = decode.abort("a", FinishReason("abort"))
    assert [r.rid for r in hit] == ["a"]
    assert [r.rid for r in decode.running_reqs] == ["b"]
    assert cache.used_tokens() < used


def test_mixing_hands_the_running_batch_over_only_when_slots_fit():
    cache = make_cache(kv_slots=10)
    prefill, decode = managers(cache, limits(), NewTokenRatio(value=0.0))
    prefill.add(req("a", 10))
    finish_extend(prefill.schedule([]), decode)
    assert decode.take_for_mix() is None and decode.is_running()
    cache2 = make_cache(kv_slots=20)
    prefill2, decode2 = managers(cache2, limits(), NewTokenRatio(value=0.0))
    prefill2.add(req("a", 10))
    finish_extend(prefill2.schedule([]), decode2)
    batch = decode2.take_for_mix()
    assert batch is not None and [r.rid for r in batch.reqs] == ["a"] and not decode2.is_running()


def test_decode_settles_the_step_in_flight_before_retracting():
    cache = make_cache(kv_slots=31)
    prefill, decode = managers(cache, limits(), NewTokenRatio(value=0.0))
    for i in range(3):
        prefill.add(req(f"r{i}", 10))
    finish_extend(prefill.schedule([]), decode)
    settled = []

    def settle() -> bool:  # the step in flight finishes r2 (overlap scheduling)
        if settled:
            return False
        settled.append(decode.abort("r2", FinishReason("stop", 2)))
        return True

    step = decode.schedule(settle=settle)
    assert step.retracted == [], "settling freed the slots: nothing is retracted"
    assert [r.rid for r in step.batch.reqs] == ["r0", "r1"]
