"""Triton attention backend: split-K decode and paged extend kernels (``triton_ops/``).

Reads the same token-granular layout as the torch_native backend: ``req_to_token`` rows and
the head-major ``TokenToKVPool`` (one KV slot per token).

DECODE metadata (after SGLang's ``TritonAttnBackend``): ``kv_indptr`` (bs + 1,) and
``kv_indices`` (sum of seq_lens,) list every request's KV slots, built on the device from
``req_pool_indices`` / ``seq_lens`` (``triton_ops/kv_indices.py``). Under CUDA graphs both are
*static* buffers (``init_cuda_graph_state``: ``max_bs + 1`` and ``max_bs * max_context_len``
entries), refilled by :meth:`init_forward_metadata_replay_cuda_graph` before every replay, so the
captured kernels read the real lengths each time: no KV bound is baked in at capture, and a
step reads only the keys that exist.

EXTEND: one kernel per layer over each request's new tokens and its cached prefix, through
``req_to_token``; its grid needs the longest new part (read from the batch's ``*_cpu`` lists,
so EXTEND runs eagerly, also between the pieces of a piecewise CUDA graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardline_runtime.attention.base import AttentionBackend, VerifyLayout
from shardline_runtime.attention.triton_ops.decode_attention import decode_attention_fwd
from shardline_runtime.attention.triton_ops.extend_attention import extend_attention_fwd
from shardline_runtime.attention.triton_ops.kv_indices import create_kv_indices, fill_kv_indptr


@dataclass
class DecodeMetadata:
    """``kv_indptr`` (>= bs + 1,) int64 and ``kv_indices`` (>= sum(seq_lens),) int64 of one pass."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor


@dataclass
class ExtendMetadata:
    """(bs,) int64 tensors of one EXTEND pass, and the longest new part (grid size)."""

    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    q_start_loc: torch.Tensor
    max_extend_len: int


class TritonAttnBackend(AttentionBackend):
    """Attention with Triton kernels (see the module doc).

    Args:
        model_runner: supplies ``req_to_token_pool``, ``token_to_kv_pool``, ``device``.
        num_kv_splits: KV splits per (request, KV head) of the decode kernel (power of two);
            default 16 on CUDA (enough programs to fill an H100/H200 at batch 1), 2 on CPU (the
            interpreter runs every program instance in Python).
    """

    def __init__(self, model_runner, num_kv_splits: int | None = None):
        super().__init__(model_runner)
        self.num_kv_splits = num_kv_splits or (16 if self.device.type == "cuda" else 2)
        self.max_context_len = self.req_to_token_pool.req_to_token.shape[1]
        self.decode_metadata: DecodeMetadata | None = None
        self.extend_metadata: ExtendMetadata | None = None
        self.cuda_graph_kv_indptr: torch.Tensor | None = None
        self.cuda_graph_kv_indices: torch.Tensor | None = None

    # ---- start of a pass ------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch) -> None:
        """Eager pass: DECODE builds fresh ``kv_indptr`` / ``kv_indices``; EXTEND its offsets."""
        self.decode_metadata = self.extend_metadata = None
        self.verify_layout = None
        bs = forward_batch.batch_size
        device = forward_batch.seq_lens.device
        if forward_batch.forward_mode.is_decode():
            total = (
                sum(forward_batch.seq_lens_cpu) if forward_batch.seq_lens_cpu is not None else None
            )
            if total is None:
                total = int(forward_batch.seq_lens.sum()) if bs else 0
            indptr = torch.empty(bs + 1, dtype=torch.int64, device=device)
            indices = torch.empty(max(total, 1), dtype=torch.int64, device=device)
            self._fill(
                forward_batch.req_to_token_pool,
                forward_batch.req_pool_indices,
                forward_batch.seq_lens,
                indptr,
                indices,
            )
            self.decode_metadata = DecodeMetadata(indptr, indices)
        elif forward_batch.forward_mode.is_extend() and bs:  # TARGET_VERIFY too
            ext = forward_batch.extend_seq_lens
            q_start = torch.zeros(bs, dtype=torch.int64, device=device)
            if bs > 1:
                torch.cumsum(ext[:-1], dim=0, out=q_start[1:])
            self.extend_metadata = ExtendMetadata(
                forward_batch.extend_prefix_lens,
                ext,
                q_start,
                max(forward_batch.extend_seq_lens_cpu),
            )

    def _fill(self, pool, req_pool_indices, seq_lens, indptr, indices) -> None:
        req_to_token = (pool or self.req_to_token_pool).req_to_token
        fill_kv_indptr(seq_lens, indptr)
        create_kv_indices(req_to_token, req_pool_indices, seq_lens, indptr, indices)

    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Static ``kv_indptr`` (max_bs + 1,) and ``kv_indices`` (max_bs * max_context_len,) int64."""
        self.cuda_graph_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int64, device=self.device)
        self.cuda_graph_kv_indices = torch.zeros(
            max_bs * self.max_context_len, dtype=torch.int64, device=self.device
        )

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        """Point the decode metadata at the static buffers and fill them for the capture batch."""
        if self.cuda_graph_kv_indptr is None:
            raise RuntimeError(
                "init_cuda_graph_state must be called before capturing decode graphs"
            )
        self.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens)

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        """Refill the static buffers from the static ``req_pool_indices[:bs]`` / ``seq_lens[:bs]``
        (two small kernels on the current stream, before the replay)."""
        indptr, indices = self.cuda_graph_kv_indptr, self.cuda_graph_kv_indices
        if indptr is None or indices is None:
            raise RuntimeError(
                "init_cuda_graph_state(max_bs) must run before a CUDA graph is captured or replayed"
            )
        self.extend_metadata = None
        self.verify_layout = None
        self._fill(None, req_pool_indices[:bs], seq_lens[:bs], indptr, indices)
        self.decode_metadata = DecodeMetadata(indptr, indices)

    def init_forward_metadata_verify_graph(self, layout: VerifyLayout) -> None:
        """A TARGET_VERIFY graph pass: the extend kernel reads the layout's static tensors, its
        grid sized by ``tokens_per_req`` (padded query rows are not computed; see
        :meth:`forward_verify_graph`)."""
        self.decode_metadata = self.extend_metadata = None
        self.verify_layout = layout

    def forward_verify_graph(self, q: torch.Tensor, layer, forward_batch, kv_pool) -> torch.Tensor:
        """q (bs * n, Hq, D) -> (bs * n, Hq, D) with ``extend_attention_fwd`` over the layout;
        padded query rows come out zero."""
        lay = self.verify_layout
        assert lay is not None
        k_buf, v_buf = kv_pool.get_kv_buffer_head_major(layer.layer_id)
        return extend_attention_fwd(
            q,
            k_buf,
            v_buf,
            torch.zeros_like(q),
            self._req_to_token(forward_batch),
            lay.req_pool_indices,
            lay.prefix_lens,
            lay.extend_lens,
            lay.q_start_loc,
            lay.tokens_per_req,
            layer.scaling,
            window=layer.sliding_window,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
        )

    # ---- per layer --------------------------------------------------------------------------------

    def forward_extend(self, q: torch.Tensor, layer, forward_batch, kv_pool) -> torch.Tensor:
        """q (T, Hq, D) -> (T, Hq, D) with ``extend_attention_fwd``."""
        out = torch.empty_like(q)
        meta = self.extend_metadata
        if q.shape[0] == 0 or meta is None:
            return out
        k_buf, v_buf = kv_pool.get_kv_buffer_head_major(layer.layer_id)
        return extend_attention_fwd(
            q,
            k_buf,
            v_buf,
            out,
            self._req_to_token(forward_batch),
            forward_batch.req_pool_indices,
            meta.prefix_lens,
            meta.extend_lens,
            meta.q_start_loc,
            meta.max_extend_len,
            layer.scaling,
            window=layer.sliding_window,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
        )

    def forward_decode(self, q: torch.Tensor, layer, forward_batch, kv_pool) -> torch.Tensor:
        """q (bs, Hq, D) -> (bs, Hq, D) with ``decode_attention_fwd`` over ``kv_indices``."""
        out = torch.empty_like(q)
        if q.shape[0] == 0:
            return out
        meta = self.decode_metadata
        if meta is None:
            raise RuntimeError(
                "decode attention called without init_forward_metadata for this pass"
            )
        k_buf, v_buf = kv_pool.get_kv_buffer_head_major(layer.layer_id)
        return decode_attention_fwd(
            q,
            k_buf,
            v_buf,
            out,
            meta.kv_indptr,
            meta.kv_indices,
            layer.scaling,
            window=layer.sliding_window,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
            num_kv_splits=self.num_kv_splits,
        )
