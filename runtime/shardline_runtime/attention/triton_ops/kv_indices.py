"""Fill ``kv_indices`` from ``req_to_token`` (after SGLang's ``create_flashinfer_kv_indices_triton``).

``kv_indices[kv_indptr[i] : kv_indptr[i + 1]] = req_to_token[req_pool_indices[i], :seq_lens[i]]``,
one program per request, so neither the lengths nor the indices pass through the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _create_kv_indices_kernel(
    req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices, stride_row, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    row = tl.load(req_pool_indices + pid)
    length = tl.load(seq_lens + pid)
    start = tl.load(kv_indptr + pid)
    for i in range(0, tl.cdiv(length, BLOCK)):
        offs = i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < length
        slots = tl.load(req_to_token + row * stride_row + offs, mask=mask)
        tl.store(kv_indices + start + offs, slots, mask=mask)


def fill_kv_indptr(seq_lens: torch.Tensor, kv_indptr: torch.Tensor) -> None:
    """``kv_indptr[0] = 0``, ``kv_indptr[1:bs+1] = cumsum(seq_lens)`` in place.

    Args:
        seq_lens: (bs,) int64. kv_indptr: (>= bs + 1,) int64, written in its first ``bs + 1``.
    """
    bs = seq_lens.shape[0]
    kv_indptr[0] = 0
    torch.cumsum(seq_lens, dim=0, out=kv_indptr[1 : bs + 1])


def create_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """Write each request's KV slots into ``kv_indices`` at ``kv_indptr`` (see module doc).

    Args:
        req_to_token: (rows, max_context_len) int64, contiguous rows.
        req_pool_indices, seq_lens: (bs,) int64. kv_indptr: (>= bs + 1,) int64 prefix sums of
        ``seq_lens``. kv_indices: (>= sum(seq_lens),) int64, written in place.
    """
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    _create_kv_indices_kernel[(bs,)](
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv_indptr,
        kv_indices,
        req_to_token.stride(0),
        BLOCK=512,
    )
