"""PiecewiseCudaGraphRunner: EXTEND steps through CUDA graphs of the non-attention pieces.

After the design notes' ``init_piecewise_cuda_graphs`` / ``PiecewiseCudaGraphRunner`` (SGLang
splits the compiled forward at attention; here the split happens while capturing). For each
token-count bucket the runner runs the model's layers once under capture, and every attention
call *ends* the current graph and starts the next, so a model of ``L`` layers becomes ``L + 1``
graphs: embedding + first QKV/rotary, then ``o_proj`` + MLP + next QKV/rotary per layer, then
the final norm. The attention's inputs (q, k, v) are tensors the previous graph writes at fixed
addresses; its output goes to a static buffer the next graph reads.

A step of ``n`` tokens runs the smallest bucket ``>= n``: the token ids and positions are copied
into static buffers (rows ``n..bucket-1`` are padding: token 0 at position 0), then
``graph 0, attention 0, graph 1, ..., graph L``. Attention runs eagerly on the first ``n`` rows
with the real batch (its KV slots, lengths and prefix), so padded rows never touch the KV cache.
The logits of each request's last token are computed eagerly from the first ``n`` hidden rows.

On CPU (or ``capture=False``) the same static-buffer path runs eagerly, so CI checks the
padding and the split. Weight updates call :meth:`capture` again (``weight_update.py``).
Models qualify when they have the Llama-family layout (``model.embed_tokens``, ``model.layers``,
``model.norm``, ``lm_head``, ``logits_processor``). SPLIT_PREFILL steps and steps above the
largest bucket run eagerly; prompt logprobs are computed from the hidden rows as usual.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

import torch

from shardline_runtime.model_executor.forward_batch_info import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


def get_token_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture: 16, 32, 64, ... (powers of two) below ``max_tokens``, and it.

    Raises:
        ValueError: ``max_tokens`` < 1.
    """
    if max_tokens < 1:
        raise ValueError(f"piecewise_cuda_graph_max_tokens must be >= 1, got {max_tokens}")
    buckets, b = {max_tokens}, 16
    while b < max_tokens:
        buckets.add(b)
        b *= 2
    return sorted(buckets)


class _AttentionSplit:
    """The ``attn_backend`` the layers see inside the runner (see the module doc).

    mode ``warmup``: attention returns zeros (no KV writes). ``capture``: ends the current graph,
    records the call, starts the next. ``eager``: real attention on the first ``n`` rows.
    """

    def __init__(self, runner: PiecewiseCudaGraphRunner):
        self.runner = runner
        self.mode = "warmup"
        self.real_batch: ForwardBatch | None = None
        self.num_tokens = 0

    def forward(self, q, k, v, layer, forward_batch):
        q = q.reshape(-1, layer.tp_q_head_num * layer.head_dim)  # (T, Hq * D), split heads or not
        if self.mode == "warmup":
            return torch.zeros_like(q)
        if self.mode == "capture":
            return self.runner._split(q, k, v, layer)
        n = self.num_tokens
        out = torch.zeros_like(q)
        out[:n] = self.runner.backend.forward(q[:n], k[:n], v[:n], layer, self.real_batch)
        return out


class PiecewiseCudaGraphRunner:
    """Captures and replays the non-attention pieces of EXTEND steps of a ``ModelRunner``.

    Args:
        model_runner: provides ``model``, ``device``, ``attn_backend`` and ``args``
            (``graphs.piecewise_cuda_graph_max_tokens``).
        capture: capture real CUDA graphs; default: when the model runs on CUDA.
        token_buckets: override the captured token counts (default :func:`get_token_buckets`).

    Raises:
        ValueError: the model lacks the Llama-family layout.
    """

    def __init__(
        self, model_runner: Any, capture: bool | None = None, token_buckets: list[int] | None = None
    ):
        self.model_runner = model_runner
        self.device = torch.device(model_runner.device)
        self.use_graphs = self.device.type == "cuda" if capture is None else capture
        self.buckets = (
            sorted(token_buckets)
            if token_buckets
            else get_token_buckets(model_runner.args.graphs.piecewise_cuda_graph_max_tokens)
        )
        self.max_tokens = self.buckets[-1]
        model = model_runner.model
        for name in ("model", "lm_head", "logits_processor"):
            if not hasattr(model, name):
                raise ValueError(
                    f"piecewise CUDA graphs need a Llama-family model; {type(model).__name__} has no {name!r}"
                )
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=self.device)
        self.split = _AttentionSplit(self)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.attn_calls: dict[int, list[tuple]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graph_pool: Any = None
        self._pieces: list = []
        self._calls: list = []
        if self.use_graphs:
            self.capture()

    @property
    def backend(self):
        return self.model_runner.attn_backend

    def _static_batch(self, n: int) -> ForwardBatch:
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=0,
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            req_pool_indices=empty,
            seq_lens=empty,
            out_cache_loc=empty,
            attn_backend=self.split,
        )

    def _run_layers(self, n: int) -> torch.Tensor:
        """Embedding, every layer, final norm over the first ``n`` static rows -> (n, hidden)."""
        m = self.model_runner.model.model
        batch = self._static_batch(n)
        hidden, residual = m.embed_tokens(batch.input_ids), None
        for layer in m.layers:
            hidden, residual = layer(batch.positions, hidden, batch, residual)
        return m.norm(hidden) if residual is None else m.norm(hidden, residual)[0]

    # ---- capture ----------------------------------------------------------------------------

    def _split(self, q, k, v, layer):
        """Inside capture: close the current piece, record the attention call, open the next."""
        self._pieces[-1].capture_end()
        out = torch.zeros_like(q)  # outside any graph: a fixed buffer the next piece reads
        self._calls.append((layer, q, k, v, out))
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.graph_pool)
        self._pieces.append(graph)
        return out

    def capture(self) -> None:
        """(Re)capture every bucket, largest first, sharing one memory pool.

        Raises:
            RuntimeError: a piece cannot be captured; names the bucket and the flag to turn it off.
        """
        if not self.use_graphs:
            return
        self.graphs.clear()
        self.attn_calls.clear()
        self.outputs.clear()
        self.graph_pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for n in reversed(self.buckets):
                self.input_ids[:n] = 0
                self.positions[:n] = 0
                self.split.mode = "warmup"
                for _ in range(2):
                    self._run_layers(n)
                stream.synchronize()
                self.split.mode = "capture"
                self._pieces, self._calls = [torch.cuda.CUDAGraph()], []
                try:
                    self._pieces[0].capture_begin(pool=self.graph_pool)
                    out = self._run_layers(n)
                    self._pieces[-1].capture_end()
                except RuntimeError as exc:
                    raise RuntimeError(
                        f"piecewise CUDA graph capture failed at {n} tokens: {exc}. Start without "
                        "--enable-piecewise-cuda-graph (or lower --piecewise-cuda-graph-max-tokens)."
                    ) from exc
                finally:
                    self.split.mode = "warmup"
                self.graphs[n], self.attn_calls[n], self.outputs[n] = self._pieces, self._calls, out
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self._pieces, self._calls = [], []
        logger.info(
            "captured piecewise EXTEND graphs for %s tokens (%d pieces each)",
            self.buckets,
            len(next(iter(self.graphs.values()))) if self.graphs else 0,
        )

    def release_graphs(self) -> None:
        """Drop every captured piece and the tensors it holds (``capture`` builds them again)."""
        self.graphs.clear()
        self.attn_calls.clear()
        self.outputs.clear()
        self.graph_pool = None

    # ---- replay -----------------------------------------------------------------------------

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """True for an EXTEND step of 1..max_tokens tokens."""
        return (
            forward_batch.forward_mode == ForwardMode.EXTEND
            and 0 < forward_batch.num_tokens <= self.max_tokens
        )

    def bucket(self, num_tokens: int) -> int:
        """Smallest bucket >= ``num_tokens``.

        Raises:
            ValueError: ``num_tokens`` not in [1, max_tokens].
        """
        if not 1 <= num_tokens <= self.max_tokens:
            raise ValueError(
                f"token count must be in [1, {self.max_tokens}] for piecewise graphs, got {num_tokens}"
            )
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def replay(self, forward_batch: ForwardBatch):
        """Run an EXTEND batch through its bucket's pieces; returns the model's ``LogitsProcessorOutput``."""
        n = forward_batch.num_tokens
        padded = self.bucket(n)
        self.input_ids[:n].copy_(forward_batch.input_ids)
        self.positions[:n].copy_(forward_batch.positions)
        self.input_ids[n:padded] = 0
        self.positions[n:padded] = 0
        self.backend.init_forward_metadata(forward_batch)  # the start of this pass (real lengths)
        with torch.inference_mode():
            if self.use_graphs:
                pieces, calls = self.graphs[padded], self.attn_calls[padded]
                for i, piece in enumerate(pieces):
                    piece.replay()
                    if i < len(calls):
                        layer, q, k, v, out = calls[i]
                        out[:n].copy_(
                            self.backend.forward(q[:n], k[:n], v[:n], layer, forward_batch)
                        )
                hidden = self.outputs[padded][:n]
            else:
                self.split.mode, self.split.real_batch, self.split.num_tokens = (
                    "eager",
                    forward_batch,
                    n,
                )
                try:
                    hidden = self._run_layers(padded)[:n]
                finally:
                    self.split.mode, self.split.real_batch = "warmup", None
            model = self.model_runner.model
            return model.logits_processor(
                forward_batch.input_ids, hidden, model.lm_head, forward_batch
            )
