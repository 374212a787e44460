"""Decode attention on CPU over K/V gathered from the head-major paged pool.

One query per request. Measured on one CPU thread (12 heads x 64, batch 16, ~136 keys; see
docs/benchmarks.md), two things dominate: allocating fresh multi-MiB tensors for the gathered
K/V every layer (page faults, cold cache lines), and running SDPA's flash kernel on a single
query row. So the gathers write into buffers reused across layers and steps
(:class:`DecodeScratch`), and the attention is two batched matrix products around a softmax.
"""

from __future__ import annotations

import torch


class DecodeScratch:
    """Reusable CPU buffers for gathered K/V; grows to the largest step seen, never shrinks.

    Only for eager CPU use: a captured CUDA graph must not read buffers that may be replaced.
    A step needing more than ``max_bytes`` gets fresh tensors instead (nothing is kept), so a
    rare long-context step does not pin its gathers' memory for the rest of the process.
    """

    def __init__(self, max_bytes: int = 256 << 20):
        self._buf: torch.Tensor | None = None
        self.max_bytes = max_bytes
        self._views: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None  # last kv()

    def kv(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two uninitialised contiguous tensors of ``shape`` (K and V), views of one buffer.

        The layers of one pass ask for the same shape: the views of the last call are reused.
        """
        key = (shape, dtype, device)
        if self._views is not None and self._views[0] == key:
            return self._views[1]
        n = 1
        for s in shape:
            n *= s
        if 2 * n * dtype.itemsize > self.max_bytes:
            return torch.empty(shape, dtype=dtype, device=device), torch.empty(
                shape, dtype=dtype, device=device
            )
        buf = self._buf
        # normal tensors and views (made outside inference mode): writable in and out of it
        with torch.inference_mode(False):
            if buf is None or buf.dtype != dtype or buf.device != device or buf.numel() < 2 * n:
                buf = self._buf = torch.empty(2 * n, dtype=dtype, device=device)
            views = (buf[:n].view(shape), buf[n : 2 * n].view(shape))
        self._views = (key, views)
        return views


def decode_attention_cpu(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    scratch: DecodeScratch,
) -> torch.Tensor:
    """Softmax attention of one query per request over the K/V at ``slots``.

    Args:
        q: (bs, Hq, D) queries; ``Hq`` a multiple of ``Hkv`` (grouped-query attention).
        k_pool, v_pool: (Hkv, size + 1, D) head-major pool of one layer.
        slots: (bs * L,) int64 KV slots, request-major (request ``i`` owns ``[i*L, (i+1)*L)``).
        bias: (bs, L) float32 additive mask, 0 where a key is attended and -inf where not;
            every row attends at least one key.
        scale: softmax scale.
        scratch: buffers the gathered K/V are written to.

    Returns:
        (bs, Hq, D) in ``q``'s dtype; scores and softmax in float32.
    """
    bs, hq, d = q.shape
    hkv = k_pool.shape[0]
    kv_len = bias.shape[1]
    k, v = scratch.kv((hkv, bs * kv_len, d), k_pool.dtype, k_pool.device)
    torch.index_select(k_pool, 1, slots, out=k)
    torch.index_select(v_pool, 1, slots, out=v)
    k = k.view(hkv, bs, kv_len, d)
    v = v.view(hkv, bs, kv_len, d)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    qh = (q * scale).view(bs, hkv, hq // hkv, d).transpose(0, 1)  # (Hkv, bs, group, D)
    scores = torch.matmul(qh, k.transpose(-1, -2))  # (Hkv, bs, group, L)
    if scores.dtype != torch.float32:
        scores = scores.float()
    scores += bias[None, :, None, :]
    probs = torch.softmax(scores, dim=-1)
    if probs.dtype != v.dtype:
        probs = probs.to(v.dtype)
    out = torch.matmul(probs, v)  # (Hkv, bs, group, D)
    return out.transpose(0, 1).reshape(bs, hq, d)
