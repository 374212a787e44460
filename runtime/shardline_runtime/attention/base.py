"""The attention-backend interface every backend implements (after SGLang's ``AttentionBackend``).

A model step calls, in this order:

1. exactly one *start-of-pass* call, which is the backend's explicit signal that a new forward
   pass begins (per-pass metadata is rebuilt there, never inferred from layer ids):
   :meth:`init_forward_metadata` for an eager step, or
   :meth:`init_forward_metadata_capture_cuda_graph` / :meth:`init_forward_metadata_replay_cuda_graph`
   around a captured decode graph (after :meth:`init_cuda_graph_state` once);
2. then :meth:`forward` once per attention layer (it writes the layer's new K/V into the pool,
   then dispatches to :meth:`forward_extend` or :meth:`forward_decode`).

Tensor shapes: ``q`` (T, Hq * D), ``k``/``v`` (T, Hkv * D) in the model dtype; the pool of one
layer is (Hkv, slots, D) head-major (``TokenToKVPool.get_kv_buffer_head_major``), stored in the
KV cache dtype and dequantised with the layer's ``k_scale`` / ``v_scale``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class VerifyLayout:
    """The static layout of a TARGET_VERIFY step replayed from a graph (``verify_graph_runner.py``).

    Request ``i < bs`` owns query rows ``[i * tokens_per_req, (i + 1) * tokens_per_req)``; its
    first ``extend_lens[i]`` rows are its real tokens at positions ``prefix_lens[i] + j``, the
    others are padding, which must come out finite and read only that request's keys
    ``[0, prefix_lens[i] + extend_lens[i])``. Every tensor is (bs,) int64 at a fixed address.
    """

    bs: int
    tokens_per_req: int
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    q_start_loc: torch.Tensor


class AttentionBackend(ABC):
    """Base class of attention backends; see the module doc for the call order.

    Args:
        model_runner: supplies ``req_to_token_pool``, ``token_to_kv_pool`` and ``device``.
    """

    def __init__(self, model_runner):
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.device = torch.device(getattr(model_runner, "device", "cpu"))
        # set by init_forward_metadata_verify_graph; the eager start-of-pass calls reset it
        self.verify_layout: VerifyLayout | None = None

    # ---- start of a forward pass ----------------------------------------------------------------

    @abstractmethod
    def init_forward_metadata(self, forward_batch) -> None:
        """An eager forward pass starts: build its metadata (may read the batch's ``*_cpu`` lists)."""

    def init_cuda_graph_state(self, max_bs: int) -> None:  # noqa: B027  (optional hook, no-op by default)
        """Allocate the static buffers captured decode graphs read (once, before any capture)."""

    @abstractmethod
    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        """A decode graph of ``bs`` rows is about to be captured over these static (bs,) tensors."""

    @abstractmethod
    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        """A captured decode graph of ``bs`` rows is about to replay: refill its static metadata
        from the (already filled) static ``req_pool_indices`` / ``seq_lens``."""

    def init_forward_metadata_verify_graph(self, layout: VerifyLayout) -> None:
        """A TARGET_VERIFY graph is about to be captured or replayed over ``layout``'s static
        tensors (already filled): every attention call of the pass reads them.

        Raises:
            NotImplementedError: the backend has no graph-safe verify path.
        """
        raise NotImplementedError(f"{type(self).__name__} has no TARGET_VERIFY graph path")

    def forward_verify_graph(self, q: torch.Tensor, layer, forward_batch, kv_pool) -> torch.Tensor:
        """q (bs * tokens_per_req, Hq, D) -> the same shape, over :attr:`verify_layout`."""
        raise NotImplementedError(f"{type(self).__name__} has no TARGET_VERIFY graph path")

    # ---- per layer --------------------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer,
        forward_batch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """q (T, Hq*D) or (T, Hq, D), k/v (T, Hkv*D) or (T, Hkv, D) -> (T, Hq*D); writes k/v
        into the pool first unless
        ``save_kv_cache`` is False (the caller stored them already: the fused rotary + KV-store
        kernel of ``layers/triton_rope_kv.py``)."""
        kv_pool = forward_batch.token_to_kv_pool or self.token_to_kv_pool
        q = q.view(-1, layer.tp_q_head_num, layer.head_dim)
        k = k.view(-1, layer.tp_k_head_num, layer.head_dim)
        v = v.view(-1, layer.tp_k_head_num, layer.head_dim)
        if save_kv_cache and q.shape[0]:
            kv_pool.set_kv_buffer(
                layer.layer_id,
                forward_batch.out_cache_loc,
                k,
                v,
                k_scale=layer.k_scale,
                v_scale=layer.v_scale,
            )
        if forward_batch.forward_mode.is_decode():
            out = self.forward_decode(q, layer, forward_batch, kv_pool)
        elif self.verify_layout is not None and forward_batch.forward_mode.is_target_verify():
            out = self.forward_verify_graph(q, layer, forward_batch, kv_pool)
        else:
            out = self.forward_extend(q, layer, forward_batch, kv_pool)
        return out.reshape(-1, layer.tp_q_head_num * layer.head_dim)

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, layer, forward_batch, kv_pool) -> torch.Tensor:
        """q (T, Hq, D) -> (T, Hq, D): each request's new tokens, causal, after its cached prefix."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer, forward_batch, kv_pool) -> torch.Tensor:
        """q (bs, Hq, D) -> (bs, Hq, D): one query per request over its ``seq_lens`` keys."""

    def _req_to_token(self, forward_batch) -> torch.Tensor:
        pool = forward_batch.req_to_token_pool or self.req_to_token_pool
        return pool.req_to_token
