"""ModelRunner: one TP rank's model, KV pools and attention backend, and one step of it.

Life (the design notes' ``initialize`` order, after SGLang's ``ModelRunner``): parse the config
and refuse impossible TP layouts before reading any weight -> join the TP process group and
measure the free memory *before* loading -> sampler -> load the weights (this rank's shards) ->
KV cache dtype (``kv_cache_dtype.py``) -> size the KV pool from the pre-load free memory ->
attention backend (``attention/registry.py``) -> decode CUDA graphs (``CudaGraphRunner``) ->
piecewise CUDA graphs for EXTEND (``PiecewiseCudaGraphRunner``; GPU only, when enabled).
``forward`` then runs one :class:`ForwardBatch`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime import distributed
from shardline_runtime.layers.logits_processor import LogitsProcessorOutput
from shardline_runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator
from shardline_runtime.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from shardline_runtime.model_executor.memory_saver import MemorySaver

if TYPE_CHECKING:
    from shardline_runtime.model_executor.cuda_graph_runner import CudaGraphRunner
    from shardline_runtime.model_executor.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner
    from shardline_runtime.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

DEVICES = ("auto", "cuda", "cpu")


class KVCacheMemoryError(RuntimeError):
    """There is no room for a KV cache of at least one request (names the knob to change)."""


@dataclass(frozen=True)
class ModelRunnerConfig:
    """What a ModelRunner needs from the server arguments, for one TP rank.

    Units: ``mem_fraction_static`` is the fraction of the GPU memory free before loading that
    weights + KV cache may take,
    ``max_total_tokens`` is KV-cache tokens, ``cpu_kv_cache_bytes`` bytes (CPU budget when
    ``max_total_tokens`` is None), ``dist_timeout`` seconds.
    """

    model_path: str
    dtype: str = "auto"
    device: str = "auto"
    tp_rank: int = 0
    tp_size: int = 1
    ep_size: int = 1
    ep_num_redundant_experts: int = 0
    eplb_rebalance_num_iterations: int = 0
    expert_distribution_recorder_dir: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: int = 600
    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None
    cpu_kv_cache_bytes: int = 256 << 20
    max_running_requests: int = 256
    context_length: int | None = None
    cuda_graph_max_bs: int = 160
    disable_cuda_graph: bool = False
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    enable_piecewise_cuda_graph: bool = False
    piecewise_cuda_graph_max_tokens: int = 4096
    random_seed: int = 0
    enable_weights_cpu_backup: bool = False
    enable_memory_saver: bool = False
    enable_lora: bool = False
    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")

    @classmethod
    def from_server_args(cls, server_args: Any, tp_rank: int) -> "ModelRunnerConfig":
        """Take the same-named fields of a ``ServerArgs`` (or any object with them)."""
        names = cls.__dataclass_fields__.keys() - {"tp_rank"}
        values = {n: getattr(server_args, n) for n in names if hasattr(server_args, n)}
        return cls(tp_rank=tp_rank, **values)

    @property
    def local_rank(self) -> int:
        """Index of this rank's GPU on its node."""
        return self.tp_rank % (self.tp_size // self.nnodes)


def resolve_device(device: str, local_rank: int) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` when CUDA is available, else ``cpu``."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' was asked for but torch.cuda.is_available() is False")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class ModelRunner:
    """Runs the model of one TP rank.

    Attributes set by the constructor: ``model_config``, ``device``, ``dtype``, ``tp_rank``,
    ``tp_size``, ``model``, ``max_total_num_tokens``, ``req_to_token_pool``,
    ``token_to_kv_pool``, ``token_to_kv_pool_allocator``, ``attn_backend``,
    ``cuda_graph_runner`` (None unless graphs were captured), ``sampler``, ``memory_saver``
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
        self.device = resolve_device(config.device, config.local_rank)
        if model_config is None:
            model_config = ModelConfig.from_pretrained(
                config.model_path, dtype=config.dtype, context_length=config.context_length,
                device_type=self.device.type,
            )
        self.model_config = model_config
        self.model_config.check_tp_size(self.tp_size)
        self.model_config.check_ep_size(self.tp_size, config.ep_size, config.ep_num_redundant_experts)
        self.dtype = self.model_config.dtype
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        distributed.init_distributed_environment(
            tp_rank=self.tp_rank, tp_size=self.tp_size, device=self.device,
            dist_init_addr=config.dist_init_addr, timeout_s=config.dist_timeout,
        )
        distributed.init_expert_parallel(config.ep_size, config.ep_num_redundant_experts)
        pre_model_load_memory = self._memory_available()
        torch.manual_seed(config.random_seed)
        self.memory_saver = MemorySaver(self, config.enable_weights_cpu_backup, config.enable_memory_saver)
        self.initialize(pre_model_load_memory)

    def initialize(self, pre_model_load_memory: int) -> None:
        """The design notes' order: sampler, model (+ EPLB manager for MoE models), KV dtype, pool,
        backend, graphs, piecewise graphs."""
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
        self.init_cuda_graphs()
        self.init_piecewise_cuda_graphs()

    # ---- construction -------------------------------------------------------------------------

    def load_model(self) -> None:
        """Build the model for this rank's shard and load its weights from ``model_path``."""
        from shardline_runtime.model_loader.loader import load_model

        before = self._memory_available()
        self.model = load_model(self.model_config, self.model_config.model_path, self.device)
        self.model_config = self.model.config
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info(
            "[tp %d] loaded %s: %.1f MiB of weights on this rank (available %.1f MiB before)",
            self.tp_rank, self.model_config.architecture, self.weight_bytes / 2**20, before / 2**20,
        )

    def init_eplb_manager(self) -> None:
        """``eplb_manager`` (expert-distribution recorder and EPLB) for MoE models, else None."""
        from shardline_runtime.model_executor.eplb_manager import EPLBManager

        self.eplb_manager = EPLBManager.for_model(
            self.model, self.model_config.num_hidden_layers, self.device,
            rebalance_num_iterations=self.config.eplb_rebalance_num_iterations,
            recorder_dir=self.config.expert_distribution_recorder_dir,
        )

    def init_lora_manager(self) -> None:
        """``lora_manager`` (``lora/lora_manager.py``) with ``--lora-paths`` loaded, or None
        without ``--enable-lora``. Raises LoRAAdapterError for a bad start-up adapter."""
        self.lora_manager = None
        if not self.config.enable_lora:
            return
        from shardline_runtime.lora.lora_config import LoRAConfig, parse_lora_paths, resolve_target_modules
        from shardline_runtime.lora.lora_manager import LoRAManager

        paths = parse_lora_paths(list(self.config.lora_paths))
        max_rank = self.config.max_lora_rank or max([LoRAConfig.from_path(p).r for p in paths.values()] or [16])
        self.lora_manager = LoRAManager(self.model, self.config.max_loras_per_batch, max_rank,
                                        resolve_target_modules(list(self.config.lora_target_modules)))
        for name, path in paths.items():
            self.lora_manager.load_adapter(name, path)

    def _memory_available(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        return self.config.cpu_kv_cache_bytes

    def configure_kv_cache_dtype(self) -> None:
        """Set ``kv_cache_dtype`` (``--kv-cache-dtype``) and, for fp8, each layer's K/V scales."""
        from shardline_runtime.model_executor.kv_cache_dtype import configure_kv_cache_dtype

        self.kv_cache_dtype = configure_kv_cache_dtype(
            self.model, self.model_config.model_path, self.config.kv_cache_dtype, self.dtype
        )

    def profile_max_num_token(self, pre_model_load_memory: int) -> int:
        """KV-cache tokens that fit on this rank (minimum over ranks).

        GPU: ``free_now - pre_model_load_memory * (1 - mem_fraction_static)`` bytes, where
        ``pre_model_load_memory`` is the free memory measured before loading (SGLang's
        ``profile_max_num_token``): weights + KV cache take ``mem_fraction_static`` of what was
        free, whatever else shares the GPU. CPU: ``cpu_kv_cache_bytes``. Either is divided by the
        bytes one token takes on a rank in the KV cache dtype.
        """
        mc = self.model_config
        per_token = TokenToKVPool.bytes_per_token(
            mc.num_hidden_layers, mc.get_num_kv_heads(self.tp_size), mc.head_dim, self.kv_cache_dtype
        )
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            rest = free - pre_model_load_memory * (1.0 - self.config.mem_fraction_static)
        else:
            rest = self.config.cpu_kv_cache_bytes
        tokens = int(max(rest, 0) // per_token)
        return distributed.all_reduce_min_int(tokens)

    def init_memory_pool(self, pre_model_load_memory: int) -> None:
        """Create ``req_to_token_pool``, ``token_to_kv_pool`` (in ``kv_cache_dtype``) and its allocator.

        Raises:
            KVCacheMemoryError: fewer than 1 token fits (names ``--mem-fraction-static`` /
                ``--max-total-tokens``).
        """
        mc = self.model_config
        if self.config.max_total_tokens is not None:
            tokens = self.config.max_total_tokens
            if self.device.type == "cuda":
                tokens = min(tokens, self.profile_max_num_token(pre_model_load_memory))
        else:
            tokens = self.profile_max_num_token(pre_model_load_memory)
        if tokens < 1:
            raise KVCacheMemoryError(
                f"no memory left for the KV cache after loading {self.weight_bytes / 2**20:.1f} MiB of weights "
                f"on tp rank {self.tp_rank}: raise --mem-fraction-static (now {self.config.mem_fraction_static}) "
                "or set --max-total-tokens"
            )
        self.max_total_num_tokens = tokens
        self.req_to_token_pool = ReqToTokenPool(
            size=self.config.max_running_requests + 1, max_context_len=mc.context_len + 4, device=self.device
        )
        self.token_to_kv_pool = TokenToKVPool(
            tokens, mc.num_hidden_layers, mc.get_num_kv_heads(self.tp_size), mc.head_dim, self.kv_cache_dtype,
            self.device,
        )
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(tokens, device=self.device)
        logger.info(
            "[tp %d] KV cache: %d tokens, %s, %.1f MiB", self.tp_rank, tokens, self.kv_cache_dtype,
            self.token_to_kv_pool.mem_usage_bytes() / 2**20,
        )

    def init_attention_backend(self) -> None:
        """Create the backend ``--attention-backend`` names (auto: triton on CUDA, torch_native on CPU)."""
        from shardline_runtime.attention.registry import create_attention_backend, resolve_attention_backend

        self.attention_backend_name = resolve_attention_backend(self.config.attention_backend, self.device)
        self.attn_backend = create_attention_backend(self.attention_backend_name, self)

    def init_cuda_graphs(self) -> None:
        """Capture decode graphs with ``CudaGraphRunner`` (GPU, unless disabled)."""
        self.cuda_graph_runner = None
        if self.device.type != "cuda" or self.config.disable_cuda_graph:
            return
        if self.lora_manager is not None:
            logger.warning("[tp %d] CUDA graphs disabled: LoRA batches vary per step", self.tp_rank)
            return
        if self.model_config.rope_parameters["rope_type"] == "dynamic":
            # dynamic NTK recomputes frequencies from the step's longest position (a host sync)
            logger.warning("[tp %d] CUDA graphs disabled: rope_type 'dynamic' depends on each step's positions", self.tp_rank)
            return
        from shardline_runtime.model_executor.cuda_graph_runner import CudaGraphRunner

        self.cuda_graph_runner = CudaGraphRunner(self)

    def init_piecewise_cuda_graphs(self) -> None:
        """Capture EXTEND piecewise graphs (GPU, with ``--enable-piecewise-cuda-graph``)."""
        self.piecewise_cuda_graph_runner = None
        if self.device.type != "cuda" or not self.config.enable_piecewise_cuda_graph:
            return
        if self.lora_manager is not None:
            logger.warning("[tp %d] piecewise CUDA graphs disabled: LoRA batches vary per step", self.tp_rank)
            return
        if self.model_config.rope_parameters["rope_type"] == "dynamic":
            logger.warning("[tp %d] piecewise CUDA graphs disabled: rope_type 'dynamic'", self.tp_rank)
            return
        from shardline_runtime.model_executor.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner

        self.piecewise_cuda_graph_runner = PiecewiseCudaGraphRunner(self)

    def recapture_graphs(self) -> None:
        """Capture the decode and piecewise graphs again (after a weight update)."""
        for runner in (self.cuda_graph_runner, self.piecewise_cuda_graph_runner):
            if runner is not None:
                runner.capture()

    def _make_sampler(self):
        try:
            from shardline_runtime.layers.sampler import Sampler
        except ImportError:
            return None
        return Sampler()

    # ---- one step -----------------------------------------------------------------------------

    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput | None:
        """Run one step; dispatches on ``forward_batch.forward_mode``.

        Returns the logits of the last token of each request (``None`` from a SPLIT_PREFILL
        call that does not reach the last layer).
        """
        mode = forward_batch.forward_mode
        recording = self.eplb_manager is not None and self.eplb_manager.recorder.recording  # graphs do not record
        if mode.is_decode() and self.cuda_graph_runner is not None and not recording and self.cuda_graph_runner.can_run(forward_batch):
            return self.cuda_graph_runner.replay(forward_batch)
        if mode == ForwardMode.DECODE:
            return self.forward_decode(forward_batch)
        if mode == ForwardMode.EXTEND:
            pw = self.piecewise_cuda_graph_runner
            # a graph embeds the token ids itself: caller-given embeddings run eagerly
            if pw is not None and not recording and forward_batch.input_embeds_indices is None and pw.can_run(forward_batch):
                self._attach(forward_batch)
                return pw.replay(forward_batch)
            return self.forward_extend(forward_batch)
        if mode == ForwardMode.SPLIT_PREFILL:
            return self.forward_split_prefill(forward_batch)
        if mode == ForwardMode.IDLE:
            return self.forward_idle(forward_batch)
        raise ValueError(f"unknown forward_mode {mode!r}; allowed: {[m.name for m in ForwardMode]}")

    def _run(self, forward_batch: ForwardBatch):
        self._attach(forward_batch)
        if self.lora_manager is not None:
            per_req = forward_batch.extend_seq_lens_cpu if forward_batch.forward_mode.is_extend() else None
            per_req = per_req or [1] * forward_batch.batch_size
            self.lora_manager.prepare_lora_batch(forward_batch.lora_names, per_req)
        self.attn_backend.init_forward_metadata(forward_batch)
        with torch.inference_mode():
            embeds = self.input_embeds(forward_batch)
            # the layer-range path of SPLIT_PREFILL is the model's own method, beside its plain forward
            run = self.model.forward_split_prefill if forward_batch.forward_mode.is_split_prefill() else self.model.forward
            out = run(forward_batch.input_ids, forward_batch.positions, forward_batch, input_embeds=embeds)
        if self.eplb_manager is not None:
            self.eplb_manager.on_forward_pass_end()
        return out

    def input_embeds(self, forward_batch: ForwardBatch) -> torch.Tensor | None:
        """(T, hidden_size): the token embeddings with rows ``input_embeds_indices`` replaced by
        ``input_embeds_values`` (the placeholder mechanism of multimodal models), or None."""
        if forward_batch.input_embeds_indices is None or forward_batch.input_embeds_values is None:
            return None
        embeds = self.model.get_input_embeddings()(forward_batch.input_ids)  # (T, hidden)
        rows = forward_batch.input_embeds_indices.to(self.device)
        embeds[rows] = forward_batch.input_embeds_values.to(device=self.device, dtype=embeds.dtype)
        return embeds

    def _attach(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.req_to_token_pool is None:
            forward_batch.req_to_token_pool = self.req_to_token_pool
        if forward_batch.token_to_kv_pool is None:
            forward_batch.token_to_kv_pool = self.token_to_kv_pool
        if forward_batch.attn_backend is None:
            forward_batch.attn_backend = self.attn_backend

    def forward_decode(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """One token per request, eagerly."""
        return self._run(forward_batch)

    def forward_extend(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Prefill (or one chunk of it) after each request's cached prefix."""
        return self._run(forward_batch)

    def forward_idle(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """No tokens on this rank; still runs the layers so TP collectives stay in step."""
        return self._run(forward_batch)

    def forward_split_prefill(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput | None:
        """Layers ``[split_forward_start_layer, split_forward_end_layer)`` of an EXTEND step.

        Hidden states are carried in ``forward_batch.split_hidden_states`` between calls; the
        call that reaches the last layer returns the logits, earlier calls return ``None``.
        """
        return self._run(forward_batch)

    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch) -> torch.Tensor:
        """Next token ids (bs,) int64 from ``layers/sampler.py: Sampler`` (every row samples;
        ``TpModelWorker.sample`` handles rows that must not, and logprobs)."""
        if self.sampler is None:
            raise RuntimeError("shardline_runtime.layers.sampler.Sampler is not available")
        out = self.sampler(logits_output.next_token_logits, forward_batch.sampling_info)
        return out.next_token_ids

    def update_weights_from_disk(self, model_path: str, load_format: str = "auto") -> tuple[bool, str]:
        """Load new weights in place; see ``model_executor/weight_update.py``."""
        from shardline_runtime.model_executor.weight_update import update_weights_from_disk

        return update_weights_from_disk(self, model_path, load_format=load_format)
