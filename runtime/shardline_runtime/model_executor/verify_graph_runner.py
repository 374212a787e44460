"""VerifyGraphRunner: speculative decoding's TARGET_VERIFY steps replayed from CUDA graphs.

After SGLang's ``CudaGraphRunner`` in ``TARGET_VERIFY`` capture mode (``num_tokens_per_bs =
speculative_num_draft_tokens``): one graph per captured batch size ``bs``, over ``bs * n`` tokens,
``n`` = ``--speculative-num-draft-tokens`` (a request's last accepted token and its drafts).

Layout. Request ``i`` owns token rows ``[i * n, (i + 1) * n)`` of the static buffers. A request
with fewer drafts (``1 + k_i < n``: the n-gram table found fewer, or the budget near
``max_new_tokens``) fills its first ``1 + k_i`` rows; the rest are padding (token 0 at position 0,
KV written to the dummy slot 0). Rows of padded requests ``bs..padded_bs-1`` use the dummy
request row (all slot 0) with one token after an empty prefix. The attention backend reads
``prefix_lens`` / ``extend_lens`` / ``req_pool_indices`` from static tensors
(``attention/base.py: VerifyLayout``), so nothing about lengths is baked into a graph, and a
real token never attends a padded one (causal order). The logits of every real token, and the
hidden states they came from (EAGLE's features: a graph always returns them), are gathered back
into the eager step's packed order, so ``verify_step.verify_batch`` cannot tell the two apart.

On CPU (or ``capture=False``) the same static-buffer path runs eagerly, which CI checks against
the eager verify step token for token; the real capture is a ``gpu`` test. A weight update that
recaptures calls :meth:`capture` again (``DeviceGraphs.capture``).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import Any

import torch

from shardline_runtime.attention.base import VerifyLayout
from shardline_runtime.device_copy import to_device
from shardline_runtime.mem_cache.memory_pool import DUMMY_SLOT
from shardline_runtime.model_executor.forward_batch_info import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


class VerifyGraphRunner:
    """Captures and replays TARGET_VERIFY steps of a ``ModelRunner``.

    Args:
        model_runner: provides ``model``, ``device``, ``req_to_token_pool``,
            ``token_to_kv_pool`` and ``attn_backend``.
        tokens_per_req: ``n``, tokens per request of every graph (>= 2).
        batch_sizes: the captured batch sizes.
        dummy_req_row: the ``req_to_token`` row padded requests use (the decode runner's).
        capture: capture real CUDA graphs; default: when the model runs on CUDA.

    Attributes:
        capture_bs: sorted batch sizes; ``graphs``: batch size -> captured graph (empty on CPU).
    """

    def __init__(
        self,
        model_runner: Any,
        tokens_per_req: int,
        batch_sizes: list[int],
        dummy_req_row: int,
        capture: bool | None = None,
    ):
        if tokens_per_req < 2 or not batch_sizes:
            raise ValueError(
                f"a verify graph needs >= 2 tokens per request and a batch size, got "
                f"{tokens_per_req} and {batch_sizes}"
            )
        self.model_runner = model_runner
        self.device = torch.device(model_runner.device)
        self.use_graphs = self.device.type == "cuda" if capture is None else capture
        self.n = tokens_per_req
        self.capture_bs = sorted(batch_sizes)
        self.max_bs = self.capture_bs[-1]
        self.dummy_req_row = dummy_req_row

        def zeros(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int64, device=self.device)

        tokens = self.max_bs * self.n
        self.input_ids, self.positions, self.out_cache_loc = (
            zeros(tokens),
            zeros(tokens),
            zeros(tokens),
        )
        self.req_pool_indices, self.seq_lens = zeros(self.max_bs), zeros(self.max_bs)
        self.prefix_lens, self.extend_lens = zeros(self.max_bs), zeros(self.max_bs)
        self.q_start_loc = torch.arange(self.max_bs, device=self.device) * self.n
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Any] = {}
        self.graph_pool: Any = None
        if self.use_graphs:
            self.capture()

    # ---- buffers ------------------------------------------------------------------------------

    def _fill_padding(self, start: int, end: int) -> None:
        """Requests ``start..end-1`` as padding: the dummy row, one token after no prefix."""
        n = self.n
        self.input_ids[start * n : end * n] = 0
        self.positions[start * n : end * n] = 0
        self.out_cache_loc[start * n : end * n] = DUMMY_SLOT
        self.req_pool_indices[start:end] = self.dummy_req_row
        self.seq_lens[start:end] = 1
        self.prefix_lens[start:end] = 0
        self.extend_lens[start:end] = 1

    def _layout(self, bs: int) -> VerifyLayout:
        return VerifyLayout(
            bs=bs,
            tokens_per_req=self.n,
            req_pool_indices=self.req_pool_indices[:bs],
            prefix_lens=self.prefix_lens[:bs],
            extend_lens=self.extend_lens[:bs],
            q_start_loc=self.q_start_loc[:bs],
        )

    def _static_batch(self, bs: int) -> ForwardBatch:
        """A TARGET_VERIFY batch over views of the buffers; no ``*_cpu`` lists, and the hidden
        states always come back (a graph cannot switch them on later)."""
        runner, tokens = self.model_runner, bs * self.n
        return ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:tokens],
            extend_seq_lens=self.extend_lens[:bs],
            extend_prefix_lens=self.prefix_lens[:bs],
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool=runner.token_to_kv_pool,
            attn_backend=runner.attn_backend,
            capture_hidden_states=True,
        )

    def _run(self, bs: int):
        self.model_runner.attn_backend.init_forward_metadata_verify_graph(self._layout(bs))
        batch = self._static_batch(bs)
        return self.model_runner.model.forward(batch.input_ids, batch.positions, batch)

    # ---- capture / replay ---------------------------------------------------------------------

    def capture(self) -> None:
        """(Re)capture one graph per batch size, largest first, sharing one memory pool.

        Raises:
            RuntimeError: a step cannot be captured; names the batch size and the flag to run
                eagerly instead.
        """
        if not self.use_graphs:
            return
        self.graphs.clear()
        self.outputs.clear()
        stream = torch.cuda.Stream(device=self.device)
        with torch.inference_mode():
            for bs in reversed(self.capture_bs):
                self._fill_padding(0, bs)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm up outside the graph
                        self._run(bs)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=self.graph_pool, stream=stream):
                        output = self._run(bs)
                except RuntimeError as exc:
                    raise RuntimeError(
                        f"CUDA graph capture of the TARGET_VERIFY step failed at batch size {bs} "
                        f"x {self.n} tokens: {exc}. Start with --disable-cuda-graph to run eagerly."
                    ) from exc
                if self.graph_pool is None:
                    self.graph_pool = graph.pool()
                self.graphs[bs], self.outputs[bs] = graph, output
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured TARGET_VERIFY CUDA graphs (x%d tokens) for %s", self.n, self.capture_bs
        )

    def release_graphs(self) -> None:
        """Drop every graph, its output and the memory pool (``capture`` builds them again)."""
        self.graphs.clear()
        self.outputs.clear()
        self.graph_pool = None

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """True for a TARGET_VERIFY batch of at most ``max_bs`` requests of at most ``n`` tokens
        each, without caller-given embeddings."""
        lens = forward_batch.extend_seq_lens_cpu
        return (
            forward_batch.forward_mode.is_target_verify()
            and 0 < forward_batch.batch_size <= self.max_bs
            and lens is not None
            and max(lens) <= self.n
            and forward_batch.input_embeds_indices is None
        )

    def padded_batch_size(self, bs: int) -> int:
        """Smallest captured size >= ``bs``.

        Raises:
            ValueError: ``bs`` is not in [1, max_bs].
        """
        if not 1 <= bs <= self.max_bs:
            raise ValueError(f"batch size must be in [1, {self.max_bs}] for graph replay, got {bs}")
        return self.capture_bs[bisect.bisect_left(self.capture_bs, bs)]

    def replay(self, forward_batch: ForwardBatch):
        """Run a TARGET_VERIFY batch through its padded graph (or the same static path eagerly).

        Returns:
            the model's ``LogitsProcessorOutput``: ``next_token_logits`` (T, vocab) float32 and,
            when the batch asked, ``hidden_states`` (T, hidden), in the batch's packed token
            order (copies: the next replay cannot overwrite them).
        """
        bs, n = forward_batch.batch_size, self.n
        padded = self.padded_batch_size(bs)
        lens = forward_batch.extend_seq_lens_cpu or []
        rows = [i * n + j for i, e in enumerate(lens) for j in range(e)]  # packed -> static
        index = to_device(rows, self.device, torch.int64)
        self.input_ids[: bs * n] = 0
        self.positions[: bs * n] = 0
        self.out_cache_loc[: bs * n] = DUMMY_SLOT
        self.input_ids.index_copy_(0, index, forward_batch.input_ids)
        self.positions.index_copy_(0, index, forward_batch.positions)
        self.out_cache_loc.index_copy_(0, index, forward_batch.out_cache_loc)
        self.req_pool_indices[:bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:bs].copy_(forward_batch.seq_lens)
        assert forward_batch.extend_prefix_lens is not None
        assert forward_batch.extend_seq_lens is not None
        self.prefix_lens[:bs].copy_(forward_batch.extend_prefix_lens)
        self.extend_lens[:bs].copy_(forward_batch.extend_seq_lens)
        self._fill_padding(bs, padded)
        if self.use_graphs:
            self.model_runner.attn_backend.init_forward_metadata_verify_graph(self._layout(padded))
            self.graphs[padded].replay()
            output = self.outputs[padded]
        else:
            with torch.inference_mode():
                output = self._run(padded)
        hidden = output.hidden_states
        return dataclasses.replace(
            output,
            next_token_logits=output.next_token_logits.index_select(0, index),
            hidden_states=(
                hidden.index_select(0, index)
                if hidden is not None and forward_batch.capture_hidden_states
                else None
            ),
        )
