"""The attention layer's fused rotary + KV-store path (``RadixAttention`` calling
``layers/triton_rope_kv.py``) gives the same logits and the same KV pool as the unfused path
(``RotaryEmbedding`` then the backend's ``set_kv_buffer``), over an EXTEND step with a cached
prefix and DECODE steps of a tiny Llama.

Runs on CUDA, or on the CPU under Triton's interpreter (``test_triton_interpreter.py`` starts this
file in a subprocess with ``TRITON_INTERPRET=1``); skipped otherwise. An fp8 cache is checked at
the kernel level (``test_triton_rope_kv.py``): the interpreter's fp8 rounding differs from the
GPU's in a documented corner, which compounds over a model's layers.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

import harness  # noqa: E402
from shardline_runtime.layers.radix_attention import RadixAttention  # noqa: E402

PROMPT = [5, 17, 200, 33, 9, 41, 77, 300, 12, 8, 101]


def _refuse_unfused_store(pool) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the fused path must store K/V itself, not through set_kv_buffer")

    pool.set_kv_buffer = refuse


def _run(path, fused: bool) -> dict[str, torch.Tensor]:
    runner = harness.make_runner(path, device=DEVICE)
    layers = [m for m in runner.model.modules() if isinstance(m, RadixAttention)]
    for layer in layers:
        layer.fuse_rope_kv = fused
    if fused:
        _refuse_unfused_store(runner.token_to_kv_pool)
    seqs = harness.new_seqs(runner, 2)
    out = {"extend_prefix": harness.extend(runner, seqs, [PROMPT[:3], PROMPT[:2]]).next_token_logits}
    out["extend"] = harness.extend(runner, seqs, [PROMPT[3:], PROMPT[2:6]]).next_token_logits
    out["decode_1"] = harness.decode(runner, seqs, [3, 4]).next_token_logits
    out["decode_2"] = harness.decode(runner, seqs, [7, 300]).next_token_logits
    pool = runner.token_to_kv_pool
    out["k_pool"] = torch.stack([b.float() for b in pool.k_buffer_head_major])
    out["v_pool"] = torch.stack([b.float() for b in pool.v_buffer_head_major])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("ckpt-llama-rope-kv")
    make_tiny_checkpoint(path, arch="llama", num_key_value_heads=2)
    return {"fused": _run(path, fused=True), "unfused": _run(path, fused=False)}


@pytest.mark.parametrize("output", ["extend_prefix", "extend", "decode_1", "decode_2", "k_pool", "v_pool"])
def test_fused_rope_kv_layer_equals_the_unfused_path(results, output):
    torch.testing.assert_close(results["fused"][output], results["unfused"][output], atol=1e-5, rtol=1e-5)


def test_the_kv_pool_holds_written_slots(results):
    assert results["fused"]["k_pool"].abs().sum() > 0, "a pool of zeros would make the comparison vacuous"
