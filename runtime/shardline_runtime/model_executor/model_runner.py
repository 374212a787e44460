"""ModelRunner: one rank's model, KV pools, attention backend and graphs, and one step of it.

A rank is one TP rank of one pipeline stage: the stage's layers (``pipeline_stage``), its TP
shard of them, and KV for those layers only. Life (the design notes' order, after SGLang's
``ModelRunner``): refuse impossible TP / PP layouts before reading any weight -> join the groups
and measure the free memory *before* loading -> sampler -> weights (then the EPLB manager of MoE
models) -> KV cache dtype and fp8 scales -> LoRA manager (it wraps the layers before graphs are
captured) -> ``build_kv_pools`` (``kv_pools.py``) -> attention backend -> ``DeviceGraphs.build``
(``device_graphs.py``, the one owner of the graphs and of the rules for when they run).

One step: :meth:`ModelRunner.forward_and_sample` runs :meth:`forward` (a graph replay, else
``model_forward.forward_eager``) and :meth:`sample` (``sample_step.sample_batch``) and returns
one ``GenerationBatchResult``; a pipeline stage that is not the last returns its
``PPProxyTensors`` unsampled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shardline_runtime import distributed
from shardline_runtime.configs.model_config import ModelConfig, ModelConfigError
from shardline_runtime.configs.pipeline_stage import PipelineStage
from shardline_runtime.configs.pooling_config import model_kind_problem
from shardline_runtime.layers.logits_processor import LogitsProcessorOutput
from shardline_runtime.layers.pooler import EmbeddingPoolerOutput
from shardline_runtime.layers.sampler import Sampler
from shardline_runtime.model_executor.device_graphs import DeviceGraphs
from shardline_runtime.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    PPProxyTensors,
)
from shardline_runtime.model_executor.generation_result import GenerationBatchResult
from shardline_runtime.model_executor.host_decode_inputs import HostDecodeInputs
from shardline_runtime.model_executor.kv_cache_dtype import configure_kv_cache_dtype
from shardline_runtime.model_executor.kv_pools import (
    CPU_KV_CACHE_BYTES,
    KVCacheMemoryError,
    build_kv_pools,
    memory_available,
    stage_layers,
)
from shardline_runtime.model_executor.memory_saver import MemorySaver
from shardline_runtime.model_executor.model_forward import forward_eager
from shardline_runtime.model_executor.sample_step import sample_batch
from shardline_runtime.model_executor.verify_step import verify_batch
from shardline_runtime.model_executor.weight_staging import StagedWeights
from shardline_runtime.model_executor.weight_update import update_weights_from_disk
from shardline_runtime.weights_state import WeightsPhase

if TYPE_CHECKING:
    from shardline_runtime.models.llama import LlamaForCausalLM
    from shardline_runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

__all__ = ["KVCacheMemoryError", "ModelRunner"]


def _broadcast_from_rank0(ids: torch.Tensor) -> torch.Tensor:
    return distributed.broadcast_tensor(ids, src=0)


class ModelRunner:
    """Runs the model of TP rank ``tp_rank`` of pipeline stage ``pp_rank``.

    Args:
        args: the server arguments; the runner reads the ``model``, ``parallel``, ``memory``,
            ``experts``, ``graphs``, ``lora`` and ``weight_sync`` sections.
        model_config: an already parsed config (default: parsed from ``args.model``).
        cpu_kv_cache_bytes: the KV budget on the CPU without ``max_total_tokens`` (bytes).

    Attributes: ``model_config``, ``device``, ``dtype``, ``tp_rank``/``tp_size``,
    ``pp_rank``/``pp_size``, ``forward_pass_id`` (steps run, monotonic), ``forward_stream``
    (the overlap scheduler's CUDA stream; None on CPU), ``host_decode_inputs`` (CPU decode
    steps' index buffers, :class:`HostDecodeInputs`; None elsewhere), ``model``, ``kv_cache_dtype``,
    ``max_total_num_tokens`` and the three pools (from :func:`build_kv_pools`),
    ``attn_backend``, ``graphs`` (:class:`DeviceGraphs`), ``sampler``, ``lora_manager``,
    ``eplb_manager``, ``memory_saver`` (release/resume of weights, KV cache and graphs).

    Raises (from the constructor): ValueError (a rank outside the layout), ModelConfigError
    (bad config.json, a checkpoint of another kind than ``--model-kind``, or a head count that
    does not fit ``tp_size``) and PipelineLayoutError,
    both before any weight is read; CheckpointError (a missing or short shard or parameter);
    KVCacheMemoryError (no memory left for the KV cache).
    """

    model: LlamaForCausalLM

    def __init__(
        self,
        args: ServerArgs,
        tp_rank: int = 0,
        pp_rank: int = 0,
        *,
        model_config: ModelConfig | None = None,
        cpu_kv_cache_bytes: int = CPU_KV_CACHE_BYTES,
    ):
        self.args = args
        par = args.parallel
        self.tp_rank, self.pp_rank = tp_rank, pp_rank
        self.tp_size, self.pp_size = par.tp_size, par.pp_size
        self.cpu_kv_cache_bytes = cpu_kv_cache_bytes
        self.device = par.torch_device(tp_rank, pp_rank)
        if model_config is None:
            model_config = ModelConfig.from_pretrained(
                args.model.model_path,
                dtype=args.model.dtype,
                context_length=args.model.context_length,
                device_type=self.device.type,
                quantization=args.model.quantization,
            )
        self.model_config = model_config
        kind_problem = model_kind_problem(args.model.model_kind, model_config.pooling)
        if kind_problem is not None:
            raise ModelConfigError(f"{model_config.model_path}: {kind_problem}")
        self.model_config.check_tp_size(self.tp_size)
        self.model_config.check_ep_size(
            self.tp_size, par.ep_size, args.experts.ep_num_redundant_experts
        )
        # raises PipelineLayoutError before the rendezvous
        self.pipeline_stage = PipelineStage.for_rank(
            self.model_config.num_hidden_layers, pp_rank, self.pp_size, par.pp_layer_partition
        )
        self.dtype = self.model_config.dtype
        # SGLang's flag: False for an embedding model (sentence-transformers files in the checkpoint)
        self.is_generation = self.model_config.is_generation
        self.forward_pass_id = 0
        # EAGLE: called as sink(forward_batch, hidden_states (T, hidden)) after every step that
        # reaches the logits, with the states the logits came from (the draft's features)
        self.hidden_states_sink: Callable[[ForwardBatch, torch.Tensor], None] | None = None
        # True when the sink's states come from Python hooks (EAGLE3's aux layers), which a graph
        # replay does not run: steps that capture then run eagerly (DeviceGraphs.try_replay)
        self.hidden_states_need_eager = False
        pre_model_load_memory = self.init_torch_distributed()
        self.forward_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # CPU decode steps' index tensors, written into buffers allocated once (issue 24)
        self.host_decode_inputs = HostDecodeInputs() if self.device.type == "cpu" else None
        torch.manual_seed(args.operation.random_seed)
        sync = args.weight_sync
        self.memory_saver = MemorySaver(
            self, sync.enable_weights_cpu_backup, sync.enable_memory_saver
        )
        self.initialize(pre_model_load_memory)

    def init_torch_distributed(self) -> int:
        """Join the world, its TP and PP groups (and the expert-parallel layout); returns the
        bytes free before loading."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        par = self.args.parallel
        distributed.init_distributed_environment(
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            device=self.device,
            dist_init_addr=par.dist_init_addr,
            timeout_s=par.dist_timeout,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
        )
        distributed.init_expert_parallel(par.ep_size, self.args.experts.ep_num_redundant_experts)
        return memory_available(self.device, self.cpu_kv_cache_bytes)

    def initialize(self, pre_model_load_memory: int) -> None:
        """The design notes' order: sampler, model (+ EPLB manager for MoE models), KV dtype and
        scales, (LoRA), pools, backend, graphs."""
        from shardline_runtime.lora.lora_manager import build_lora_manager
        from shardline_runtime.model_executor.eplb_manager import EPLBManager

        # at tp_size > 1 the sampled ids are broadcast from TP rank 0 on the device group
        self.sampler = Sampler(broadcast=_broadcast_from_rank0 if self.tp_size > 1 else None)
        if self.pp_size > 1:  # a result waits for up to pp_size steps: no ring (HostIdRing)
            self.sampler.host_ids = None
        with self.memory_saver.region("weights"):
            self.load_model()
        experts = self.args.experts
        self.eplb_manager = EPLBManager.for_model(
            self.model,
            self.model_config.num_hidden_layers,
            self.device,
            rebalance_num_iterations=experts.eplb_rebalance_num_iterations,
            recorder_dir=experts.expert_distribution_recorder_dir,
        )
        self.kv_cache_dtype = configure_kv_cache_dtype(
            self.model, self.model_config.model_path, self.args.model.kv_cache_dtype, self.dtype
        )
        self.lora_manager = build_lora_manager(self.model, self.args.lora)
        with self.memory_saver.region("kv_cache"):
            pools = build_kv_pools(
                self.model_config,
                self.pipeline_stage,
                self.kv_cache_dtype,
                self.args.memory,
                self.device,
                self.tp_size,
                pre_model_load_memory,
                cpu_kv_cache_bytes=self.cpu_kv_cache_bytes,
                weight_bytes=self.weight_bytes,
                ranks=(self.tp_rank, self.pp_rank),
            )
        self.max_total_num_tokens = pools.max_total_num_tokens
        self.req_to_token_pool = pools.req_to_token_pool
        self.token_to_kv_pool = pools.token_to_kv_pool
        self.token_to_kv_pool_allocator = pools.token_to_kv_pool_allocator
        self.init_attention_backend()
        self.graphs = DeviceGraphs.build(self, self.args.graphs)

    def load_model(self) -> None:
        """Build the model for this rank's shard and load its weights from ``model_path``."""
        from shardline_runtime.model_loader.loader import load_model

        before = memory_available(self.device, self.cpu_kv_cache_bytes)
        stage = self.pipeline_stage
        self.model = load_model(
            self.model_config, self.model_config.model_path, self.device, stage=stage
        )
        self.model_config = self.model.config
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info(
            "[tp %d, pp %d] loaded %s layers [%d, %d): %.1f MiB of weights on this rank (available %.1f MiB before)",
            self.tp_rank,
            self.pp_rank,
            self.model_config.architecture,
            stage.start_layer,
            stage.start_layer + stage_layers(self.model_config, stage),
            self.weight_bytes / 2**20,
            before / 2**20,
        )

    def init_attention_backend(self) -> None:
        """Create the backend ``--attention-backend`` names (auto: triton on CUDA, torch_native on CPU)."""
        from shardline_runtime.attention.registry import (
            create_attention_backend,
            resolve_attention_backend,
        )

        self.attention_backend_name = resolve_attention_backend(
            self.args.model.attention_backend, self.device
        )
        self.attn_backend = create_attention_backend(self.attention_backend_name, self)

    # ---- one step -----------------------------------------------------------------------------

    def forward_and_sample(
        self, forward_batch: ForwardBatch, pp_proxy_tensors: PPProxyTensors | None = None
    ) -> GenerationBatchResult:
        """Run one step and sample; the one path the worker calls (``pp_proxy_tensors``: the
        previous pipeline stage's output, on every stage but the first).

        Returns:
            a :class:`GenerationBatchResult` whose sampled ids and logprobs are still on the
            device (call ``copy_to_cpu()`` and ``wait()`` before reading them); on a stage that is
            not the last, one with ``pp_hidden_states_proxy_tensors`` and nothing sampled; for a
            TARGET_VERIFY step, the kept tokens (``verify_step.verify_batch``); for an embedding
            model, ``pooled`` (bs, hidden) float32 and -1 for every id (nothing is sampled).

        Raises:
            ValueError: the step stops before the stage's last layer (a partial SPLIT_PREFILL).
        """
        sink = self.hidden_states_sink
        forward_batch.capture_hidden_states = sink is not None
        output = self.forward(forward_batch, pp_proxy_tensors)
        if sink is not None and isinstance(output, LogitsProcessorOutput):
            assert output.hidden_states is not None  # the model honours capture_hidden_states
            sink(forward_batch, output.hidden_states)
        if output is None:
            raise ValueError(
                "forward_and_sample needs a step that reaches the last layer (not a partial SPLIT_PREFILL)"
            )
        if isinstance(output, PPProxyTensors):
            return GenerationBatchResult(None, forward_batch, pp_hidden_states_proxy_tensors=output)
        if isinstance(output, EmbeddingPoolerOutput):  # an embedding model: pooled, no sampler
            ids = torch.full((forward_batch.batch_size,), -1, dtype=torch.int64, device=self.device)
            return GenerationBatchResult(None, forward_batch, ids, pooled=output.pooled)
        if forward_batch.forward_mode.is_target_verify():
            return verify_batch(output, forward_batch, self.device, self.tp_size)
        return self.sample(output, forward_batch)

    def forward(
        self, forward_batch: ForwardBatch, pp_proxy_tensors: PPProxyTensors | None = None
    ) -> LogitsProcessorOutput | PPProxyTensors | None:
        """Run one step (increments ``forward_pass_id``): a graph replay when
        :meth:`DeviceGraphs.try_replay` allows it, else ``forward_eager`` (any mode). Returns the
        last token's logits per request, a non-last stage's ``PPProxyTensors``, or ``None`` (a
        SPLIT_PREFILL call short of the last layer; hidden states travel in
        ``forward_batch.split_hidden_states``).

        Raises:
            ValueError: an unknown ``forward_mode``.
        """
        mode = forward_batch.forward_mode
        if not isinstance(mode, ForwardMode):
            raise ValueError(
                f"unknown forward_mode {mode!r}; allowed: {[m.name for m in ForwardMode]}"
            )
        self.forward_pass_id += 1
        replayed = self.graphs.try_replay(forward_batch, pp_proxy_tensors)
        if replayed is not None:
            return replayed
        return forward_eager(self, forward_batch, pp_proxy_tensors)

    def sample(
        self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch
    ) -> GenerationBatchResult:
        """Draw one token for each row that wants one; the only sampling path
        (:func:`~shardline_runtime.model_executor.sample_step.sample_batch`)."""
        return sample_batch(self.sampler, logits_output, forward_batch, self.device, self.tp_size)

    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str = "auto",
        recapture_cuda_graph: bool = True,
        on_phase: Callable[[WeightsPhase], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
        draft: tuple[ModelRunner, str] | None = None,
        staged: StagedWeights | None = None,
    ) -> tuple[bool, str]:
        """Load new weights (and fp8 KV scales) in place on every rank, all or nothing
        (``weight_update.py``); ``recapture_cuda_graph`` captures the graphs again after the copy
        (the HTTP API's default, DESIGN 2.4); ``on_phase`` is called as each
        :class:`WeightsPhase` begins; ``cancelled`` (polled while the new weights are staged)
        aborts it before it commits; ``draft`` (the draft model's runner and new checkpoint)
        is staged and committed with this one, or neither is; ``staged``: already staged while
        the scheduler served (``weight_staging.BackgroundStaging``). Returns ``(success, message)``;
        on failure or abort the old weights keep serving."""
        return update_weights_from_disk(
            self,
            model_path,
            load_format=load_format,
            recapture_cuda_graph=recapture_cuda_graph,
            on_phase=on_phase,
            cancelled=cancelled,
            draft=draft,
            staged=staged,
        )
