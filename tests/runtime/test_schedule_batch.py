"""ScheduleBatch bookkeeping: rows, KV slots, req_to_token, ForwardBatch fields (no model)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardline_runtime.managers.schedule_batch import KVCacheFullError, Req, ScheduleBatch
from shardline_runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from shardline_runtime.model_executor.forward_batch_info import ForwardMode
from shardline_runtime.sampling import SamplingParams

VOCAB = 32


@pytest.fixture
def pools():
    return ReqToTokenPool(8, 64), TokenToKVPoolAllocator(100)


def batch_of(pools, reqs):
    return ScheduleBatch(reqs, pools[0], pools[1], VOCAB)


def req(rid, n, **params):
    return Req(rid, list(range(1, n + 1)), SamplingParams(**params))


def test_extend_then_decode_then_release(pools):
    rows, alloc = pools
    a, b = req("a", 3), req("b", 5)
    batch = batch_of(pools, [a, b])
    batch.prepare_for_extend()
    fb = batch.get_model_worker_batch().to_forward_batch()
    assert fb.forward_mode == ForwardMode.EXTEND
    assert fb.input_ids.tolist() == [1, 2, 3, 1, 2, 3, 4, 5]
    assert fb.seq_lens.tolist() == [3, 5] and fb.extend_seq_lens.tolist() == [3, 5]
    assert fb.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert alloc.available_size() == 92
    assert torch.equal(rows.req_to_token[a.req_pool_idx, :3], fb.out_cache_loc[:3])
    assert a.wants_token and b.wants_token

    a.append_output(7)
    b.append_output(9)
    batch.prepare_for_decode()
    fb = batch.get_model_worker_batch().to_forward_batch()
    assert fb.forward_mode == ForwardMode.DECODE
    assert fb.input_ids.tolist() == [7, 9] and fb.seq_lens.tolist() == [4, 6] and fb.positions.tolist() == [3, 5]
    assert rows.req_to_token[b.req_pool_idx, 5] == fb.out_cache_loc[1]

    for r in (a, b):
        batch.release_kv(r)
    assert alloc.available_size() == 100 and rows.available_size() == 8


def test_cached_prefix_is_reused_not_recomputed(pools):
    rows, alloc = pools
    prefix = alloc.alloc(4)  # as if a prefix cache held the first 4 tokens
    r = req("a", 6)
    r.init_next_round_input(prefix_indices=prefix)
    batch = batch_of(pools, [r])
    batch.prepare_for_extend()
    fb = batch.get_model_worker_batch().to_forward_batch()
    assert fb.input_ids.tolist() == [5, 6] and fb.extend_prefix_lens.tolist() == [4]
    assert fb.positions.tolist() == [4, 5]
    assert rows.req_to_token[r.req_pool_idx, :4].tolist() == prefix.tolist()
    batch.release_kv(r, keep_prefix_len=4)
    assert alloc.available_size() == 96  # the cache still owns its 4 slots


def test_full_prefix_match_still_computes_one_token(pools):
    _, alloc = pools
    r = req("a", 4)
    r.init_next_round_input(prefix_indices=alloc.alloc(4))
    assert r.cached_len == 3 and r.extend_input_len == 1


def test_chunked_prefill_samples_only_after_last_chunk(pools):
    r = req("a", 10)
    r.init_next_round_input(max_extend_len=4)
    batch = batch_of(pools, [r])
    batch.prepare_for_extend()
    assert batch.input_ids == [1, 2, 3, 4] and not r.wants_token
    r.init_next_round_input(max_extend_len=4)
    batch = batch_of(pools, [r])
    batch.prepare_for_extend()
    assert batch.input_ids == [5, 6, 7, 8] and batch.prefix_lens == [4] and not r.wants_token
    r.init_next_round_input(max_extend_len=4)
    batch = batch_of(pools, [r])
    batch.prepare_for_extend()
    assert batch.input_ids == [9, 10] and r.wants_token and r.kv_len == 10


def test_prefill_only_request_wants_no_token(pools):
    r = req("a", 3, max_new_tokens=0)
    batch = batch_of(pools, [r])
    batch.prepare_for_extend()
    assert not r.wants_token
    r.check_finished(max_req_len=100)
    assert r.finished_reason.type == "length"


def test_mix_with_running_and_filter(pools):
    running_reqs = [req("r0", 3, temperature=0.0), req("r1", 2, presence_penalty=1.0)]
    running = batch_of(pools, running_reqs)
    running.prepare_for_extend()
    for r in running_reqs:
        r.append_output(11)
    new = batch_of(pools, [req("n0", 4)])
    new.prepare_for_extend()
    new.mix_with_running(running)
    fb = new.get_model_worker_batch().to_forward_batch()
    assert fb.forward_mode == ForwardMode.EXTEND
    assert fb.input_ids.tolist() == [1, 2, 3, 4, 11, 11]
    assert fb.extend_prefix_lens.tolist() == [0, 3, 2] and fb.seq_lens.tolist() == [4, 4, 3]
    assert fb.positions.tolist() == [0, 1, 2, 3, 3, 2]
    assert new.sampling_info.batch_size == 3 and new.sampling_info.penalties.presence.tolist() == [0.0, 0.0, 1.0]

    running_reqs[0].append_output(2)
    running_reqs[0].eos_token_ids = {2}
    running_reqs[0].check_finished(max_req_len=100)
    assert running_reqs[0].finished_reason.type == "stop"
    new.release_kv(running_reqs[0])
    new.filter_batch()
    assert [r.rid for r in new.reqs] == ["n0", "r1"]
    assert new.sampling_info.penalties.presence.tolist() == [0.0, 1.0]


def test_pool_exhaustion_is_a_typed_error_and_allocates_nothing(pools):
    rows, alloc = pools
    batch = batch_of(pools, [req("a", 60), req("b", 60)])
    with pytest.raises(KVCacheFullError, match="need 120 KV slots, 100 free"):
        batch.prepare_for_extend()
    assert alloc.available_size() == 100 and rows.available_size() == 8


def test_finish_on_stop_token_and_length():
    r = req("a", 2, max_new_tokens=3, stop_token_ids=[5])
    r.append_output(4)
    r.check_finished(100)
    assert r.finished_reason is None
    r.append_output(5)
    r.check_finished(100)
    assert r.finished_reason.type == "stop" and r.finished_reason.matched == 5
    long = req("b", 5, max_new_tokens=None)
    long.append_output(1)
    long.check_finished(max_req_len=6)
    assert long.finished_reason.type == "length"


def test_empty_prompt_rejected():
    with pytest.raises(ValueError, match="origin_input_ids"):
        Req("x", [], SamplingParams())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "decode", "finish"]), st.integers(1, 12), st.booleans()), max_size=25))
def test_random_schedules_never_leak_or_share_kv_slots(ops):
    """Any sequence of prefill (mixed or merged), decode and finish keeps every KV slot owned by
    exactly one running request or free, and returns the pools to baseline at the end."""
    rows, alloc = ReqToTokenPool(6, 128), TokenToKVPoolAllocator(200)
    running, count = None, 0

    def check():
        used = []
        for r in (running.reqs if running else []):
            used += rows.req_to_token[r.req_pool_idx, : r.kv_len].tolist()
        assert len(used) == len(set(used)) and 0 not in used
        assert len(used) + alloc.available_size() == 200
        assert not set(used) & set(alloc.free_slots.tolist())

    for op, n, mixed in ops:
        if op == "new" and rows.available_size() > 0 and alloc.available_size() > n + 8:
            count += 1
            r = req(f"n{count}", n)
            batch = ScheduleBatch([r], rows, alloc, VOCAB)
            batch.prepare_for_extend()
            if running is not None and mixed and alloc.available_size() >= running.batch_size:
                batch.mix_with_running(running)
                running = None
            for x in batch.reqs:
                x.append_output(n % VOCAB)
            if running is None:
                running = batch
            else:
                running.merge_batch(batch)
        elif op == "decode" and running is not None and alloc.available_size() >= running.batch_size:
            running.prepare_for_decode()
            for x in running.reqs:
                x.append_output(1)
        elif op == "finish" and running is not None:
            victim = running.reqs[n % running.batch_size]
            running.release_kv(victim)
            running.filter_batch([i for i, x in enumerate(running.reqs) if x is not victim])
            if running.is_empty():
                running = None
        check()
    for r in (running.reqs if running else []):
        running.release_kv(r)
    assert alloc.available_size() == 200 and rows.available_size() == 6
