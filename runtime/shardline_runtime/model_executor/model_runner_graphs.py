"""CUDA graphs of a ModelRunner: capture at start-up, and rebuild for new settings.

Decode graphs (``CudaGraphRunner``) and piecewise EXTEND graphs (``PiecewiseCudaGraphRunner``)
are captured on CUDA only (the CPU runs the same steps eagerly). They are skipped with LoRA
(batches vary per step) and with ``rope_type: dynamic`` (frequencies depend on each step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shardline_runtime.model_executor.weight_update import WeightsPhase

if TYPE_CHECKING:
    from shardline_runtime.configs.model_config import ModelConfig
    from shardline_runtime.lora.lora_manager import LoRAManager
    from shardline_runtime.mem_cache.memory_pool import ReqToTokenPool
    from shardline_runtime.model_executor.cuda_graph_runner import CudaGraphRunner
    from shardline_runtime.model_executor.model_runner_config import ModelRunnerConfig
    from shardline_runtime.model_executor.piecewise_cuda_graph_runner import (
        PiecewiseCudaGraphRunner,
    )

logger = logging.getLogger(__name__)


class ModelRunnerGraphsMixin:
    """Graph methods of :class:`~shardline_runtime.model_executor.model_runner.ModelRunner`
    (reads ``config``, ``device``, ``lora_manager``, ``model_config``, ``req_to_token_pool``,
    ``tp_rank``; sets ``cuda_graph_runner`` and ``piecewise_cuda_graph_runner``)."""

    # Set by ModelRunner (declared here for the type checker).
    config: ModelRunnerConfig
    device: torch.device
    lora_manager: LoRAManager | None
    model_config: ModelConfig
    req_to_token_pool: ReqToTokenPool
    tp_rank: int
    pp_rank: int
    pp_size: int
    cuda_graph_runner: CudaGraphRunner | None
    piecewise_cuda_graph_runner: PiecewiseCudaGraphRunner | None

    def init_device_graphs(self) -> None:
        """Capture decode graphs with ``CudaGraphRunner`` (GPU, unless disabled)."""
        self.cuda_graph_runner = None
        if self.device.type != "cuda" or self.config.disable_cuda_graph:
            return
        if self.pp_size > 1:
            logger.warning(
                "[tp %d, pp %d] CUDA graphs disabled: stages exchange hidden states eagerly",
                self.tp_rank,
                self.pp_rank,
            )
            return
        if self.lora_manager is not None:
            logger.warning("[tp %d] CUDA graphs disabled: LoRA batches vary per step", self.tp_rank)
            return
        if self.model_config.rope_parameters["rope_type"] == "dynamic":
            # dynamic NTK recomputes frequencies from the step's longest position (a host sync)
            logger.warning(
                "[tp %d] CUDA graphs disabled: rope_type 'dynamic' depends on each step's positions",
                self.tp_rank,
            )
            return
        from shardline_runtime.model_executor.cuda_graph_runner import CudaGraphRunner

        self.cuda_graph_runner = CudaGraphRunner(self)

    def init_piecewise_cuda_graphs(self) -> None:
        """Capture EXTEND piecewise graphs (GPU, with ``--enable-piecewise-cuda-graph``)."""
        self.piecewise_cuda_graph_runner = None
        if (
            self.device.type != "cuda"
            or not self.config.enable_piecewise_cuda_graph
            or self.pp_size > 1
        ):
            return
        if self.lora_manager is not None:
            logger.warning(
                "[tp %d] piecewise CUDA graphs disabled: LoRA batches vary per step", self.tp_rank
            )
            return
        if self.model_config.rope_parameters["rope_type"] == "dynamic":
            logger.warning(
                "[tp %d] piecewise CUDA graphs disabled: rope_type 'dynamic'", self.tp_rank
            )
            return
        from shardline_runtime.model_executor.piecewise_cuda_graph_runner import (
            PiecewiseCudaGraphRunner,
        )

        self.piecewise_cuda_graph_runner = PiecewiseCudaGraphRunner(self)

    def update_cuda_graph_settings(
        self,
        cuda_graph_max_bs: int | None,
        disable: bool,
        on_phase: Callable[[WeightsPhase], None] | None = None,
    ) -> None:
        """Rebuild the decode graph runner for new settings (GPU only; the CPU runs eagerly).

        ``disable`` drops the graphs; a new ``cuda_graph_max_bs`` captures the sizes up to it
        (``on_phase(RECAPTURING)`` first). Frees the old runner's dummy request row. No graphs
        with pipeline parallelism.
        """
        if self.device.type != "cuda" or self.pp_size > 1:
            return
        from shardline_runtime.model_executor.cuda_graph_runner import (
            CudaGraphRunner,
            get_batch_sizes_to_capture,
        )

        old = self.cuda_graph_runner
        if old is not None and (disable or cuda_graph_max_bs is not None):
            self.req_to_token_pool.free(old.dummy_req_row)
            self.cuda_graph_runner = None
        if not disable and cuda_graph_max_bs is not None:
            if on_phase is not None:
                on_phase(WeightsPhase.RECAPTURING)
            sizes = get_batch_sizes_to_capture(cuda_graph_max_bs, self.config.max_running_requests)
            self.cuda_graph_runner = CudaGraphRunner(self, batch_sizes=sizes)
        logger.info(
            "[tp %d] CUDA graphs: %s",
            self.tp_rank,
            "disabled" if disable else f"max batch size {cuda_graph_max_bs}",
        )
