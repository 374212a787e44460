"""ModelRunnerConfig: what one rank's ModelRunner takes from the server arguments, and its device.

Frozen: built once per rank from ``ServerArgs`` (:meth:`ModelRunnerConfig.from_server_args`) and
checked on construction, before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DEVICES = ("auto", "cuda", "cpu")


@dataclass(frozen=True)
class ModelRunnerConfig:
    """What a ModelRunner needs from the server arguments, for one rank (``tp_rank`` of stage
    ``pp_rank``; ``pp_layer_partition``: layers per stage, empty for the even split).

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
    pp_rank: int = 0
    pp_size: int = 1
    pp_layer_partition: tuple[int, ...] = ()
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
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank must be in [0, {self.pp_size}), got {self.pp_rank}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}"
            )

    @classmethod
    def from_server_args(
        cls, server_args: Any, tp_rank: int, pp_rank: int = 0
    ) -> ModelRunnerConfig:
        """Take the same-named fields of a ``ServerArgs`` (or any object with them)."""
        names = cls.__dataclass_fields__.keys() - {"tp_rank", "pp_rank"}
        values = {n: getattr(server_args, n) for n in names if hasattr(server_args, n)}
        return cls(tp_rank=tp_rank, pp_rank=pp_rank, **values)

    @property
    def world_rank(self) -> int:
        """``pp_rank * tp_size + tp_rank`` (SGLang's layout)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def local_rank(self) -> int:
        """Index of this rank's GPU on its node (a node runs ``tp_size * pp_size / nnodes``
        consecutive world ranks)."""
        return self.world_rank % (self.tp_size * self.pp_size // self.nnodes)


def resolve_device(device: str, local_rank: int) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` when CUDA is available, else ``cpu``."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' was asked for but torch.cuda.is_available() is False")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
