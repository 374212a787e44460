"""``--enable-torch-compile``: the decode forward compiled by ``torch.compile`` (Inductor), after
SGLang's ``CudaGraphRunner`` with ``enable_torch_compile`` and gpt-fast's compiled decode step.

The compiled callable is the model's own ``forward`` with ``dynamic=False``: one specialisation
per decode batch size, only the sizes the decode graph runner pads to (``CudaGraphRunner``), up
to ``--torch-compile-max-bs``. Attention is a graph break (``RadixAttention`` runs outside
Dynamo, with the fused rotary + KV-store kernel on CUDA), so Inductor compiles and fuses what
lies between two attentions: the residual adds, RMSNorms, projections and SwiGLU (the layers take
their plain PyTorch path while Dynamo traces, so Inductor sees the ops it can fuse, not the
hand-written Triton kernels).

Where it runs: on a GPU inside the decode CUDA graphs (the capture's warm-up runs compile, the
graph records the generated kernels); on the CPU the same padded static-buffer path runs the
compiled forward eagerly (Inductor's C++ backend; compiled at a size's first step).

Weight updates: parameters stay inputs of the compiled graphs (Inductor's ``freezing`` is off),
so a copy into the existing parameters is read by the next step, and a recapture records the
compiled kernels over the new values; a parameter of another shape or dtype recompiles.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

# Dynamo's per-code-object cache must hold one entry per (batch size, layer frame resumed after
# a graph break): SGLang raises the same limits for its compiled decode.
_CACHE_SIZE_LIMIT = 1024


def cxx_compiler() -> str | None:
    """The C++ compiler Inductor's CPU backend would use (``$CXX``, else g++ or clang++), or None."""
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


class CompiledDecode:
    """``model.forward`` compiled for decode batches of at most ``max_bs`` rows.

    Args:
        model: the causal LM (``forward(input_ids, positions, forward_batch, ...)``).
        max_bs: ``--torch-compile-max-bs``.
        device: where the model runs.

    Raises:
        RuntimeError: on the CPU without a C++ compiler (the message names what to install).
    """

    def __init__(self, model: torch.nn.Module, max_bs: int, device: torch.device):
        if device.type == "cpu" and cxx_compiler() is None:
            raise RuntimeError(
                "--enable-torch-compile on the CPU needs a C++ compiler for Inductor "
                "(install g++ or clang++, or set CXX), or drop --enable-torch-compile"
            )
        torch._dynamo.config.cache_size_limit = max(
            torch._dynamo.config.cache_size_limit, _CACHE_SIZE_LIMIT
        )
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, _CACHE_SIZE_LIMIT
        )
        self.max_bs = max_bs
        self.forward: Callable[..., Any] = torch.compile(model.forward, dynamic=False)

    def covers(self, batch_size: int) -> bool:
        """Whether a (padded) decode batch of ``batch_size`` rows runs compiled."""
        return batch_size <= self.max_bs

    def batch_sizes(self, padded_sizes: list[int]) -> tuple[int, ...]:
        """The sizes of ``padded_sizes`` (the decode graph runner's) that run compiled."""
        return tuple(bs for bs in padded_sizes if self.covers(bs))
