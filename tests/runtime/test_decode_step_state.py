"""Host state a decode step carries over or writes cheaply: the future map's deferred store,
``ReqToTokenPool.write_tokens`` and the compact pickling of the per-step messages."""

from __future__ import annotations

import pickle

import pytest
import torch

from shardline_runtime.managers.io_struct import (
    BatchTokenOut,
    FinishReason,
    TokenLogprob,
    TokenOut,
    Usage,
)
from shardline_runtime.managers.overlap import FutureMap, future_placeholder
from shardline_runtime.mem_cache.memory_pool import ReqToTokenPool


def _placeholders(rows: list[int]) -> torch.Tensor:
    return torch.tensor([future_placeholder(r) for r in rows], dtype=torch.int64)


def _stored(future_map: FutureMap, rows: list[int], ids: list[int]) -> None:
    future_map.store(torch.tensor(rows), torch.tensor(ids), every_row=True, rows=rows)


def test_same_rows_take_the_previous_steps_ids():
    future_map = FutureMap(8, torch.device("cpu"))
    _stored(future_map, [3, 5], [11, 12])
    assert future_map.resolve(_placeholders([3, 5]), [3, 5]).tolist() == [11, 12]


def test_rows_in_another_order_resolve_per_row():
    future_map = FutureMap(8, torch.device("cpu"))
    _stored(future_map, [3, 5], [11, 12])
    assert future_map.resolve(_placeholders([5, 3]), [5, 3]).tolist() == [12, 11]


def test_a_deferred_store_is_written_before_a_mixed_resolve():
    future_map = FutureMap(8, torch.device("cpu"))
    _stored(future_map, [3, 5], [11, 12])
    ids = torch.tensor([future_placeholder(5), 40], dtype=torch.int64)
    assert future_map.resolve(ids).tolist() == [12, 40]


def test_a_later_store_of_other_rows_keeps_the_deferred_tokens():
    future_map = FutureMap(8, torch.device("cpu"))
    _stored(future_map, [3, 5], [11, 12])
    _stored(future_map, [5], [13])
    assert future_map.resolve(_placeholders([3, 5]), [3, 5]).tolist() == [11, 13]


def test_write_tokens_writes_one_entry_per_row_at_batch_one():
    pool = ReqToTokenPool(4, 16)
    pool.write_tokens([2], [7], torch.tensor([9]))
    assert pool.req_to_token[2, 7].item() == 9


def test_write_tokens_writes_every_row_of_a_batch():
    pool = ReqToTokenPool(4, 16)
    pool.write_tokens([0, 3], [1, 5], torch.tensor([4, 6]))
    assert pool.req_to_token[[0, 3], [1, 5]].tolist() == [4, 6]


def test_write_tokens_updates_a_separate_device_table():
    pool = ReqToTokenPool(4, 16, host_copy=True)
    pool.write_tokens([1, 2], [0, 3], torch.tensor([5, 8]))
    assert pool.req_to_token[[1, 2], [0, 3]].tolist() == [5, 8]


def test_write_tokens_follows_a_replaced_host_table():
    pool = ReqToTokenPool(4, 16, host_copy=True)
    pool.req_to_token_host = torch.zeros((4, 16), dtype=torch.int64)
    pool.write_tokens([1], [2], torch.tensor([7]))
    assert pool.req_to_token_host[1, 2].item() == 7


def test_a_step_message_survives_pickling_unchanged():
    out = BatchTokenOut(
        [
            TokenOut(
                rid="r0",
                ids=[5, 6],
                usage=Usage(12, 2, 4),
                logprobs=[TokenLogprob(-0.5, 5, [(-0.5, 5)]), TokenLogprob(-1.0, 6)],
                finish=FinishReason("stop", 6),
            )
        ]
    )
    assert pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)) == out


def test_a_step_of_plain_and_finishing_outputs_survives_pickling_unchanged():
    """The per-step wire form (plain outputs as tuples, others as objects) rebuilds the same
    message, in order, with the same field values and types."""
    plain = TokenOut(rid="a", ids=[1, 2], usage=Usage(3, 2, 1))
    done = TokenOut(rid="b", ids=[9], usage=Usage(4, 5, 0), finish=FinishReason("length", 5))
    embedded = TokenOut(rid="c", ids=[], usage=Usage(2, 0, 0), embedding=[0.5])
    out = BatchTokenOut([plain, done, embedded, TokenOut(rid="d", ids=[], usage=Usage(1, 0, 0))])
    back = pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == out
    assert [type(o) for o in back.outs] == [TokenOut] * 4
    assert type(back.outs[0].usage) is Usage and back.outs[0].logprobs == []
    assert b"TokenOut" not in pickle.dumps(BatchTokenOut([plain]))  # one global: the rebuild


def test_the_step_pickle_refuses_a_message_class_with_fields_it_would_not_rebuild():
    """``_rebuild_step`` sets ``TokenOut``'s and ``Usage``'s fields by hand: a class with a field
    added (or one dropped) is refused when registered, naming the field, never left unset."""
    from dataclasses import dataclass

    from shardline_runtime.managers.message_pickling import compact_step_pickle

    @dataclass(frozen=True, slots=True, kw_only=True)
    class UsageWithReasoning:
        prompt_tokens: int
        completion_tokens: int
        cached_tokens: int = 0
        reasoning_tokens: int = 0

    @dataclass
    class Batch:  # not registered: the check runs before anything is replaced
        outs: list

    with pytest.raises(TypeError, match=r"UsageWithReasoning .*missing \[\], extra \['reasoning_tokens'\]"):
        compact_step_pickle(Batch, TokenOut, UsageWithReasoning)
    with pytest.raises(TypeError, match=r"Usage .*missing \['outs'\], extra \['cached_tokens'"):
        compact_step_pickle(Usage, TokenOut, Usage)
    assert not hasattr(Batch, "__reduce__") or Batch.__reduce__ is object.__reduce__
    plain = BatchTokenOut([TokenOut(rid="a", ids=[1], usage=Usage(3, 1, 0))])
    assert pickle.loads(pickle.dumps(plain)) == plain  # the registered classes still pickle
