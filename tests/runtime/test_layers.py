"""Parallel layers' weight loaders take the right shard; RMSNorm and RoPE frequencies equal
transformers' own computation."""

import pytest
import torch

from shardline_runtime.layers.layernorm import RMSNorm
from shardline_runtime.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShardShapeError,
)
from shardline_runtime.layers.rotary_embedding import compute_inv_freq
from shardline_runtime.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding


def test_qkv_shards_and_replicates_kv_heads():
    hidden, d = 8, 2
    q = torch.arange(16 * d * hidden, dtype=torch.float32).view(16 * d, hidden)
    k = torch.arange(2 * d * hidden, dtype=torch.float32).view(2 * d, hidden) + 1000
    v = k + 1000
    for rank in range(4):
        layer = QKVParallelLinear(hidden, d, 16, 2, tp_rank=rank, tp_size=4)
        assert (layer.num_heads, layer.num_kv_heads) == (4, 1)
        for sid, t in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, t, sid)
        w = layer.weight
        assert torch.equal(w[: 4 * d], q[rank * 4 * d:(rank + 1) * 4 * d])
        kv_head = rank // 2  # 4 ranks share 2 KV heads: ranks 0,1 -> head 0; 2,3 -> head 1
        assert torch.equal(w[4 * d: 5 * d], k[kv_head * d:(kv_head + 1) * d])
        assert torch.equal(w[5 * d:], v[kv_head * d:(kv_head + 1) * d])


def test_merged_gate_up_and_row_parallel_shards():
    gate = torch.randn(8, 4)
    up = torch.randn(8, 4)
    layer = MergedColumnParallelLinear(4, [8, 8], tp_rank=1, tp_size=2)
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    assert torch.equal(layer.weight, torch.cat([gate[4:], up[4:]]))
    down = torch.randn(4, 8)
    row = RowParallelLinear(8, 4, bias=True, tp_rank=1, tp_size=2)
    row.weight.weight_loader(row.weight, down)
    bias = torch.randn(4)
    row.bias.weight_loader(row.bias, bias)
    assert torch.equal(row.weight, down[:, 4:]) and torch.equal(row.bias, bias)


def test_tp1_linears_equal_dense():
    x = torch.randn(3, 4)
    w, b = torch.randn(6, 4), torch.randn(6)
    col = ColumnParallelLinear(4, 6, bias=True, tp_rank=0, tp_size=1)
    col.weight.weight_loader(col.weight, w)
    col.bias.weight_loader(col.bias, b)
    assert torch.allclose(col(x), x @ w.T + b)


def test_wrong_shape_names_both_shapes():
    layer = ColumnParallelLinear(4, 6, tp_rank=0, tp_size=2)
    with pytest.raises(ShardShapeError, match=r"checkpoint shape \(6, 5\), expected \(6, 4\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(6, 5))


def test_vocab_parallel_embedding_pads_last_rank_with_zero_rows():
    table = torch.randn(5, 3)
    ranks = [VocabParallelEmbedding(5, 3, tp_rank=r, tp_size=2) for r in range(2)]
    for emb in ranks:
        emb.weight.weight_loader(emb.weight, table)
    assert [(e.vocab_start_index, e.vocab_end_index) for e in ranks] == [(0, 3), (3, 6)]
    assert torch.equal(ranks[1].weight[:2], table[3:]) and ranks[1].weight[2].abs().sum() == 0
    head = ParallelLMHead(5, 3, tp_rank=0, tp_size=1)
    with pytest.raises(RuntimeError, match="LogitsProcessor"):
        head(torch.tensor([1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [16, 256, 896, 4096])
def test_rmsnorm_matches_transformers(dtype, hidden):
    """Bit for bit, in every dtype: the CPU path's fused ``F.rms_norm`` is not allowed to round
    differently from transformers' five-op formula."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(hidden)
    x = (torch.randn(5, hidden) * 3).to(dtype)
    ours, ref = RMSNorm(hidden, 1e-5), LlamaRMSNorm(hidden, eps=1e-5)
    w = torch.randn(hidden).to(dtype)
    ours.weight.data = w.clone()
    ref.weight.data = w.clone()
    assert torch.equal(ours(x), ref(x))
    r = torch.randn(5, hidden).to(dtype)
    normed, residual = ours(x, r)
    assert torch.equal(residual, x + r) and torch.equal(normed, ref(x + r))


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.5,
     "beta_fast": 8, "beta_slow": 2, "truncate": False},
])
def test_inv_freq_equals_transformers(rope):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shardline_runtime.configs.model_config import parse_rope_parameters

    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
                                   rope_scaling=dict(rope))
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    ours_inv, ours_scale = compute_inv_freq(parse_rope_parameters(cfg.to_dict()), 16)
    assert torch.equal(ours_inv, ref_inv)
    assert ours_scale == pytest.approx(ref_scale, rel=0, abs=0)


@pytest.mark.parametrize("rows, out_features, bias", [(16, 4096, False), (3, 4100, True), (65, 4096, True), (16, 2304, False)])
def test_linear_in_pieces_equals_f_linear(rows, out_features, bias):
    import torch.nn.functional as F

    from shardline_runtime.layers.linear import linear

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, 48, generator=g), torch.randn(out_features, 48, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    ours, ref = linear(x, w, b), F.linear(x, w, b)
    assert ours.shape == ref.shape == (rows, out_features)
    assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_transformers_apply_rotary_pos_emb_and_follows_a_replaced_table(dtype):
    """The roll with the sign-folded sine table is transformers' ``rotate_half`` formula bit for
    bit; a ``sin_cached`` replaced after the first call (the module moved) is the one used."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from shardline_runtime.layers.rotary_embedding import RotaryEmbedding

    rope = RotaryEmbedding(32, {"rope_type": "default", "rope_theta": 10000.0}, 64, 64)
    torch.manual_seed(0)
    q, k = torch.randn(5, 4, 32).to(dtype), torch.randn(5, 2, 32).to(dtype)
    positions = torch.tensor([0, 3, 17, 40, 63])

    def reference():
        cos = rope.cos_cached[positions].to(dtype)  # (T, head_dim)
        sin = rope.sin_cached[positions].to(dtype)
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)

    for got, want in zip(rope(positions, q, k), reference()):
        assert torch.equal(got, want)
    rope.sin_cached = rope.sin_cached * 0.5  # what Module.to() does: a new tensor
    for got, want in zip(rope(positions, q, k), reference()):
        assert torch.equal(got, want)
