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


def _run(dtype, q_heads, kv_heads, head_dim, fused: bool, cache_dtype=None, scale=1.0, spread=1.0):
    g = torch.Generator().manual_seed(0)
    tokens = 5
    rope = RotaryEmbedding(head_dim, ROPE, 64, 64).to(DEVICE)
    pool = TokenToKVPool(16, 1, kv_heads, head_dim, cache_dtype or dtype, DEVICE)
    q = (torch.randn(tokens, q_heads, head_dim, generator=g) * spread).to(DEVICE, dtype)
    k = (torch.randn(tokens, kv_heads, head_dim, generator=g) * spread).to(DEVICE, dtype)
    v = (torch.randn(tokens, kv_heads, head_dim, generator=g) * spread).to(DEVICE, dtype)
    positions = torch.tensor([0, 3, 7, 8, 40], device=DEVICE)
    loc = torch.tensor([2, 9, 4, 15, 11], device=DEVICE)
    if fused:
        k_cache, v_cache = pool.get_kv_buffer(0)
        q, k = rope_and_store_kv(positions, q, k, v, rope.cos_cached, rope.sin_cached, k_cache, v_cache, loc,
                                 k_scale=scale, v_scale=scale)
    else:
        q, k = rope(positions, q, k)
        pool.set_kv_buffer(0, loc, k, v, k_scale=scale, v_scale=scale)
    k_cache, v_cache = pool.get_kv_buffer(0)
    return {"q": q, "k": k, "k_cache": k_cache, "v_cache": v_cache}


def _tolerance(dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("output", ["q", "k", "k_cache", "v_cache"])
def test_fused_rope_and_kv_store_equals_the_unfused_path(case, output):
    fused, eager = _run(*case, fused=True)[output], _run(*case, fused=False)[output]
    torch.testing.assert_close(fused.float(), eager.float(), **_tolerance(case[0]))


def _interpreter_exact(stored: torch.Tensor) -> torch.Tensor:
    """Elements whose one-byte value Triton's interpreter converts right: its float downcast
    (``triton/runtime/interpreter.py`` ``_convert_float``) drops the carry when rounding up
    crosses into the next power of two, so an exact power of two in the reference may read half
    of it there. A GPU converts every element right, so nothing is skipped on CUDA."""
    values = stored.float().abs()
    if DEVICE == "cuda":
        return torch.ones_like(values, dtype=torch.bool)
    return (values == 0) | (torch.frexp(values).mantissa != 0.5)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scale", [1.0, 0.05])
@pytest.mark.parametrize("output", ["k_cache", "v_cache"])
def test_fused_store_into_an_fp8_cache_equals_set_kv_buffer(cache_dtype, scale, output):
    # spread 30 and scale 0.05 push values past e4m3's 448, so the clamp is exercised too
    args = (torch.float32, 4, 2, 16)
    fused = _run(*args, fused=True, cache_dtype=cache_dtype, scale=scale, spread=30.0)[output]
    eager = _run(*args, fused=False, cache_dtype=cache_dtype, scale=scale, spread=30.0)[output]
    exact = _interpreter_exact(eager)
    assert exact.float().mean() > 0.9, "the comparison must cover most elements"
    torch.testing.assert_close(fused.float()[exact], eager.float()[exact], atol=0, rtol=0)


def test_an_odd_head_dim_is_refused_naming_it():
    x = torch.zeros(1, 1, 3, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope_and_store_kv(torch.zeros(1, dtype=torch.int64), x, x, x, x, x, x, x, torch.zeros(1, dtype=torch.int64))


def test_strided_views_of_a_fused_qkv_are_rotated_and_stored_like_contiguous_ones():
    # the attention layer hands over views of one (T, (Hq + 2 Hkv) * D) projection; the outputs
    # must not inherit the inputs' token stride
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(16, ROPE, 64, 64).to(DEVICE)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=g).to(DEVICE)
    q, k, v = (t.reshape(5, -1, 16) for t in qkv.split([64, 32, 32], dim=-1))
    positions = torch.tensor([0, 3, 7, 8, 40], device=DEVICE)
    loc = torch.tensor([2, 9, 4, 15, 11], device=DEVICE)
    pool = TokenToKVPool(16, 1, 2, 16, torch.float32, DEVICE)
    k_cache, v_cache = pool.get_kv_buffer(0)
    q_rot, k_rot = rope_and_store_kv(positions, q, k, v, rope.cos_cached, rope.sin_cached, k_cache, v_cache, loc)
    q_ref, k_ref = rope(positions, q.contiguous(), k.contiguous())
    torch.testing.assert_close(torch.cat([q_rot.flatten(1), k_rot.flatten(1), k_cache[loc].flatten(1)], 1),
                               torch.cat([q_ref.flatten(1), k_ref.flatten(1), k_ref.flatten(1)], 1))
