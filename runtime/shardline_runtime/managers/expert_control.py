"""Scheduler side of the expert-distribution recorder and EPLB control messages.

Every rank handles the same messages in the same order (rank 0 broadcasts them), so a
rebalance's collectives line up; only rank 0's reply reaches the HTTP process. Messages are
handled between forward steps, so no step sees a half-moved expert.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardline_runtime.layers.moe.recorder import RecorderError
from shardline_runtime.managers.io_struct import (
    ExpertDistributionReqInput,
    ExpertDistributionReqOutput,
    RebalanceExpertsReqInput,
    RebalanceExpertsReqOutput,
)

ACTIONS = ("start", "stop", "dump")
NOT_MOE = (
    "the served model has no experts (expert distribution and EPLB need a mixture-of-experts model)"
)


class ExpertControl:
    """Recorder and rebalance requests on one rank.

    Args:
        eplb_manager: the runner's ``EPLBManager``, or None when the model has no experts.
        memory_saver: the runner's ``MemorySaver`` (no expert moves while weights are released).
        tp_rank, pp_rank: this rank (world rank 0 answers ``dump`` and writes its file; every
            rank takes part in the dump's gather of every pipeline stage's layers).
        send: rank 0's sender of replies (a no-op on other ranks).
    """

    def __init__(
        self,
        eplb_manager: Any,
        memory_saver: Any,
        tp_rank: int,
        send: Callable[[Any], None],
        pp_rank: int = 0,
    ):
        self.manager = eplb_manager
        self.memory_saver = memory_saver
        self.tp_rank, self.pp_rank = tp_rank, pp_rank
        self.send = send

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        """This part's entries of the scheduler's message table."""
        return {
            ExpertDistributionReqInput: lambda m: self.send(self.record(m)),
            RebalanceExpertsReqInput: lambda m: self.send(self.rebalance(m)),
        }

    def rebalance(self, _msg: RebalanceExpertsReqInput) -> RebalanceExpertsReqOutput:
        """Move experts by the recorded load (every rank together)."""
        if self.manager is None:
            return RebalanceExpertsReqOutput(False, NOT_MOE)
        if self.memory_saver is not None and "weights" in self.memory_saver.released:
            return RebalanceExpertsReqOutput(
                False,
                "weights are released; POST /resume_memory_occupation with tag "
                "'weights' before /rebalance_experts",
            )
        r = self.manager.rebalance()
        return RebalanceExpertsReqOutput(
            r.success, r.message, r.imbalance_before, r.imbalance_after_expected, r.moved_experts
        )

    def record(self, msg: ExpertDistributionReqInput) -> ExpertDistributionReqOutput:
        """Start, stop or dump the expert-distribution recorder."""
        manager = self.manager
        if manager is None:
            return ExpertDistributionReqOutput(False, NOT_MOE)
        if msg.action not in ACTIONS:
            return ExpertDistributionReqOutput(
                False, f"action must be one of {ACTIONS}, got {msg.action!r}"
            )
        try:
            if msg.action == "start":
                manager.recorder.start(msg.mode)
                return ExpertDistributionReqOutput(True, f"recording ({manager.recorder.mode})")
            if msg.action == "stop":
                manager.recorder.stop()
                return ExpertDistributionReqOutput(True, "stopped")
            # Every rank gathers every stage's layers; world rank 0 answers (and writes the file).
            answer = self.tp_rank == 0 and self.pp_rank == 0
            record = manager.dump(to_file=msg.to_file, answer=answer)
            if record is None:
                return ExpertDistributionReqOutput(True, "dumped by rank 0")
            return ExpertDistributionReqOutput(True, "", record)
        except (RecorderError, OSError) as e:
            return ExpertDistributionReqOutput(False, str(e))
