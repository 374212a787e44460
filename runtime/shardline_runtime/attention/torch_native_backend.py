"""Torch-native attention backend (CPU and GPU), reading K/V through ``req_to_token``.

Every call first writes the step's K/V at ``out_cache_loc`` into the layer's KV buffers, then
attends over each request's whole sequence gathered from the pool via
``req_to_token[req_pool_indices, :seq_len]`` (so a cached prefix is read, not recomputed).

EXTEND loops over requests (variable lengths) using the ``*_cpu`` lists. DECODE is one batched
computation whose lengths and indices come from tensors (``seq_lens``, ``req_pool_indices``):
it gathers a fixed ``kv_len_bound`` columns of ``req_to_token`` and masks positions
``>= seq_len``, so a CUDA graph captured with a bound replays correctly for any shorter lengths.

DECODE per step (not per layer): the flattened slot indices and the masks are built by the first
layer of each forward pass (inside the model forward, so a captured graph recomputes them from
its static input tensors on every replay) and shared by the other layers; the start-of-pass
calls of :class:`AttentionBackend` drop them, so a new pass is told, never inferred.

Under CUDA graphs this backend gathers the whole ``req_to_token`` row (the context length) per
request whatever the real lengths: it is the simple reference, the ``triton`` backend is the
fast one (see docs/benchmarks.md). The pool is
head-major (see ``TokenToKVPool``), so the gathered K/V are (heads, bs, kv_len_bound, head_dim)
with each (request, head) block contiguous; see ``paged_decode.py`` for the CPU computation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shardline_runtime.attention.base import AttentionBackend, VerifyLayout
from shardline_runtime.attention.paged_decode import DecodeScratch, decode_attention_cpu


@dataclass
class ForwardMetadata:
    """Per-step data shared by all layers. ``kv_len_bound``: KV columns gathered in DECODE."""

    kv_len_bound: int = 0


@dataclass
class DecodeTensors:
    """DECODE tensors of one forward pass, shared by its layers.

    ``slots``: (bs * kv_len_bound,) int64 KV slots, row-major by request. ``masks``: per sliding
    window (``None``: full attention) a (bs, kv_len_bound) mask, bool (True = attend) on GPU,
    float32 additive (0 / -inf) on CPU.
    """

    slots: torch.Tensor
    masks: dict = field(default_factory=dict)


class TorchNativeAttnBackend(AttentionBackend):
    """Attention over the paged KV pool with plain torch ops.

    Args:
        model_runner: supplies ``req_to_token_pool`` and ``token_to_kv_pool`` (the pools of
            the ForwardBatch are used when it carries its own).
    """

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.max_context_len = self.req_to_token_pool.req_to_token.shape[1]
        self.forward_metadata = ForwardMetadata()
        self._decode: DecodeTensors | None = None
        self._scratch = DecodeScratch()

    # ---- metadata ----------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch) -> None:
        """Eager step: the DECODE bound is the longest ``seq_len`` of the batch."""
        self._decode = None
        self.verify_layout = None
        if forward_batch.forward_mode.is_decode():
            lens = forward_batch.seq_lens_cpu
            bound = (
                max(lens)
                if lens
                else int(forward_batch.seq_lens.max())
                if forward_batch.batch_size
                else 0
            )
            self.forward_metadata = ForwardMetadata(kv_len_bound=bound)

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int = 0, req_pool_indices=None, seq_lens=None
    ) -> None:
        """Graph capture: a fixed bound, the whole ``req_to_token`` row (the slots and masks are
        then computed inside the graph from its static tensors)."""
        self._decode = None
        self.verify_layout = None
        self.forward_metadata = ForwardMetadata(kv_len_bound=self.max_context_len)

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int = 0, req_pool_indices=None, seq_lens=None
    ) -> None:
        """Graph replay: the same fixed bound as at capture (nothing else is read from Python)."""
        self.init_forward_metadata_capture_cuda_graph(bs, req_pool_indices, seq_lens)

    def _decode_tensors(
        self, layer, forward_batch, bs: int, bound: int, device: torch.device
    ) -> DecodeTensors:
        """This pass's DECODE tensors: built by its first layer, reused by the later ones; the
        start-of-pass calls reset them."""
        if self._decode is None:
            req_to_token = self._req_to_token(forward_batch)
            slots = req_to_token[forward_batch.req_pool_indices, :bound].reshape(bs * bound)
            self._decode = DecodeTensors(slots=slots)
        window = layer.sliding_window
        if window not in self._decode.masks:
            pos = torch.arange(bound, device=device)[None, :]
            seq_lens = forward_batch.seq_lens[:, None]
            valid = pos < seq_lens  # (bs, bound)
            if window is not None:
                valid &= pos >= seq_lens - window
            if device.type == "cpu":
                valid = torch.zeros(valid.shape, dtype=torch.float32, device=device).masked_fill_(
                    ~valid, float("-inf")
                )
            self._decode.masks[window] = valid
        return self._decode

    def init_forward_metadata_verify_graph(self, layout: VerifyLayout) -> None:
        """A TARGET_VERIFY graph pass: the whole ``req_to_token`` row is gathered per request
        and masked from the layout's tensors (nothing is read from Python lists)."""
        self._decode = None
        self.verify_layout = layout
        self.forward_metadata = ForwardMetadata(kv_len_bound=self.max_context_len)

    def forward_verify_graph(self, q: torch.Tensor, layer, forward_batch, kv_pool) -> torch.Tensor:
        """q (bs * n, Hq, D) -> (bs * n, Hq, D): query ``j`` of request ``i`` attends keys
        ``k <= prefix_i + min(j, ext_i - 1)`` (a padded query repeats the request's last real
        one, so it stays finite and in range), within the sliding window when there is one."""
        lay = self.verify_layout
        assert lay is not None
        bs, n, bound = lay.bs, lay.tokens_per_req, self.forward_metadata.kv_len_bound
        if self._decode is None:  # the pass's slots, built by its first layer
            rows = self._req_to_token(forward_batch)[lay.req_pool_indices]
            self._decode = DecodeTensors(slots=rows[:, :bound].reshape(bs * bound))
        meta = self._decode
        window = layer.sliding_window
        if window not in meta.masks:
            j = torch.arange(n, device=q.device)[None, :]
            q_pos = lay.prefix_lens[:, None] + torch.minimum(j, lay.extend_lens[:, None] - 1)
            k_pos = torch.arange(bound, device=q.device)[None, None, :]
            allowed = k_pos <= q_pos[:, :, None]  # (bs, n, bound)
            if window is not None:
                allowed &= k_pos > q_pos[:, :, None] - window
            meta.masks[window] = allowed
        k_buf, v_buf = kv_pool.get_kv_buffer_head_major(layer.layer_id)  # (Hkv, size + 1, D)
        hkv, d = layer.tp_k_head_num, layer.head_dim
        k = _dequant(k_buf.index_select(1, meta.slots), layer.k_scale, q.dtype)
        v = _dequant(v_buf.index_select(1, meta.slots), layer.v_scale, q.dtype)
        o = F.scaled_dot_product_attention(
            q.view(bs, n, layer.tp_q_head_num, d).transpose(1, 2),  # (bs, Hq, n, D)
            k.view(hkv, bs, bound, d).transpose(0, 1),  # (bs, Hkv, bound, D)
            v.view(hkv, bs, bound, d).transpose(0, 1),
            attn_mask=meta.masks[window][:, None],
            scale=layer.scaling,
            enable_gqa=layer.tp_q_head_num != hkv,
        )
        return o.transpose(1, 2).reshape(bs * n, layer.tp_q_head_num, d)

    # ---- compute -----------------------------------------------------------------------------

    def forward_extend(self, q: torch.Tensor, layer, forward_batch, kv_pool) -> torch.Tensor:
        """q (T, Hq, D) -> (T, Hq, D); causal within each request, after its cached prefix."""
        out = torch.empty_like(q)
        if q.shape[0] == 0:
            return out
        req_to_token = self._req_to_token(forward_batch)
        k_buf, v_buf = kv_pool.get_kv_buffer_head_major(layer.layer_id)  # (Hkv, size + 1, D)
        start = 0
        for i, (prefix, ext) in enumerate(
            zip(forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu)
        ):
            seq_len = prefix + ext
            slots = req_to_token[forward_batch.req_pool_indices[i], :seq_len]
            k_all = _dequant(k_buf.index_select(1, slots), layer.k_scale, q.dtype)  # (Hkv, L, D)
            v_all = _dequant(v_buf.index_select(1, slots), layer.v_scale, q.dtype)
            mask = None
            if prefix or layer.sliding_window is not None:
                q_pos = torch.arange(prefix, seq_len, device=q.device)[:, None]  # (ext, 1)
                k_pos = torch.arange(seq_len, device=q.device)[None, :]  # (1, L)
                mask = k_pos <= q_pos
                if layer.sliding_window is not None:
                    mask &= k_pos > q_pos - layer.sliding_window
            o = F.scaled_dot_product_attention(
                q[start : start + ext].transpose(0, 1),
                k_all,
                v_all,
                attn_mask=mask,
                is_causal=mask is None,
                scale=layer.scaling,
                enable_gqa=True,
            )  # (Hq, ext, D); enable_gqa shares each KV head with its group of query heads
            out[start : start + ext] = o.transpose(0, 1)
            start += ext
        return out

    def forward_decode(self, q: torch.Tensor, layer, forward_batch, kv_pool) -> torch.Tensor:
        """q (bs, Hq, D) -> (bs, Hq, D); one query per request over ``seq_lens`` keys."""
        bs = q.shape[0]
        bound = self.forward_metadata.kv_len_bound
        if bs == 0 or bound == 0:
            return torch.zeros_like(q)
        meta = self._decode_tensors(layer, forward_batch, bs, bound, q.device)
        mask = meta.masks[layer.sliding_window]
        k_buf, v_buf = kv_pool.get_kv_buffer_head_major(layer.layer_id)  # (Hkv, size + 1, D)
        hkv, head_dim = layer.tp_k_head_num, layer.head_dim
        if q.device.type == "cpu" and k_buf.dtype == q.dtype:
            return decode_attention_cpu(
                q, k_buf, v_buf, meta.slots, mask, layer.scaling, self._scratch
            )
        # GPU (or an fp8 cache): fresh gathers (allocated from the graph pool while capturing), SDPA
        k = (
            _dequant(k_buf.index_select(1, meta.slots), layer.k_scale, q.dtype)
            .view(hkv, bs, bound, head_dim)
            .transpose(0, 1)
        )
        v = (
            _dequant(v_buf.index_select(1, meta.slots), layer.v_scale, q.dtype)
            .view(hkv, bs, bound, head_dim)
            .transpose(0, 1)
        )
        if mask.dtype != torch.bool:
            mask = mask == 0
        o = F.scaled_dot_product_attention(
            q[:, :, None, :],
            k,
            v,
            attn_mask=mask[:, None, None, :],
            scale=layer.scaling,
            enable_gqa=layer.tp_q_head_num != hkv,
        )  # (bs, Hq, 1, D)
        return o.reshape(bs, layer.tp_q_head_num, head_dim)


def _dequant(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored K/V -> ``dtype``: a plain cast, times ``scale`` when it is not 1 (fp8 caches)."""
    x = x.to(dtype)
    return x if scale == 1.0 else x * scale
