"""Memory pools: request rows, per-layer K/V buffers, the slot allocator and the dummy slot."""

import pytest
import torch

from shardline_runtime.mem_cache.memory_pool import (
    DUMMY_SLOT,
    ReqToTokenPool,
    TokenToKVPool,
    TokenToKVPoolAllocator,
)
from shardline_runtime.model_executor.forward_batch_info import ForwardBatch, ForwardMode


def test_allocator_never_hands_out_dummy_slot_and_returns_none_when_full():
    alloc = TokenToKVPoolAllocator(8)
    got = alloc.alloc(8)
    assert got is not None and sorted(got.tolist()) == list(range(1, 9))
    assert DUMMY_SLOT not in got.tolist()
    assert alloc.alloc(1) is None
    assert alloc.available_size() == 0
    alloc.free(got[:3])
    assert alloc.available_size() == 3
    assert alloc.alloc(4) is None and alloc.available_size() == 3
    with pytest.raises(ValueError, match=r"\[1, 8\]"):
        alloc.free(torch.tensor([0]))
    with pytest.raises(ValueError, match="double free"):
        alloc.free(got[:1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(torch.tensor([int(got[5]), int(got[5])]))
    assert alloc.available_size() == 3


def test_req_to_token_pool_rows():
    pool = ReqToTokenPool(2, 16)
    rows = pool.alloc(2)
    assert sorted(rows) == [0, 1] and pool.alloc(1) is None
    pool.write((rows[0], slice(0, 3)), torch.tensor([5, 6, 7]))
    assert pool.req_to_token[rows[0], :3].tolist() == [5, 6, 7]
    pool.free(rows[0])
    with pytest.raises(ValueError, match="already free"):
        pool.free(rows[0])
    assert pool.available_size() == 1


def test_token_to_kv_pool_set_and_size():
    pool = TokenToKVPool(10, num_layers=2, num_kv_heads_per_rank=2, head_dim=4, dtype=torch.float32)
    assert pool.get_key_buffer(0).shape == (11, 2, 4)
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    loc = torch.tensor([1, 5, 9])
    pool.set_kv_buffer(1, loc, k, v)
    assert torch.equal(pool.get_key_buffer(1)[loc], k) and torch.equal(pool.get_value_buffer(1)[loc], v)
    assert pool.get_key_buffer(0).abs().sum() == 0
    assert TokenToKVPool.bytes_per_token(2, 2, 4, torch.float32) == 2 * 2 * 2 * 4 * 4
    assert pool.mem_usage_bytes() == 11 * TokenToKVPool.bytes_per_token(2, 2, 4, torch.float32)


def test_forward_batch_init_new_derives_extend_fields():
    fb = ForwardBatch.init_new(
        forward_mode=ForwardMode.EXTEND, input_ids=[1, 2, 3, 4, 5], req_pool_indices=[0, 1],
        seq_lens=[3, 4], extend_prefix_lens=[0, 2], out_cache_loc=[1, 2, 3, 4, 5],
    )
    assert fb.batch_size == 2
    assert fb.extend_seq_lens_cpu == [3, 2] and fb.extend_prefix_lens_cpu == [0, 2]
    assert fb.positions.tolist() == [0, 1, 2, 2, 3]
    dec = ForwardBatch.init_new(
        forward_mode=ForwardMode.DECODE, input_ids=[7, 8], req_pool_indices=[0, 1],
        seq_lens=[4, 5], out_cache_loc=[6, 7],
    )
    assert dec.positions.tolist() == [3, 4]
    with pytest.raises(ValueError, match="input_ids has 4 tokens"):
        ForwardBatch.init_new(
            forward_mode=ForwardMode.EXTEND, input_ids=[1, 2, 3, 4], req_pool_indices=[0],
            seq_lens=[3], out_cache_loc=[1, 2, 3, 4],
        )


def test_allocator_hands_out_host_slots_whatever_the_model_device():
    alloc = TokenToKVPoolAllocator(8, device="meta")
    assert alloc.alloc(3).device.type == "cpu"


def test_allocator_refuses_to_free_slots_that_are_not_on_the_host():
    alloc = TokenToKVPoolAllocator(8)
    with pytest.raises(ValueError, match="host tensors"):
        alloc.free(torch.ones(2, dtype=torch.int64, device="meta"))


def test_req_to_token_write_reaches_the_host_copy_and_the_device_table():
    pool = ReqToTokenPool(2, 6, host_copy=True)
    pool.write((1, slice(0, 3)), torch.tensor([4, 5, 6]))
    assert pool.req_to_token[1, :3].tolist() == pool.req_to_token_host[1, :3].tolist()


def test_req_to_token_slots_are_read_from_the_host_copy():
    pool = ReqToTokenPool(2, 6, host_copy=True)
    pool.write((torch.tensor([0, 0]), torch.tensor([1, 2])), torch.tensor([7, 8]))
    pool.req_to_token.zero_()  # the device table is not what slots() reads
    assert pool.slots(0, 1, 3).tolist() == [7, 8]
