"""EPLBManager: the ModelRunner's MoE bookkeeping: the expert-distribution recorder, and
rebalancing the experts from what it recorded (on ``POST /rebalance_experts`` or every
``--eplb-rebalance-num-iterations`` forward passes), after SGLang's ``EPLBManager``.

A rebalance: take the load (the user's record when it holds counts, else the periodic window)
-> logical load per MoE layer -> ``eplb_algorithm.rebalance_experts`` on rank 0 -> broadcast the
placement -> ``expert_rebalance.rebalance_in_place`` (all-or-nothing on every rank).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from shardline_runtime.distributed import (
    all_gather_pyobj_world,
    broadcast_pyobj,
    get_expert_parallel_layout,
)
from shardline_runtime.layers.moe.eplb_algorithm import (
    expected_physical_counts,
    rank_imbalance,
    rebalance_experts,
)
from shardline_runtime.layers.moe.expert_location import moe_layers
from shardline_runtime.layers.moe.expert_rebalance import RebalanceError, rebalance_in_place
from shardline_runtime.layers.moe.recorder import ExpertDistributionRecorder

logger = logging.getLogger(__name__)


@dataclass
class RebalanceResult:
    """Outcome of one rebalance. Imbalance is ``max / mean`` tokens per EP rank (mean over MoE
    layers): ``imbalance_before`` measured on the record under the old placement,
    ``imbalance_after_expected`` the same load replayed on the new placement."""

    success: bool
    message: str
    imbalance_before: float | None = None
    imbalance_after_expected: float | None = None
    moved_experts: int = 0


class EPLBManager:
    """Recorder and rebalancing of one rank's MoE model.

    Args:
        model: the loaded model (must contain ``FusedMoE`` layers).
        num_layers: model layers (recorder rows).
        device: where counts accumulate.
        rebalance_num_iterations: rebalance every this many forward passes (0: only on request).
        recorder_dir: ``--expert-distribution-recorder-dir``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_layers: int,
        device: torch.device,
        rebalance_num_iterations: int = 0,
        recorder_dir: str | None = None,
    ):
        self.model = model
        self.layers = moe_layers(model)
        first = self.layers[0]
        self.num_experts, self.num_physical = first.num_experts, first.num_physical_experts
        self.layer_ids = [layer.layer_id for layer in self.layers]
        self.recorder = ExpertDistributionRecorder(
            num_layers, self.num_physical, device, dump_dir=recorder_dir
        )
        for layer in self.layers:
            layer.recorder = self.recorder
        self.rebalance_num_iterations = rebalance_num_iterations
        self.passes_since_rebalance = 0
        self.last_result: RebalanceResult | None = None
        if rebalance_num_iterations > 0:
            self.recorder.enable_window()

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, num_layers: int, device: torch.device, **kwargs
    ) -> EPLBManager | None:
        """An ``EPLBManager`` when ``model`` has MoE layers, else None (dense models)."""
        return cls(model, num_layers, device, **kwargs) if moe_layers(model) else None

    def physical_to_logical(self) -> torch.Tensor:
        """(num_layers, num_physical) current placement (zeros in dense layers' rows)."""
        p2l = torch.zeros(self.recorder.num_layers, self.num_physical, dtype=torch.int64)
        for layer in self.layers:
            p2l[layer.layer_id] = layer.physical_to_logical_map.cpu()
        return p2l

    def dump(self, to_file: bool = False, answer: bool = True) -> dict[str, Any] | None:
        """The record of every MoE layer of every pipeline stage (see
        ``ExpertDistributionRecorder.dump``), or None where ``answer`` is false.

        Each stage holds and records only its own layers, so every rank sends its MoE layers'
        placement rows and counts to every other (``all_gather_pyobj_world``; TP ranks of a
        stage hold the same rows). Every rank of the world must call it together; only the
        answering rank (world rank 0) builds the record or writes the file.

        Raises:
            RecorderError: ``to_file`` without ``--expert-distribution-recorder-dir``.
        """
        ids = self.layer_ids
        passes = self.recorder.pass_counts()
        mine = (
            ids,
            self.physical_to_logical()[ids],
            self.recorder.physical_counts()[ids],
            [p[ids] for p in passes] if passes is not None else None,
        )
        p2l = torch.zeros(self.recorder.num_layers, self.num_physical, dtype=torch.int64)
        total = torch.zeros_like(p2l)
        merged: list[torch.Tensor] = []
        for layer_ids, p2l_rows, total_rows, pass_rows in all_gather_pyobj_world(mine):
            p2l[layer_ids], total[layer_ids] = p2l_rows, total_rows
            for i, rows in enumerate(pass_rows or []):
                if i == len(merged):  # a stage may have closed one pass more than another
                    merged.append(torch.zeros_like(p2l))
                merged[i][layer_ids] = rows
        if not answer:
            return None
        return self.recorder.dump(
            p2l,
            self.num_experts,
            to_file=to_file,
            total=total,
            passes=merged if passes is not None else None,
        )

    def on_forward_pass_end(self) -> None:
        """Called by the ModelRunner after every forward pass (cheap when nothing records)."""
        self.recorder.on_forward_pass_end()
        if self.rebalance_num_iterations > 0:
            self.passes_since_rebalance += 1
            if self.passes_since_rebalance >= self.rebalance_num_iterations:
                self.rebalance(self.recorder.take_window())

    def rebalance(self, physical_counts: torch.Tensor | None = None) -> RebalanceResult:
        """Re-place the experts for the recorded load; every rank must call it together.

        Args:
            physical_counts: (num_layers, num_physical) load; default: the user's record,
                else the periodic window.

        Returns:
            A :class:`RebalanceResult`; on failure the old placement keeps serving.
        """
        self.passes_since_rebalance = 0
        ep_size = get_expert_parallel_layout().ep_size
        if ep_size == 1 and self.num_physical == self.num_experts:
            self.last_result = RebalanceResult(
                True,
                "nothing to rebalance: one expert-parallel rank and no redundant "
                "slots (--ep-num-redundant-experts 0)",
                1.0,
                1.0,
            )
            return self.last_result
        if physical_counts is None:
            physical_counts = self.recorder.physical_counts()
            if int(physical_counts.sum()) == 0 and self.recorder.has_window:
                physical_counts = self.recorder.take_window()
        counts = physical_counts.cpu()[self.layer_ids]  # (L_moe, P)
        if int(counts.sum()) == 0:
            result = RebalanceResult(
                False,
                "no expert load recorded: POST /start_expert_distribution_record, send "
                "traffic, then rebalance (or set --eplb-rebalance-num-iterations)",
            )
            self.last_result = result
            return result
        old = torch.stack(
            [layer.physical_to_logical_map.cpu() for layer in self.layers]
        )  # (L_moe, P)
        logical = torch.zeros(len(self.layers), self.num_experts, dtype=torch.int64).scatter_add_(
            1, old, counts
        )
        placement = broadcast_pyobj(rebalance_experts(logical, self.num_physical, ep_size))
        before = rank_imbalance(counts, ep_size)
        after = rank_imbalance(expected_physical_counts(logical, placement), ep_size)
        try:
            moved = rebalance_in_place(self.model, placement)
        except RebalanceError as e:
            result = RebalanceResult(False, f"rebalance failed; old placement kept. {e}", before)
        else:
            result = RebalanceResult(
                True,
                f"experts re-placed ({moved} slots changed on this rank)",
                before,
                after,
                moved,
            )
            if not torch.equal(old, placement.to(old.dtype)):
                # The record's physical slots now hold other experts: counts taken under the old
                # placement would be misread (logical_count, the next rebalance); start afresh.
                self.recorder.reset_counts()
        logger.info("EPLB: %s (imbalance %.3f -> %s)", result.message, before, after)
        self.last_result = result
        return result
