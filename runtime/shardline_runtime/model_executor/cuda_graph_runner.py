"""CudaGraphRunner: decode steps replayed from captured CUDA graphs, after SGLang.

A decode step of batch size ``bs`` runs the graph captured for the smallest captured size
``padded_bs >= bs``. Inputs are copied into static buffers (fixed addresses the graph reads);
rows ``bs..padded_bs-1`` are padding: token 0 at position 0, request row ``dummy_req_row``
(a ``req_to_token`` row this runner keeps, all pointing at the dummy KV slot 0), sequence length
1 and output slot 0. So padded rows read and write only the dummy slot and never touch a real
request's KV; their logits are dropped.

Before each replay (and capture) the attention backend is told that a pass starts and refills
its own static metadata from the static ``req_pool_indices`` / ``seq_lens`` (the triton
backend: ``kv_indptr`` / ``kv_indices`` of the real lengths; ``init_cuda_graph_state`` sized
them once), so nothing about lengths is baked into a graph.

Under pipeline parallelism each stage captures its own graphs: a stage that is not the first
copies the previous stage's ``PPProxyTensors`` (``hidden_states`` and ``residual``, (bs, hidden)
each) into static buffers the graph reads, and a stage that is not the last returns its own
``PPProxyTensors`` (the first ``bs`` rows, copied) instead of logits.

Every graph returns the hidden states its logits came from (``capture_hidden_states``: EAGLE
reads them from the target's decode steps), copied out only for a batch that asks. A model that
takes input features (the EAGLE head, ``takes_spec_features``: its chain steps) reads them from a
static (max_bs, hidden) buffer, padded rows zero.

On CPU (or with ``capture=False``) the very same static-buffer path runs eagerly, so the
padding and buffer logic is exercised by CI without a GPU; the real capture is a ``gpu`` test.
With ``--enable-torch-compile`` the step of a size the compiled forward covers runs it
(``torch_compile.py``): captured inside the graph on a GPU, on the static path on the CPU.

Because the graph reads the weights at fixed addresses, a weight update must copy new weights
into the existing parameter storage (``weight_update.py`` does) or call :meth:`capture` again.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import Any

import torch

from shardline_runtime.mem_cache.memory_pool import DUMMY_SLOT
from shardline_runtime.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    PPProxyTensors,
)
from shardline_runtime.model_executor.graph_mode_buffers import ModeBuffers
from shardline_runtime.model_executor.torch_compile import CompiledDecode

logger = logging.getLogger(__name__)


def get_batch_sizes_to_capture(
    cuda_graph_max_bs: int, max_running_requests: int | None = None
) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to the limit, plus the limit itself.

    Args:
        cuda_graph_max_bs: largest batch size to capture (>= 1).
        max_running_requests: optional cap (no batch is ever larger).

    Raises:
        ValueError: ``cuda_graph_max_bs`` < 1.
    """
    if cuda_graph_max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {cuda_graph_max_bs}")
    limit = (
        cuda_graph_max_bs
        if max_running_requests is None
        else min(cuda_graph_max_bs, max_running_requests)
    )
    sizes = {bs for bs in (1, 2, 4, 8) if bs <= limit} | set(range(16, limit + 1, 8)) | {limit}
    return sorted(sizes)


class CudaGraphRunner:
    """Captures and replays decode steps of a ``ModelRunner``.

    Args:
        model_runner: provides ``model``, ``device``, ``req_to_token_pool``,
            ``token_to_kv_pool``, ``attn_backend`` and ``args`` (``graphs.cuda_graph_max_bs``,
            ``memory.max_running_requests``).
        capture: capture real CUDA graphs; default: when the model runs on CUDA.
        batch_sizes: override the captured sizes (default :func:`get_batch_sizes_to_capture`).
        compiled: the torch.compile'd decode forward (``torch_compile.py``), run for the padded
            sizes it covers (inside the graphs on a GPU; on the CPU static path otherwise).

    Attributes:
        capture_bs: sorted captured batch sizes. max_bs: the largest.
        dummy_req_row: ``req_to_token`` row used by padded rows.

    Raises:
        RuntimeError: no free ``req_to_token`` row for the padding row.
    """

    def __init__(
        self,
        model_runner: Any,
        capture: bool | None = None,
        batch_sizes: list[int] | None = None,
        compiled: CompiledDecode | None = None,
    ):
        self.model_runner = model_runner
        self.compiled = compiled
        self.device = torch.device(model_runner.device)
        self.use_graphs = self.device.type == "cuda" if capture is None else capture
        args = model_runner.args
        self.capture_bs = (
            sorted(batch_sizes)
            if batch_sizes
            else get_batch_sizes_to_capture(
                args.graphs.cuda_graph_max_bs, args.memory.max_running_requests
            )
        )
        self.max_bs = self.capture_bs[-1]
        rows = model_runner.req_to_token_pool.alloc(1)
        if rows is None:
            raise RuntimeError(
                "CudaGraphRunner needs one free req_to_token row for padded graph rows"
            )
        self.dummy_req_row = rows[0]
        model_runner.req_to_token_pool.req_to_token[self.dummy_req_row] = DUMMY_SLOT

        def zeros():
            return torch.zeros(self.max_bs, dtype=torch.int64, device=self.device)

        self.input_ids, self.positions, self.out_cache_loc = zeros(), zeros(), zeros()
        self.req_pool_indices = zeros()
        self.seq_lens = zeros()
        self.modes = ModeBuffers(model_runner, self.max_bs, self.device)  # LoRA, recorder
        hidden_size = model_runner.model_config.hidden_size
        self.features: torch.Tensor | None = (  # an EAGLE head's input features, static
            torch.zeros(self.max_bs, hidden_size, dtype=model_runner.dtype, device=self.device)
            if getattr(model_runner.model, "takes_spec_features", False)
            else None
        )
        stage = getattr(model_runner, "pipeline_stage", None)
        hidden = (self.max_bs, model_runner.model_config.hidden_size)
        self.proxy: dict[str, torch.Tensor] | None = (  # the previous stage's output, static
            None
            if stage is None or stage.is_first
            else {
                name: torch.zeros(hidden, dtype=model_runner.dtype, device=self.device)
                for name in ("hidden_states", "residual")
            }
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Any] = {}
        self.graph_pool: Any = None  # the first graph's memory pool, shared by the others
        model_runner.attn_backend.init_cuda_graph_state(self.max_bs)
        if self.use_graphs:
            self.capture()

    # ---- buffers ------------------------------------------------------------------------------

    def _fill_padding(self, start: int, end: int) -> None:
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.out_cache_loc[start:end] = DUMMY_SLOT
        self.req_pool_indices[start:end] = self.dummy_req_row
        self.seq_lens[start:end] = 1
        self.modes.fill_padding(start, end)
        if self.features is not None:
            self.features[start:end] = 0

    def _static_batch(self, bs: int) -> ForwardBatch:
        """A DECODE ForwardBatch whose tensors are views of the first ``bs`` buffer rows; it
        carries no ``*_cpu`` lists, so nothing in the step can depend on Python-side lengths."""
        runner = self.model_runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool=runner.token_to_kv_pool,
            attn_backend=runner.attn_backend,
            capture_hidden_states=True,
            spec_hidden_states=None if self.features is None else self.features[:bs],
        )

    def _run_model(self, forward_batch: ForwardBatch):
        bs = forward_batch.batch_size
        extra = (
            {}
            if self.proxy is None
            else {"pp_proxy_tensors": PPProxyTensors({k: v[:bs] for k, v in self.proxy.items()})}
        )
        forward = self.model_runner.model.forward
        if self.compiled is not None and self.compiled.covers(bs):
            forward = self.compiled.forward
        return forward(forward_batch.input_ids, forward_batch.positions, forward_batch, **extra)

    # ---- capture / replay ---------------------------------------------------------------------

    def capture(self) -> None:
        """(Re)capture one graph per size in ``capture_bs``, largest first (sharing one memory
        pool). Called at start-up and after a weight update that asks for recapture.

        Raises:
            RuntimeError: a step cannot be captured (e.g. it synchronises with the host); the
                message names the batch size and the flag to run eagerly instead.
        """
        if not self.use_graphs:
            return
        self.graphs.clear()
        self.outputs.clear()
        backend = self.model_runner.attn_backend
        stream = torch.cuda.Stream(device=self.device)
        with torch.inference_mode():
            for bs in reversed(self.capture_bs):
                self._fill_padding(0, bs)
                batch = self._static_batch(bs)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream), self.modes.bound(bs):
                    for _ in range(
                        2
                    ):  # warm up: lazy inits and allocator state happen outside the graph
                        backend.init_forward_metadata_capture_cuda_graph(
                            bs, self.req_pool_indices, self.seq_lens
                        )
                        self._run_model(batch)
                    backend.init_forward_metadata_capture_cuda_graph(
                        bs, self.req_pool_indices, self.seq_lens
                    )
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                try:
                    with (
                        torch.cuda.graph(graph, pool=self.graph_pool, stream=stream),
                        self.modes.bound(bs),
                    ):
                        output = self._run_model(batch)
                except RuntimeError as exc:
                    raise RuntimeError(
                        f"CUDA graph capture of the decode step failed at batch size {bs}: {exc}. "
                        "Start with --disable-cuda-graph (or lower --cuda-graph-max-bs) to run eagerly."
                    ) from exc
                if self.graph_pool is None:
                    self.graph_pool = graph.pool()
                self.graphs[bs] = graph
                self.outputs[bs] = output
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.capture_bs)

    def release_graphs(self) -> None:
        """Drop every captured graph, its output and the memory pool (``capture`` builds them again)."""
        self.graphs.clear()
        self.outputs.clear()
        self.graph_pool = None

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """True for a DECODE batch of at most ``max_bs`` requests (with its input features
        when the model takes them)."""
        return (
            forward_batch.forward_mode.is_decode()
            and 0 < forward_batch.batch_size <= self.max_bs
            and (
                self.features is None
                or (
                    forward_batch.spec_hidden_states is not None
                    # EAGLE3's first chain step takes its (bs, 3 * hidden) aux states: eager
                    and forward_batch.spec_hidden_states.shape[-1] == self.features.shape[-1]
                )
            )
        )

    def padded_batch_size(self, bs: int) -> int:
        """Smallest captured size >= ``bs``.

        Raises:
            ValueError: ``bs`` is not in [1, max_bs].
        """
        if not 1 <= bs <= self.max_bs:
            raise ValueError(f"batch size must be in [1, {self.max_bs}] for graph replay, got {bs}")
        return self.capture_bs[bisect.bisect_left(self.capture_bs, bs)]

    def replay(self, forward_batch: ForwardBatch, pp_proxy_tensors: PPProxyTensors | None = None):
        """Run a DECODE batch through its padded graph (or the same static path eagerly);
        ``pp_proxy_tensors``: the previous stage's output (every stage but the first).

        Returns:
            The model's ``LogitsProcessorOutput`` with ``next_token_logits`` cut to the real
            ``bs`` rows ((bs, vocab) float32, a copy, so the next replay cannot overwrite it)
            and, when the batch asks, ``hidden_states`` (bs, hidden) (a copy),
            or on a stage that is not the last its ``PPProxyTensors`` (the ``bs`` rows, copied).
        """
        bs = forward_batch.batch_size
        padded = self.padded_batch_size(bs)
        self.input_ids[:bs].copy_(forward_batch.input_ids)
        self.positions[:bs].copy_(forward_batch.positions)
        self.out_cache_loc[:bs].copy_(forward_batch.out_cache_loc)
        self.req_pool_indices[:bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:bs].copy_(forward_batch.seq_lens)
        self._fill_padding(bs, padded)
        if self.features is not None:
            assert forward_batch.spec_hidden_states is not None  # can_run
            self.features[:bs].copy_(forward_batch.spec_hidden_states)
        self.modes.fill(forward_batch.lora_names, bs, padded)
        if self.proxy is not None:
            assert pp_proxy_tensors is not None, "a stage after the first needs the proxy tensors"
            for name, buffer in self.proxy.items():
                buffer[:bs].copy_(pp_proxy_tensors[name])
                buffer[bs:padded].zero_()
        # The start of this pass: the backend refills its static metadata from the static
        # buffers (the triton backend: kv_indptr / kv_indices of the real lengths).
        self.model_runner.attn_backend.init_forward_metadata_replay_cuda_graph(
            padded, self.req_pool_indices, self.seq_lens
        )
        if self.use_graphs:
            self.graphs[padded].replay()
            output = self.outputs[padded]
        else:
            with torch.inference_mode(), self.modes.bound(padded):
                output = self._run_model(self._static_batch(padded))
        if isinstance(output, PPProxyTensors):
            return PPProxyTensors({k: v[:bs].clone() for k, v in output.tensors.items()})
        hidden = output.hidden_states
        return dataclasses.replace(
            output,
            next_token_logits=output.next_token_logits[:bs].clone(),
            hidden_states=(
                hidden[:bs].clone()
                if hidden is not None and forward_batch.capture_hidden_states
                else None
            ),
        )
