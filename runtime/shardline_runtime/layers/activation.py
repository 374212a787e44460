"""SwiGLU activation of gated MLPs (Shazeer 2020): ``silu(gate) * up``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """(T, 2 * d) ``[gate | up]`` -> (T, d) ``silu(gate) * up``.

    Attributes:
        use_triton: the Triton kernel; None (default): on CUDA (benchmarks pin it).
    """

    def __init__(self) -> None:
        super().__init__()
        self.use_triton: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one Triton kernel, the same roundings (layers/triton_silu_and_mul.py); the PyTorch ops
        # while torch.compile traces, so Inductor fuses them with their neighbours
        triton = x.is_cuda if self.use_triton is None else self.use_triton
        if triton and not torch.compiler.is_compiling():
            from shardline_runtime.layers.triton_silu_and_mul import silu_and_mul

            return silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
