"""The Triton RMSNorm / fused residual add + RMSNorm equals the eager ``RMSNorm`` path.

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

from shardline_runtime.layers.layernorm import RMSNorm  # noqa: E402
from shardline_runtime.layers.triton_rms_norm import rms_norm  # noqa: E402

# bfloat16 only on CUDA: the interpreter computes through NumPy, which has no bfloat16
CASES = [(torch.float32, 64, 1e-6), (torch.float32, 96, 1e-5)]
if DEVICE == "cuda":
    CASES.append((torch.bfloat16, 64, 1e-6))


def _norm(dtype, hidden, eps) -> RMSNorm:
    norm = RMSNorm(hidden, eps).to(DEVICE, dtype)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    return norm


def _inputs(dtype, hidden):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(5, hidden, generator=g).to(DEVICE, dtype), torch.randn(5, hidden, generator=g).to(DEVICE, dtype))


def _tolerance(dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype,hidden,eps", CASES)
def test_triton_rms_norm_equals_the_eager_norm(dtype, hidden, eps):
    norm = _norm(dtype, hidden, eps)
    x, _ = _inputs(dtype, hidden)
    got, _ = rms_norm(x, norm.weight, eps)
    torch.testing.assert_close(got, norm._norm(x), **_tolerance(dtype))


@pytest.mark.parametrize("dtype,hidden,eps", CASES)
def test_fused_add_rms_norm_equals_the_eager_normed_sum(dtype, hidden, eps):
    norm = _norm(dtype, hidden, eps)
    x, residual = _inputs(dtype, hidden)
    got, _ = rms_norm(x, norm.weight, eps, residual)
    torch.testing.assert_close(got, norm._norm(residual + x), **_tolerance(dtype))


@pytest.mark.parametrize("dtype,hidden,eps", CASES)
def test_fused_add_rms_norm_returns_the_exact_sum(dtype, hidden, eps):
    norm = _norm(dtype, hidden, eps)
    x, residual = _inputs(dtype, hidden)
    _, summed = rms_norm(x, norm.weight, eps, residual)
    assert torch.equal(summed, residual + x)


def test_fused_add_rms_norm_leaves_its_inputs_unchanged():
    norm = _norm(torch.float32, 64, 1e-6)
    x, residual = _inputs(torch.float32, 64)
    before = residual.clone()
    rms_norm(x, norm.weight, 1e-6, residual)
    assert torch.equal(residual, before)
