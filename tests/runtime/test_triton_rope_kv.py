"""The fused rotary + KV-store Triton kernel equals the unfused path (``RotaryEmbedding`` then
``TokenToKVPool.set_kv_buffer``), small shapes.

Runs on CUDA, or on the CPU under Triton's interpreter (``test_triton_interpreter.py`` starts this
file in a subprocess with ``TRITON_INTERPRET=1``); skipped otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from shardline_runtime.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from shardline_runtime.layers.triton_rope_kv import rope_and_store_kv  # noqa: E402
from shardline_runtime.mem_cache.memory_pool import TokenToKVPool  # noqa: E402

ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# (q heads, kv heads, head_dim); bfloat16 only on CUDA (the interpreter has no bfloat16)
CASES = [(torch.float32, 4, 2, 16), (torch.float32, 2, 2, 12)]
if DEVICE == "cuda":
    CASES.append((torch.bfloat16, 8, 2, 64))


def _run(dtype, q_heads, kv_heads, head_dim, fused: bool):
    g = torch.Generator().manual_seed(0)
    tokens = 5
    rope = RotaryEmbedding(head_dim, ROPE, 64, 64).to(DEVICE)
    pool = TokenToKVPool(16, 1, kv_heads, head_dim, dtype, DEVICE)
    q = torch.randn(tokens, q_heads, head_dim, generator=g).to(DEVICE, dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    positions = torch.tensor([0, 3, 7, 8, 40], device=DEVICE)
    loc = torch.tensor([2, 9, 4, 15, 11], device=DEVICE)
    if fused:
        k_cache, v_cache = pool.get_kv_buffer(0)
        q, k = rope_and_store_kv(positions, q, k, v, rope.cos_cached, rope.sin_cached, k_cache, v_cache, loc)
    else:
        q, k = rope(positions, q, k)
        pool.set_kv_buffer(0, loc, k, v)
    k_cache, v_cache = pool.get_kv_buffer(0)
    return {"q": q, "k": k, "k_cache": k_cache, "v_cache": v_cache}


def _tolerance(dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("output", ["q", "k", "k_cache", "v_cache"])
def test_fused_rope_and_kv_store_equals_the_unfused_path(case, output):
    fused, eager = _run(*case, fused=True)[output], _run(*case, fused=False)[output]
    torch.testing.assert_close(fused.float(), eager.float(), **_tolerance(case[0]))


def test_an_odd_head_dim_is_refused_naming_it():
    x = torch.zeros(1, 1, 3, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope_and_store_kv(torch.zeros(1, dtype=torch.int64), x, x, x, x, x, x, x, torch.zeros(1, dtype=torch.int64))
