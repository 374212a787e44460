"""RMSNorm (Zhang & Sennrich 2019) computed as transformers' ``LlamaRMSNorm``: in float32, then
cast back before the weight multiply, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from shardline_runtime.layers.parameter import set_weight_attrs


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dim (size ``hidden_size``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        set_weight_attrs(self.weight, self.weight_loader, {None: (hidden_size,)})
        self.variance_epsilon = eps
        self.use_triton: bool | None = None  # the Triton kernel; None: on CUDA (benchmarks pin it)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        from shardline_runtime.layers.linear import _check_shape

        _check_shape(loaded, tuple(param.shape), "RMSNorm")
        param.data.copy_(loaded)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        if torch.compiler.is_compiling():  # the primitive ops, for Inductor to fuse
            variance = x.pow(2).mean(-1, keepdim=True)
            x = x * torch.rsqrt(variance + self.variance_epsilon)
        else:
            # one call from Python instead of five (ATen runs the same steps inside it); on the
            # CPU the same result bit for bit (tests/runtime/test_layers.py)
            x = F.rms_norm(x, (x.shape[-1],), None, self.variance_epsilon)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without ``residual``: the normalised ``x``. With it: ``(norm(x + residual), x + residual)``.

        On CUDA one Triton kernel does it all (``layers/triton_rms_norm.py``, the same steps and
        roundings); elsewhere, and while ``torch.compile`` traces (Inductor fuses them with their
        neighbours), the PyTorch ops below.
        """
        triton = x.is_cuda if self.use_triton is None else self.use_triton
        if triton and not torch.compiler.is_compiling():
            from shardline_runtime.layers.triton_rms_norm import rms_norm

            normed, summed = rms_norm(x, self.weight, self.variance_epsilon, residual)
            return normed if summed is None else (normed, summed)
        if residual is None:
            return self._norm(x)
        x = residual + x
        return self._norm(x), x
