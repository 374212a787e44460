"""The frozen sections of the server arguments, one per concern, each the one home of its
fields' defaults (the flags of ``server_args_parser.py`` take their defaults from here).

After mini-sglang's frozen config chain and SGLang's grouped ``get_parallel()`` /
``get_schedule()`` views: the runner takes ``ModelArgs``, ``ParallelArgs``, ``MemoryArgs``,
``GraphArgs``, ``ExpertArgs`` and ``LoRAArgs``; the scheduler ``ScheduleArgs``. Values that are
derived from others are resolved by a section's :meth:`resolve` classmethod, before the frozen
instance exists. The choice lists come from the modules that own the choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from shardline_runtime.attention.registry import ATTENTION_BACKENDS as _BACKENDS
from shardline_runtime.configs.model_config import DTYPE_CHOICES
from shardline_runtime.layers.moe.recorder import RECORDER_MODES
from shardline_runtime.model_executor.kv_cache_dtype import KV_CACHE_TORCH_DTYPES
from shardline_runtime.model_executor.weight_staging import LOAD_FORMATS
from shardline_runtime.speculative.spec_args import SpeculativeArgs

DTYPES = DTYPE_CHOICES
DEVICES = ("auto", "cuda", "cpu")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
KV_CACHE_DTYPES = ("auto", *KV_CACHE_TORCH_DTYPES)
ATTENTION_BACKENDS = ("auto", *_BACKENDS)
__all__ = ["LOAD_FORMATS", "RECORDER_MODES"]


@dataclass(frozen=True)
class ModelArgs:
    """The checkpoint and how it is stored and run (``None``: ``served_model_name`` and
    ``tokenizer_path`` default to ``model_path``, ``context_length`` to the model config's)."""

    model_path: str
    download_dir: str = str(Path.home() / ".cache" / "shardline" / "models")
    download_max_bytes: int = 0
    # The hf:// or s3:// reference model_path was fetched from (set by the CLI, not a flag): what
    # /get_server_info reports as model_path, so the operator sees the uri it asked for.
    model_source: str | None = None
    # Likewise the reference --speculative-draft-model-path was fetched from (reported as the
    # draft's model_path).
    draft_model_source: str | None = None
    served_model_name: str | None = None
    revision: str | None = None
    tokenizer_path: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str = "auto"
    model_kind: str = "auto"  # auto, generate or embed (configs/pooling_config.py)
    attention_backend: str = "auto"
    context_length: int | None = None


@dataclass(frozen=True)
class HTTPArgs:
    """The HTTP server and how it reads chat replies (``tool_call_parser``: a family of
    ``entrypoints/tool_parsers.py`` or ``auto``; ``reasoning_parser``: None for none); keys are
    kept out of ``repr()`` so a logged argument set never shows them."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    tool_call_parser: str = "auto"
    reasoning_parser: str | None = None


@dataclass(frozen=True)
class ParallelArgs:
    """TP x PP layout over ``nnodes`` pods; ``dist_timeout`` in seconds; ``pp_layer_partition``:
    layers per stage (empty: the even split)."""

    tp_size: int = 1
    pp_size: int = 1
    pp_layer_partition: tuple[int, ...] = ()
    ep_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    device: str = "auto"
    dist_timeout: int = 600

    @classmethod
    def resolve(cls, pp_layer_partition: Any = (), **values: Any) -> ParallelArgs:
        """``pp_layer_partition`` may be the flag's text (``"10,11,11"``).

        Raises:
            PipelineLayoutError: the text is not a comma list of positive integers.
        """
        from shardline_runtime.configs.pipeline_stage import parse_layer_partition

        if isinstance(pp_layer_partition, str):
            pp_layer_partition = parse_layer_partition(pp_layer_partition)
        return cls(pp_layer_partition=tuple(pp_layer_partition or ()), **values)

    @property
    def world_size(self) -> int:
        """Ranks of one model replica: ``tp_size * pp_size``."""
        return self.tp_size * self.pp_size

    def torch_device(self, tp_rank: int, pp_rank: int) -> torch.device:
        """``device`` for rank (``tp_rank``, ``pp_rank``): ``auto`` is ``cuda:<local rank>`` when
        CUDA is available, else ``cpu``.

        Raises:
            RuntimeError: ``cuda`` asked for without CUDA. ValueError: a rank outside the layout.
        """
        local_rank = self.local_rank(tp_rank, pp_rank)
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "device 'cuda' was asked for but torch.cuda.is_available() is False"
                )
            return torch.device("cuda", local_rank)
        return torch.device("cpu")

    def local_rank(self, tp_rank: int, pp_rank: int) -> int:
        """Index of rank (``tp_rank``, ``pp_rank``)'s GPU on its node: world rank
        ``pp_rank * tp_size + tp_rank`` (SGLang's layout) modulo the ranks per node.

        Raises:
            ValueError: a rank outside ``[0, tp_size)`` / ``[0, pp_size)``.
        """
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {tp_rank}")
        if not 0 <= pp_rank < self.pp_size:
            raise ValueError(f"pp_rank must be in [0, {self.pp_size}), got {pp_rank}")
        return (pp_rank * self.tp_size + tp_rank) % (self.world_size // self.nnodes)


@dataclass(frozen=True)
class MemoryArgs:
    """KV-cache budget: ``mem_fraction_static`` of the GPU memory free before loading for
    weights + KV cache, or ``max_total_tokens`` KV tokens; ``max_running_requests`` rows."""

    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None
    max_running_requests: int = 256


@dataclass(frozen=True)
class ScheduleArgs:
    """The scheduler's batching policy (token counts are tokens)."""

    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 16384
    disable_radix_cache: bool = False
    enable_mixed_chunk: bool = False
    disable_overlap_schedule: bool = False

    @classmethod
    def resolve(cls, **values: Any) -> ScheduleArgs:
        """``max_prefill_tokens`` is raised to ``chunked_prefill_size`` when smaller (one chunk
        must fit one prefill step)."""
        chunk = values.get("chunked_prefill_size", cls.chunked_prefill_size)
        limit = values.get("max_prefill_tokens", cls.max_prefill_tokens)
        if chunk > limit and limit > 0:
            values["max_prefill_tokens"] = chunk
        return cls(**values)


@dataclass(frozen=True)
class ExpertArgs:
    """MoE expert placement and the expert-distribution recorder."""

    ep_num_redundant_experts: int = 0
    eplb_rebalance_num_iterations: int = 0
    expert_distribution_recorder_mode: str = "stat"
    expert_distribution_recorder_dir: str | None = None


@dataclass(frozen=True)
class GraphArgs:
    """Decode CUDA graphs (batch sizes up to ``cuda_graph_max_bs``), piecewise EXTEND graphs
    (up to ``piecewise_cuda_graph_max_tokens`` tokens) and the torch.compile'd decode forward
    (batch sizes up to ``torch_compile_max_bs``; ``server_args_graphs.py``)."""

    cuda_graph_max_bs: int = 160
    disable_cuda_graph: bool = False
    enable_piecewise_cuda_graph: bool = False
    piecewise_cuda_graph_max_tokens: int = 4096
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32


@dataclass(frozen=True)
class LoRAArgs:
    """LoRA adapters served next to the base model."""

    enable_lora: bool = False
    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] = ()

    @classmethod
    def resolve(cls, **values: Any) -> LoRAArgs:
        """Lists become tuples; ``lora_paths`` implies ``enable_lora`` (as in SGLang)."""
        values["lora_paths"] = tuple(values.get("lora_paths") or ())
        values["lora_target_modules"] = tuple(values.get("lora_target_modules") or ())
        values["enable_lora"] = bool(values.get("enable_lora") or values["lora_paths"])
        return cls(**values)


@dataclass(frozen=True)
class OperationArgs:
    """Process operation; timeouts in seconds."""

    random_seed: int = 0
    log_level: str = "info"
    watchdog_timeout: int = 300
    drain_timeout: int = 30
    weight_update_hold_timeout: int = 60


@dataclass(frozen=True)
class WeightSyncArgs:
    """Weight versions and memory release."""

    weight_version: str = "default"
    enable_weights_cpu_backup: bool = False
    enable_memory_saver: bool = False


# attribute of ServerArgs -> its section class, in the order of the flat field list
SECTIONS: dict[str, type] = {
    "model": ModelArgs,
    "http": HTTPArgs,
    "parallel": ParallelArgs,
    "memory": MemoryArgs,
    "schedule": ScheduleArgs,
    "experts": ExpertArgs,
    "graphs": GraphArgs,
    "lora": LoRAArgs,
    "operation": OperationArgs,
    "weight_sync": WeightSyncArgs,
    "speculative": SpeculativeArgs,
}
SECTION_OF: dict[str, str] = {f.name: s for s, cls in SECTIONS.items() for f in fields(cls)}


def default(name: str) -> Any:
    """The default of flat field ``name`` (from its section)."""
    return next(f.default for f in fields(SECTIONS[SECTION_OF[name]]) if f.name == name)
