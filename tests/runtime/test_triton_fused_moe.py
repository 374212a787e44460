"""The Triton fused-MoE kernel equals the grouped PyTorch computation (small shapes: the CPU
interpreter is slow). Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1`` in its own process
(``test_triton_fused_moe_interpreter.py`` starts it), never in the main test process."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA, or TRITON_INTERPRET=1 (run through test_triton_fused_moe_interpreter.py)",
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def make(tokens, experts, top_k, hidden, inter, seed=0, drop=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    if drop:  # pairs of experts another rank holds
        ids = torch.where(ids >= experts // 2, -1, ids)
    weights = torch.rand(tokens, top_k, generator=g)
    return [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, drop", [
    (5, 4, 2, 32, 16, False),    # fewer pairs than one block
    (19, 4, 2, 48, 40, False),   # K and N not multiples of the block sizes
    (9, 6, 3, 32, 32, True),     # expert-parallel: a third of the slots are another rank's
])
def test_kernel_equals_grouped_computation(tokens, experts, top_k, hidden, inter, drop):
    from shardline_runtime.layers.moe.moe_compute import grouped_experts_forward
    from shardline_runtime.layers.moe.triton_fused_moe import fused_experts

    x, w13, w2, weights, ids = make(tokens, experts, top_k, hidden, inter, drop=drop)
    got = fused_experts(x, w13, w2, weights, ids)
    expect = grouped_experts_forward(x, w13, w2, weights, ids)
    assert got.shape == expect.shape
    assert torch.allclose(got, expect, rtol=1e-4, atol=1e-4), (got - expect).abs().max()


def test_block_alignment_pads_each_expert_run():
    from shardline_runtime.layers.moe.triton_fused_moe import align_pairs_to_blocks

    ids = torch.tensor([[1, 0], [1, -1], [0, 1]])
    sorted_ids, experts = align_pairs_to_blocks(ids, 3, block_m=4)
    assert experts.tolist() == [0, 1, -1, -1, -1]  # fixed size: ceil(6 / 4) + 3 blocks
    # pairs of expert 0, padding (6 = T*k), pairs of expert 1, then unused blocks
    assert sorted_ids.tolist() == [1, 4, 6, 6, 0, 2, 5, 6] + [6] * 12
