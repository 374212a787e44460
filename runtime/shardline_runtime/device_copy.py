"""Host-to-device copies that never wait for the device.

A blocking host-to-device copy on CUDA synchronises the current stream before it returns
(``cudaMemcpyAsync`` then ``cudaStreamSynchronize``, PyTorch's ``copy_`` without
``non_blocking``). With overlap scheduling the current stream is the forward stream and holds the
step in flight, so such a copy, or ``torch.tensor(values, device="cuda")``, would make the host
wait for that step. Every copy the scheduler makes while a step may be in flight goes through
:func:`to_device`: the values go to pinned host memory and are copied with ``non_blocking=True``
(queued on the current stream after the work already there; PyTorch's caching host allocator
keeps the pinned block until the copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(
    values: torch.Tensor | Sequence[Any],
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``values`` (a host tensor or a Python sequence) as a tensor on ``device``.

    Args:
        values: host data (a tensor, or a possibly nested sequence of numbers); a tensor already
            on ``device`` is returned as is (cast if asked).
        device: the target device.
        dtype: element type of the result (default: the tensor's own, or torch's inference for
            a sequence).

    Returns:
        A tensor on ``device``. On the CPU it may share memory with ``values``; on CUDA the copy
        is queued on the current stream without the host waiting.
    """
    device = torch.device(device)
    if isinstance(values, torch.Tensor):
        host = values if dtype is None or values.dtype == dtype else values.to(dtype)
        if host.device.type == device.type:
            return host
    else:
        host = torch.tensor(values, dtype=dtype)
        if device.type == "cpu":
            return host
    if host.device.type == "cpu" and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
