"""The quantized-GEMM Triton kernels equal their dequantize-then-matmul references.

Runs on a GPU, or on CPU under ``TRITON_INTERPRET=1`` (``test_quant_kernels_interpreter.py``
starts it in a subprocess); cases stay small for the interpreter."""

from __future__ import annotations

import os

import pytest
import torch

from shardline_runtime.layers.quantization.fp8_numerics import (
    dequantize_blocks,
    per_group_scale,
    quantize_fp8,
)
from shardline_runtime.layers.quantization.w4a16_linear import dequantize_w4

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not (INTERPRETED or torch.cuda.is_available()):
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


@pytest.mark.parametrize("m", [1, 5, 20])
def test_fp8_block_kernel_equals_dequantized_reference(m):
    from shardline_runtime.layers.quantization.fp8_block_kernel import fp8_block_matmul

    torch.manual_seed(m)
    block = (32, 32)
    n, k = 96, 64
    x = torch.randn(m, k, device=DEVICE)
    w = torch.randn(n, k, device=DEVICE)
    w_scale = torch.rand(n // 32, k // 32, device=DEVICE) * 0.01 + 0.001
    w_q = quantize_fp8(w, w_scale.repeat_interleave(32, 0).repeat_interleave(32, 1))
    x_scale = per_group_scale(x, 32)
    x_q = quantize_fp8(x, x_scale.repeat_interleave(32, dim=1))
    out = fp8_block_matmul(x_q, x_scale, w_q, w_scale, block, torch.float32)
    x_dq = x_q.float() * x_scale.repeat_interleave(32, dim=1)
    expect = x_dq @ dequantize_blocks(w_q, w_scale, block, torch.float32).t()
    assert (out - expect).abs().max().item() <= 1e-3 * expect.abs().max().item()


@pytest.mark.parametrize("m", [1, 7, 33])
def test_w4a16_kernel_equals_dequantized_reference(m):
    from shardline_runtime.layers.quantization.w4a16_kernel import w4a16_matmul

    torch.manual_seed(m)
    n, k, group = 80, 64, 32
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=DEVICE)
    scale = torch.rand(n, k // group, device=DEVICE) * 0.1
    x = torch.randn(m, k, device=DEVICE)
    out = w4a16_matmul(x, packed, scale, group)
    expect = x @ dequantize_w4(packed, scale, group, torch.float32).t()
    assert (out - expect).abs().max().item() <= 1e-4 * expect.abs().max().item()


@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="torch._scaled_mm needs a GPU")
@pytest.mark.parametrize("m", [1, 16, 33])
def test_scaled_mm_fp8_linear_equals_the_dequantized_reference(m):
    from shardline_runtime.layers.quantization.fp8_linear import Fp8LinearMethod
    from shardline_runtime.layers.quantization.fp8_numerics import (
        fake_quantize_fp8,
        per_token_scale,
        quantize_weight_per_channel,
    )

    torch.manual_seed(m)
    layer = torch.nn.Module()
    weight, scale = quantize_weight_per_channel(torch.randn(256, 128, device="cuda"))
    layer.weight, layer.weight_scale = weight, scale
    x = torch.randn(m, 128, device="cuda", dtype=torch.bfloat16)
    out = Fp8LinearMethod(per_channel=True, activation="dynamic").apply(layer, x)
    x32 = x.float()
    expect = fake_quantize_fp8(x32, per_token_scale(x32)) @ (weight.float() * scale).t()
    assert (out.float() - expect).abs().max().item() <= 2e-2 * expect.abs().max().item()
