"""CPU decode steps' index tensors from HostDecodeInputs equal ForwardBatch.init_new's, and a
step's tensors stay unchanged for the next RING - 1 steps."""

import pytest
import torch

from shardline_runtime.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from shardline_runtime.model_executor.host_decode_inputs import RING, HostDecodeInputs


class _Runner:
    req_to_token_pool = token_to_kv_pool = attn_backend = None


@pytest.mark.parametrize("rows,lens", [([3], [17]), ([0, 5, 2], [4, 9, 30])])
def test_host_decode_equals_init_new(rows, lens):
    ids, slots = torch.arange(len(rows)), torch.arange(10, 10 + len(rows))
    ref = ForwardBatch.init_new(
        forward_mode=ForwardMode.DECODE,
        input_ids=ids,
        req_pool_indices=rows,
        seq_lens=lens,
        out_cache_loc=slots,
    )
    got = ForwardBatch.host_decode(HostDecodeInputs(capacity=2), _Runner(), ids, rows, lens, slots)
    for name in ("req_pool_indices", "seq_lens", "positions", "input_ids", "out_cache_loc"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert got.seq_lens_cpu == ref.seq_lens_cpu and got.batch_size == ref.batch_size


def test_ring_keeps_earlier_steps_and_rejects_bad_lengths():
    inputs = HostDecodeInputs(capacity=1)
    first = inputs.rows([1], [5])
    for step in range(RING - 1):
        inputs.rows([2], [6 + step])
    assert first[1].tolist() == [5] and first[2].tolist() == [4]
    with pytest.raises(ValueError, match="seq_lens"):
        inputs.rows([1, 2], [3])
