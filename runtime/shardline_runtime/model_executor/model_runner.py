"""ModelRunner: one rank's model, KV pools, attention backend and graphs, and one step of it.

A rank is one TP rank of one pipeline stage: it holds the stage's layers (``pipeline_stage``),
its TP shard of them, and KV for those layers only.

Life (the design notes' order, after SGLang's ``ModelRunner``): parse the config and refuse
impossible TP / PP layouts before reading any weight -> ``init_torch_distributed`` (join the groups,
measure the free memory *before* loading) -> the forward stream -> ``initialize``: sampler -> load
the weights (this rank's shards; then Shardline's EPLB manager for MoE models) -> KV cache dtype
-> (Shardline: the LoRA manager, which must wrap the layers before graphs are captured) -> KV
pools sized from the pre-load free memory (``model_runner_kv_cache.py``) -> attention backend ->
decode CUDA graphs (``CudaGraphRunner``) -> piecewise CUDA graphs for EXTEND
(``model_runner_graphs.py``, which also rebuilds the graphs for new settings).

One step: :meth:`ModelRunner.forward_and_sample` runs :meth:`forward` (graph replay or eager,
by ``ForwardMode``) and :meth:`sample` (the only sampling path: rows that want a token, logprobs,
penalty counts, the TP broadcast of the result) and returns one ``GenerationBatchResult``. On a
pipeline stage that is not the last it returns the stage's ``PPProxyTensors`` unsampled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shardline_runtime import distributed
from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.configs.pipeline_stage import PipelineStage
from shardline_runtime.layers.logits_processor import LogitsProcessorOutput
from shardline_runtime.layers.sampler import Sampler
from shardline_runtime.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    PPProxyTensors,
)
from shardline_runtime.model_executor.generation_result import GenerationBatchResult
from shardline_runtime.model_executor.memory_saver import MemorySaver
from shardline_runtime.model_executor.model_runner_config import (
    DEVICES,
    ModelRunnerConfig,
    resolve_device,
)
from shardline_runtime.model_executor.model_runner_graphs import ModelRunnerGraphsMixin
from shardline_runtime.model_executor.model_runner_kv_cache import (
    KVCacheMemoryError,
    ModelRunnerKVCacheMixin,
)
from shardline_runtime.model_executor.weight_update import WeightsPhase, update_weights_from_disk

if TYPE_CHECKING:
    from shardline_runtime.model_executor.cuda_graph_runner import CudaGraphRunner
    from shardline_runtime.model_executor.piecewise_cuda_graph_runner import (
        PiecewiseCudaGraphRunner,
    )
    from shardline_runtime.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

__all__ = ["DEVICES", "KVCacheMemoryError", "ModelRunner", "ModelRunnerConfig", "resolve_device"]


class ModelRunner(ModelRunnerKVCacheMixin, ModelRunnerGraphsMixin):
    """Runs the model of one TP rank.

    Attributes set by the constructor: ``model_config``, ``device``, ``dtype``, ``tp_rank``,
    ``tp_size``, ``is_generation``, ``forward_pass_id`` (steps run so far, monotonic),
    ``forward_stream`` (the CUDA stream the overlap scheduler runs steps on; None on CPU),
    ``model``, ``max_total_num_tokens``, ``req_to_token_pool``, ``token_to_kv_pool``,
    ``token_to_kv_pool_allocator``, ``attn_backend``, ``cuda_graph_runner`` and
    ``piecewise_cuda_graph_runner`` (None unless captured), ``sampler``, ``memory_saver``
    (release/resume of weights, KV cache and graphs; ``model_executor/memory_saver.py``).

    Raises (from the constructor):
        ModelConfigError: config.json is invalid or the head count does not fit ``tp_size``
            (before any weight is read).
        CheckpointError: a shard is missing/short or a parameter is missing/unexpected.
        KVCacheMemoryError: no memory is left for the KV cache.
    """

    model: LlamaForCausalLM
    cuda_graph_runner: CudaGraphRunner | None
    piecewise_cuda_graph_runner: PiecewiseCudaGraphRunner | None

    def __init__(self, config: ModelRunnerConfig, model_config: ModelConfig | None = None):
        self.config = config
        self.tp_rank = config.tp_rank
        self.tp_size = config.tp_size
        self.pp_rank = config.pp_rank
        self.pp_size = config.pp_size
        self.device = resolve_device(config.device, config.local_rank)
        if model_config is None:
            model_config = ModelConfig.from_pretrained(
                config.model_path,
                dtype=config.dtype,
                context_length=config.context_length,
                device_type=self.device.type,
            )
        self.model_config = model_config
        self.model_config.check_tp_size(self.tp_size)
        self.model_config.check_ep_size(
            self.tp_size, config.ep_size, config.ep_num_redundant_experts
        )
        # raises PipelineLayoutError (fewer layers than stages, a bad partition) before the rendezvous
        self.pipeline_stage = PipelineStage.for_rank(
            self.model_config.num_hidden_layers,
            self.pp_rank,
            self.pp_size,
            config.pp_layer_partition,
        )
        self.dtype = self.model_config.dtype
        # Every architecture of models/registry.py is a causal LM that samples tokens (SGLang's
        # is_generation); an embedding or reward model would be False and never sample.
        self.is_generation = True
        self.forward_pass_id = 0
        pre_model_load_memory = self.init_torch_distributed()
        self.forward_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        torch.manual_seed(config.random_seed)
        self.memory_saver = MemorySaver(
            self, config.enable_weights_cpu_backup, config.enable_memory_saver
        )
        self.initialize(pre_model_load_memory)

    def init_torch_distributed(self) -> int:
        """Join the world, its TP and PP groups (and the expert-parallel layout); returns the
        bytes free before loading."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        distributed.init_distributed_environment(
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            device=self.device,
            dist_init_addr=self.config.dist_init_addr,
            timeout_s=self.config.dist_timeout,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
        )
        distributed.init_expert_parallel(self.config.ep_size, self.config.ep_num_redundant_experts)
        return self._memory_available()

    def initialize(self, pre_model_load_memory: int) -> None:
        """The design notes' order: sampler, model (+ EPLB manager for MoE models), KV dtype,
        (LoRA), pool, backend, graphs, piecewise graphs."""
        self.sampler = self._make_sampler()
        with self.memory_saver.region("weights"):
            self.load_model()
        self.init_eplb_manager()
        self.configure_kv_cache_dtype()
        self.init_lora_manager()
        with self.memory_saver.region("kv_cache"):
            self.init_memory_pool(pre_model_load_memory)
        self.init_attention_backend()
        self.cuda_graph_runner = None
        self.piecewise_cuda_graph_runner = None
        self.init_device_graphs()
        self.init_piecewise_cuda_graphs()

    @property
    def sliding_window_size(self) -> int | None:
        """Tokens a windowed attention layer sees (the largest window when layers differ), or
        None when no layer has a sliding window."""
        windows = [w for w in self.model_config.sliding_windows if w is not None]
        return max(windows) if windows else None

    # ---- construction -------------------------------------------------------------------------

    def _make_sampler(self) -> Sampler:
        """The sampler; at tp_size > 1 its token ids are broadcast from TP rank 0 on the device
        group (so no rank can diverge, and no host round trip is added)."""
        if self.tp_size == 1:
            return Sampler()
        return Sampler(broadcast=lambda ids: distributed.broadcast_tensor(ids, src=0))

    def load_model(self) -> None:
        """Build the model for this rank's shard and load its weights from ``model_path``."""
        from shardline_runtime.model_loader.loader import load_model

        before = self._memory_available()
        self.model = load_model(
            self.model_config, self.model_config.model_path, self.device, stage=self.pipeline_stage
        )
        self.model_config = self.model.config
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        stage = self.pipeline_stage
        logger.info(
            "[tp %d, pp %d] loaded %s layers [%d, %d): %.1f MiB of weights on this rank (available %.1f MiB before)",
            self.tp_rank,
            self.pp_rank,
            self.model_config.architecture,
            stage.start_layer,
            stage.start_layer + self.num_stage_layers,
            self.weight_bytes / 2**20,
            before / 2**20,
        )

    def init_eplb_manager(self) -> None:
        """``eplb_manager`` (expert-distribution recorder and EPLB) for MoE models, else None."""
        from shardline_runtime.model_executor.eplb_manager import EPLBManager

        self.eplb_manager = EPLBManager.for_model(
            self.model,
            self.model_config.num_hidden_layers,
            self.device,
            rebalance_num_iterations=self.config.eplb_rebalance_num_iterations,
            recorder_dir=self.config.expert_distribution_recorder_dir,
        )

    def init_lora_manager(self) -> None:
        """``lora_manager`` (``lora/lora_manager.py``) with ``--lora-paths`` loaded, or None
        without ``--enable-lora``. Raises LoRAAdapterError for a bad start-up adapter."""
        self.lora_manager = None
        if not self.config.enable_lora:
            return
        from shardline_runtime.lora.lora_config import (
            LoRAConfig,
            parse_lora_paths,
            resolve_target_modules,
        )
        from shardline_runtime.lora.lora_manager import LoRAManager

        paths = parse_lora_paths(list(self.config.lora_paths))
        max_rank = self.config.max_lora_rank or max(
            [LoRAConfig.from_path(p).r for p in paths.values()] or [16]
        )
        self.lora_manager = LoRAManager(
            self.model,
            self.config.max_loras_per_batch,
            max_rank,
            resolve_target_modules(list(self.config.lora_target_modules)),
        )
        for name, path in paths.items():
            self.lora_manager.load_adapter(name, path)

    def init_attention_backend(self) -> None:
        """Create the backend ``--attention-backend`` names (auto: triton on CUDA, torch_native on CPU)."""
        from shardline_runtime.attention.registry import (
            create_attention_backend,
            resolve_attention_backend,
        )

        self.attention_backend_name = resolve_attention_backend(
            self.config.attention_backend, self.device
        )
        self.attn_backend = create_attention_backend(self.attention_backend_name, self)

    # ---- one step -----------------------------------------------------------------------------

    def forward_and_sample(
        self, forward_batch: ForwardBatch, pp_proxy_tensors: PPProxyTensors | None = None
    ) -> GenerationBatchResult:
        """Run one step and sample; the one path the worker calls.

        ``pp_proxy_tensors``: the previous pipeline stage's output (every stage but the first).

        Returns:
            a :class:`GenerationBatchResult` whose sampled ids and logprobs are still on the
            device (call ``copy_to_cpu()`` and ``wait()`` before reading them); on a stage that is
            not the last, one with ``pp_hidden_states_proxy_tensors`` and nothing sampled.

        Raises:
            ValueError: the step stops before the stage's last layer (a partial SPLIT_PREFILL).
        """
        output = self.forward(forward_batch, pp_proxy_tensors)
        if output is None:
            raise ValueError(
                "forward_and_sample needs a step that reaches the last layer (not a partial SPLIT_PREFILL)"
            )
        if isinstance(output, PPProxyTensors):
            return GenerationBatchResult(None, forward_batch, pp_hidden_states_proxy_tensors=output)
        return self.sample(output, forward_batch)

    def forward(
        self, forward_batch: ForwardBatch, pp_proxy_tensors: PPProxyTensors | None = None
    ) -> LogitsProcessorOutput | PPProxyTensors | None:
        """Run one step; dispatches on ``forward_batch.forward_mode`` (increments ``forward_pass_id``).

        A decode batch that fits a captured graph replays it, an EXTEND that fits a piecewise
        bucket replays its pieces; everything else (DECODE, EXTEND, IDLE, SPLIT_PREFILL) runs
        the model eagerly. Returns the logits of the last token of each request (``None`` from
        a SPLIT_PREFILL call that does not reach the last layer; SPLIT_PREFILL carries hidden
        states in ``forward_batch.split_hidden_states`` between calls). With pipeline
        parallelism a stage that is not the last returns its ``PPProxyTensors`` (no graphs).

        Raises:
            ValueError: an unknown ``forward_mode``.
        """
        mode = forward_batch.forward_mode
        if not isinstance(mode, ForwardMode):
            raise ValueError(
                f"unknown forward_mode {mode!r}; allowed: {[m.name for m in ForwardMode]}"
            )
        self.forward_pass_id += 1
        if self.pp_size > 1:
            return self._forward_eager(forward_batch, pp_proxy_tensors)
        recording = (
            self.eplb_manager is not None and self.eplb_manager.recorder.recording
        )  # graphs do not record
        graphs = self.cuda_graph_runner
        if (
            mode.is_decode()
            and graphs is not None
            and not recording
            and graphs.can_run(forward_batch)
        ):
            return graphs.replay(forward_batch)
        pieces = self.piecewise_cuda_graph_runner
        # a graph embeds the token ids itself: caller-given embeddings run eagerly
        if (
            mode == ForwardMode.EXTEND
            and pieces is not None
            and not recording
            and forward_batch.input_embeds_indices is None
            and pieces.can_run(forward_batch)
        ):
            return pieces.replay(forward_batch)
        return self._forward_eager(forward_batch)

    def _forward_eager(
        self, forward_batch: ForwardBatch, pp_proxy_tensors: PPProxyTensors | None = None
    ):
        if self.lora_manager is not None:
            per_req = (
                forward_batch.extend_seq_lens_cpu
                if forward_batch.forward_mode.is_extend()
                else None
            )
            per_req = per_req or [1] * forward_batch.batch_size
            self.lora_manager.prepare_lora_batch(forward_batch.lora_names, per_req)
        self.attn_backend.init_forward_metadata(forward_batch)
        with torch.inference_mode():
            embeds = self.input_embeds(forward_batch)
            # the layer-range path of SPLIT_PREFILL is the model's own method, beside its plain forward
            run = (
                self.model.forward_split_prefill
                if forward_batch.forward_mode.is_split_prefill()
                else self.model.forward
            )
            out = run(
                forward_batch.input_ids,
                forward_batch.positions,
                forward_batch,
                input_embeds=embeds,
                pp_proxy_tensors=pp_proxy_tensors,
            )
        if self.eplb_manager is not None:
            self.eplb_manager.on_forward_pass_end()
        return out

    def input_embeds(self, forward_batch: ForwardBatch) -> torch.Tensor | None:
        """(T, hidden_size): the token embeddings with rows ``input_embeds_indices`` replaced by
        ``input_embeds_values`` (the placeholder mechanism of multimodal models), or None."""
        if (
            forward_batch.input_embeds_indices is None
            or forward_batch.input_embeds_values is None
            or not self.pipeline_stage.is_first
        ):
            return None
        embeds = self.model.get_input_embeddings()(forward_batch.input_ids)  # (T, hidden)
        rows = forward_batch.input_embeds_indices.to(self.device)
        embeds[rows] = forward_batch.input_embeds_values.to(device=self.device, dtype=embeds.dtype)
        return embeds

    def sample(
        self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch
    ) -> GenerationBatchResult:
        """Draw one token for each row that wants one; the only sampling path.

        Rows with ``forward_batch.wants_token[i] == False`` (intermediate chunks,
        ``max_new_tokens == 0``) get -1. Logprobs (raw, see ``layers/sampler.py``) for rows
        with ``return_logprobs[i]``, top logprobs for ``top_logprobs_nums[i] > 0``. Penalty
        counts of the sampled rows are updated. At tp_size > 1 the token ids and their logprobs
        are broadcast from TP rank 0 on the device group, so every rank holds the same result.

        Returns:
            :class:`GenerationBatchResult` with ``next_token_ids`` (bs,) int64 on the device.
        """
        bs = forward_batch.batch_size
        wants = forward_batch.wants_token
        rows = list(range(bs)) if wants is None else [i for i, w in enumerate(wants) if w]
        result = GenerationBatchResult(
            logits_output=logits_output, forward_batch=forward_batch, sampled_rows=rows
        )
        result.next_token_ids = torch.full((bs,), -1, dtype=torch.int64, device=self.device)
        if not rows:
            return result
        info = forward_batch.sampling_info
        if len(rows) < bs:
            info = info.copy_rows(rows)
        row_index = torch.tensor(rows, device=self.device)
        logits = logits_output.next_token_logits
        if len(rows) < bs:
            logits = logits[row_index]
        asked = forward_batch.return_logprobs or [False] * bs
        result.logprob_rows = [asked[i] for i in rows]
        nums = forward_batch.top_logprobs_nums or [0] * bs
        result.top_logprobs_nums = [nums[i] if asked[i] else 0 for i in rows]
        top_nums = result.top_logprobs_nums if any(result.top_logprobs_nums) else None
        out = self.sampler(logits, info, any(result.logprob_rows), top_nums)
        if out.next_token_logprobs is not None and self.tp_size > 1:
            distributed.broadcast_tensor(out.next_token_logprobs, src=0)
        if forward_batch.sampling_info.penalties is not None:
            forward_batch.sampling_info.penalties.cumulate_output_tokens(
                out.next_token_ids, row_index
            )
        result.next_token_ids[row_index] = out.next_token_ids
        result.sampled_logprobs = out.next_token_logprobs
        result.top_values, result.top_indices = out.top_logprobs_val, out.top_logprobs_idx
        return result

    # ---- weights ------------------------------------------------------------------------------

    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str = "auto",
        recapture_cuda_graph: bool = True,
        on_phase: Callable[[WeightsPhase], None] | None = None,
    ) -> tuple[bool, str]:
        """Load new weights in place on every rank (all or nothing); see ``weight_update.py``.

        Args:
            recapture_cuda_graph: capture the decode and piecewise graphs again after the copy
                (the HTTP API's default, DESIGN 2.4).
            on_phase: called with each :class:`WeightsPhase` as it begins.

        Returns:
            ``(success, message)``; on failure the old weights keep serving.
        """
        return update_weights_from_disk(
            self,
            model_path,
            load_format=load_format,
            recapture_cuda_graph=recapture_cuda_graph,
            on_phase=on_phase,
        )
