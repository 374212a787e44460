"""DeviceGraphs: the one owner of a ModelRunner's decode CUDA graphs and piecewise EXTEND graphs.

After mini-sglang's ``engine/graph.py`` ``GraphRunner`` (``can_use_cuda_graph``, ``replay``,
``destroy_cuda_graphs``, one owner). Every rule for when a graph may run sits here:

- never with ``rope_type: dynamic`` (its frequencies depend on each step's longest position, a
  host sync) - this keeps graphs from being captured at all (:func:`graphs_blocked_by`);
- under pipeline parallelism each stage captures its own decode graphs (the previous stage's
  proxy tensors are static buffers); piecewise graphs only with one stage;
- decode graphs for DECODE batches of at most ``cuda_graph_max_bs``, with LoRA (each row's
  adapter slot is a static buffer the segment kernel reads inside the graph) and while the
  expert-distribution recorder records (its counts are written into static buffers inside the
  graph; padded rows are masked out): ``graph_mode_buffers.py``;
- piecewise graphs for EXTEND steps of at most ``piecewise_cuda_graph_max_tokens`` tokens
  without caller-given input embeddings (a graph embeds the token ids itself), without LoRA and
  while nothing records (their pieces have no per-token adapter or mask buffers)
  (:func:`replay_kind`);
- verify graphs (``verify_graph_runner.py``) for speculative decoding's TARGET_VERIFY steps of at
  most the decode graphs' batch sizes and ``--speculative-num-draft-tokens`` tokens per request,
  without LoRA, with one stage and while nothing records; built beside the decode graphs (they
  share its padding row);
- a step whose hidden states are captured (EAGLE's features) replays decode and verify graphs
  (they always return them), never the piecewise ones;
- with ``--enable-torch-compile`` the decode runner runs the compiled forward for the sizes up
  to ``torch_compile_max_bs`` (``torch_compile.py``): inside the graphs on a GPU; on the CPU a
  runner that captures nothing pads decode batches up to that size and runs it on the static
  path (one compiled specialisation per padded size).

Life: :meth:`DeviceGraphs.build` captures at start-up (GPU only; the CPU runs eagerly),
:meth:`capture` captures again after a weight update, :meth:`release` / :meth:`resume` drop the
graphs while memory is released (``memory_saver.py``), :meth:`rebuild` applies new settings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from shardline_runtime.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    PPProxyTensors,
)
from shardline_runtime.weights_state import CapturedGraphs, WeightsPhase

if TYPE_CHECKING:
    from shardline_runtime.model_executor.cuda_graph_runner import CudaGraphRunner
    from shardline_runtime.model_executor.piecewise_cuda_graph_runner import (
        PiecewiseCudaGraphRunner,
    )
    from shardline_runtime.model_executor.torch_compile import CompiledDecode
    from shardline_runtime.model_executor.verify_graph_runner import VerifyGraphRunner
    from shardline_runtime.server_args_sections import GraphArgs

logger = logging.getLogger(__name__)

ReplayKind = Literal["decode", "piecewise", "verify"]


def graphs_blocked_by(dynamic_rope: bool) -> str | None:
    """Why no graph of either kind may run on a runner, or None.

    Args:
        dynamic_rope: the model's ``rope_type`` is ``dynamic``.
    """
    if dynamic_rope:
        return "rope_type 'dynamic' depends on each step's positions"
    return None


def replay_kind(
    mode: ForwardMode,
    *,
    pp_size: int = 1,
    lora: bool = False,
    dynamic_rope: bool = False,
    recording: bool = False,
    input_embeds: bool = False,
) -> ReplayKind | None:
    """Which kind of graph a step of ``mode`` may replay (``None``: run it eagerly); the batch
    must also fit the captured sizes (``can_run`` of that runner)."""
    if graphs_blocked_by(dynamic_rope):
        return None
    if mode.is_decode():
        return "decode"
    if input_embeds or lora or recording or pp_size > 1:
        return None
    if mode == ForwardMode.EXTEND:
        return "piecewise"
    if mode == ForwardMode.TARGET_VERIFY:
        return "verify"
    return None


class DeviceGraphs:
    """The decode and piecewise graph runners of one ``ModelRunner`` (either may be None).

    Args:
        runner: the ``ModelRunner`` (``device``, ``pp_size``, ``lora_manager``,
            ``model_config``, ``eplb_manager``, ``req_to_token_pool``, ``tp_rank``).
        decode: a :class:`CudaGraphRunner` (on CPU one built with ``capture=False`` runs the
            same static-buffer path eagerly).
        piecewise: a :class:`PiecewiseCudaGraphRunner`.
        verify: a :class:`VerifyGraphRunner` (speculative decoding's TARGET_VERIFY steps).
    """

    def __init__(
        self,
        runner: Any,
        decode: CudaGraphRunner | None = None,
        piecewise: PiecewiseCudaGraphRunner | None = None,
        verify: VerifyGraphRunner | None = None,
    ) -> None:
        self.runner = runner
        self.decode = decode
        self.piecewise = piecewise
        self.verify = verify
        self._released: tuple[Any, Any, Any] | None = None
        self.compiled: CompiledDecode | None = None  # --enable-torch-compile
        self.skipped: str | None = None  # why nothing was captured (see :meth:`report`)

    # ---- the rules ----------------------------------------------------------------------------

    def blocked_by(self) -> str | None:
        """:func:`graphs_blocked_by` for this runner."""
        r = self.runner
        if not r.model_config.is_generation:
            return "embedding model: EXTEND steps only, pooled eagerly"
        return graphs_blocked_by(r.model_config.rope_parameters["rope_type"] == "dynamic")

    def _recording(self) -> bool:
        eplb = self.runner.eplb_manager
        return eplb is not None and eplb.recorder.recording

    def try_replay(
        self, forward_batch: ForwardBatch, pp_proxy_tensors: PPProxyTensors | None = None
    ) -> Any | None:
        """Replay ``forward_batch`` through a graph when every rule allows it
        (``pp_proxy_tensors``: the previous stage's output, every stage but the first).

        Returns:
            the model's ``LogitsProcessorOutput`` (a stage that is not the last: its
            ``PPProxyTensors``), or None when the step must run eagerly.
        """
        r = self.runner
        kind = replay_kind(
            forward_batch.forward_mode,
            pp_size=r.pp_size,
            lora=r.lora_manager is not None,
            dynamic_rope=r.model_config.rope_parameters["rope_type"] == "dynamic",
            recording=self._recording(),
            input_embeds=forward_batch.input_embeds_indices is not None,
        )
        graphs: Any = {"decode": self.decode, "piecewise": self.piecewise, "verify": self.verify}
        graphs = graphs.get(kind) if kind else None
        # decode and verify graphs return the hidden states (EAGLE's features); pieces do not,
        # and no replay runs the hooks that record EAGLE3's aux-layer states
        eager_capture = kind == "piecewise" or getattr(r, "hidden_states_need_eager", False)
        if graphs is None or (forward_batch.capture_hidden_states and eager_capture):
            return None
        if not graphs.can_run(forward_batch):
            return None
        # only a decode graph of a stage after the first takes proxy tensors (piecewise: pp 1)
        proxy = () if pp_proxy_tensors is None else (pp_proxy_tensors,)
        output = graphs.replay(forward_batch, *proxy)
        if r.eplb_manager is not None:  # the graph recorded into the pass counts: close the pass
            r.eplb_manager.on_forward_pass_end()
        return output

    # ---- life ---------------------------------------------------------------------------------

    @classmethod
    def build(cls, runner: Any, settings: GraphArgs) -> DeviceGraphs:
        """Capture what ``settings`` ask for on a CUDA runner the rules allow (none on CPU)."""
        graphs = cls(runner)
        reason = graphs.blocked_by()
        wanted = not settings.disable_cuda_graph or settings.enable_piecewise_cuda_graph
        if runner.device.type != "cuda":
            graphs.skipped = f"{runner.device.type}: no CUDA graphs"
            if settings.enable_torch_compile and reason is None:
                graphs.decode = graphs._decode_runner(settings.torch_compile_max_bs, capture=False)
            return graphs
        if not wanted:
            graphs.skipped = "disabled by flag: --disable-cuda-graph"
            return graphs
        if reason is not None:
            logger.warning("[tp %d] CUDA graphs disabled: %s", runner.tp_rank, reason)
            graphs.skipped = reason
            return graphs
        from shardline_runtime.model_executor.piecewise_cuda_graph_runner import (
            PiecewiseCudaGraphRunner,
            get_token_buckets,
        )

        if not settings.disable_cuda_graph:
            graphs.decode = graphs._decode_runner(settings.cuda_graph_max_bs)
            graphs.verify = graphs.verify_runner(graphs.decode)
        if (
            settings.enable_piecewise_cuda_graph
            and runner.lora_manager is None
            and runner.pp_size == 1
        ):
            buckets = get_token_buckets(settings.piecewise_cuda_graph_max_tokens)
            graphs.piecewise = PiecewiseCudaGraphRunner(runner, token_buckets=buckets)
        return graphs

    def _decode_runner(self, max_bs: int, capture: bool | None = None) -> CudaGraphRunner:
        """A decode graph runner for the sizes up to ``max_bs``, with the torch.compile'd
        forward when ``--enable-torch-compile`` asks for it (``self.compiled``, built once)."""
        from shardline_runtime.model_executor.cuda_graph_runner import (
            CudaGraphRunner,
            get_batch_sizes_to_capture,
        )
        from shardline_runtime.model_executor.torch_compile import CompiledDecode

        r, settings = self.runner, self.runner.args.graphs
        if settings.enable_torch_compile and self.compiled is None:
            self.compiled = CompiledDecode(r.model, settings.torch_compile_max_bs, r.device)
        sizes = get_batch_sizes_to_capture(max_bs, r.args.memory.max_running_requests)
        return CudaGraphRunner(r, capture=capture, batch_sizes=sizes, compiled=self.compiled)

    def verify_runner(
        self, decode: CudaGraphRunner, capture: bool | None = None
    ) -> VerifyGraphRunner | None:
        """TARGET_VERIFY graphs of ``decode``'s batch sizes (and padding row) when this runner
        verifies speculative drafts (``--speculative-algorithm``), without LoRA and with one
        stage; else None (``capture=False``: the CPU static-buffer path)."""
        from shardline_runtime.model_executor.verify_graph_runner import VerifyGraphRunner

        r = self.runner
        spec = getattr(r.args, "speculative", None)
        if spec is None or not spec.enabled or r.lora_manager is not None or r.pp_size > 1:
            return None
        return VerifyGraphRunner(
            r,
            spec.speculative_num_draft_tokens,
            list(decode.capture_bs),
            decode.dummy_req_row,
            capture=capture,
        )

    @property
    def present(self) -> bool:
        """Whether any graph runner is held (captured, or the CPU static-buffer path)."""
        return any(g is not None for g in (self.decode, self.piecewise, self.verify))

    def report(self, draft: DeviceGraphs | None = None) -> CapturedGraphs:
        """What this runner really captured: the batch sizes and token buckets of its graphs
        (a runner on the CPU static-buffer path captured none), or why there are none; with
        speculative decoding also its verify graphs and ``draft``'s (the draft runner's) decode
        graphs, or why they are missing (``speculative_reason``)."""
        decode = sorted(self.decode.graphs) if self.decode is not None else []
        piecewise = sorted(self.piecewise.graphs) if self.piecewise is not None else []
        reason = None
        if not decode and not piecewise:
            reason = self.skipped or (
                "released with the GPU memory" if self._released else "no graph was captured"
            )
        compiled = (
            self.compiled.batch_sizes(self.decode.capture_bs)
            if self.compiled is not None and self.decode is not None
            else ()
        )
        verify = sorted(self.verify.graphs) if self.verify is not None else []
        drafted = sorted(draft.decode.graphs) if draft is not None and draft.decode else []
        spec = getattr(self.runner.args, "speculative", None)
        missing = []
        if spec is not None and spec.enabled and not verify:
            missing.append(f"verify: {reason or 'no graph was captured'}")
        if draft is not None and not drafted:
            why = draft.report().reason if draft.decode is None else "no graph was captured"
            missing.append(f"draft: {why}")
        return CapturedGraphs(
            decode_batch_sizes=tuple(decode),
            piecewise_token_buckets=tuple(piecewise),
            reason=reason,
            torch_compile_batch_sizes=compiled,
            verify_batch_sizes=tuple(verify),
            verify_tokens_per_request=self.verify.n if verify and self.verify else 0,
            draft_batch_sizes=tuple(drafted),
            speculative_reason="; ".join(missing) or None,
        )

    def capture(self) -> None:
        """Capture every held runner again (decode, the EXTEND pieces, verify), e.g. after a
        weight update that asks for it."""
        for graphs in (self.decode, self.piecewise, self.verify):
            if graphs is not None:
                graphs.capture()

    def release(self) -> None:
        """Drop the captured graphs and their memory pools; :meth:`resume` captures them again."""
        if not self.present:
            return
        self._released = (self.decode, self.piecewise, self.verify)
        for graphs in self._released:
            if graphs is not None:
                graphs.release_graphs()
        self.decode = self.piecewise = self.verify = None

    def resume(self) -> None:
        """Capture the graphs dropped by :meth:`release` again (a no-op when none were)."""
        if self._released is None:
            return
        self.decode, self.piecewise, self.verify = self._released
        self._released = None
        self.capture()

    def rebuild(
        self,
        cuda_graph_max_bs: int | None,
        disable: bool,
        on_phase: Callable[[WeightsPhase], None] | None = None,
    ) -> None:
        """New decode-graph settings (GPU only; the CPU runs eagerly): ``disable`` drops the
        decode graphs; a new ``cuda_graph_max_bs`` captures the sizes up to it
        (``on_phase(RECAPTURING)`` first). Frees the old runner's padding row."""
        r = self.runner
        reason = self.blocked_by()
        if r.device.type != "cuda" or reason is not None:
            return
        old = self.decode
        if old is not None and (disable or cuda_graph_max_bs is not None):
            r.req_to_token_pool.free(old.dummy_req_row)
            self.decode = self.verify = None  # the verify graphs used its padding row
        if disable:
            self.skipped = "disabled by the update request: disable_cuda_graph"
        if not disable and cuda_graph_max_bs is not None:
            if on_phase is not None:
                on_phase(WeightsPhase.RECAPTURING)
            self.decode = self._decode_runner(cuda_graph_max_bs)
            self.verify = self.verify_runner(self.decode)
            self.skipped = None
        logger.info(
            "[tp %d] CUDA graphs: %s",
            r.tp_rank,
            "disabled" if disable else f"max batch size {cuda_graph_max_bs}",
        )
