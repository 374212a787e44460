"""The Triton ``silu_and_mul`` equals the eager ``SiluAndMul`` path.

Runs on CUDA, or on the CPU under Triton's interpreter (``test_triton_interpreter.py`` starts this
file in a subprocess with ``TRITON_INTERPRET=1``); skipped otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from shardline_runtime.layers.triton_silu_and_mul import silu_and_mul  # noqa: E402

# bfloat16 only on CUDA: the interpreter computes through NumPy, which has no bfloat16
CASES = [(torch.float32, 3, 64), (torch.float32, 2, 1500)]
if DEVICE == "cuda":
    CASES.append((torch.bfloat16, 4, 256))


def _eager(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@pytest.mark.parametrize("dtype,tokens,d", CASES)
def test_silu_and_mul_equals_the_eager_activation(dtype, tokens, d):
    x = torch.randn(tokens, 2 * d, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(silu_and_mul(x), _eager(x), **tolerance)


def test_silu_and_mul_of_no_tokens_is_empty():
    x = torch.zeros(0, 128, device=DEVICE)
    assert silu_and_mul(x).shape == (0, 64)
