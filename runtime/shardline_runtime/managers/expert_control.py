"""Scheduler side of the expert-distribution recorder and EPLB control messages.

Every rank handles the same messages in the same order (rank 0 broadcasts them), so a
rebalance's collectives line up; only rank 0's reply reaches the HTTP process. Messages are
handled between forward steps, so no step sees a half-moved expert.
"""

from __future__ import annotations

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


def handle_expert_control(
    model_runner: Any, msg: ExpertDistributionReqInput | RebalanceExpertsReqInput
):
    """Run one recorder or rebalance request on this rank; returns the reply message."""
    manager = model_runner.eplb_manager
    if isinstance(msg, RebalanceExpertsReqInput):
        if manager is None:
            return RebalanceExpertsReqOutput(False, NOT_MOE)
        saver = getattr(model_runner, "memory_saver", None)
        if saver is not None and "weights" in saver.released:  # no expert weights to move
            return RebalanceExpertsReqOutput(
                False,
                "weights are released; POST /resume_memory_occupation with tag "
                "'weights' before /rebalance_experts",
            )
        r = manager.rebalance()
        return RebalanceExpertsReqOutput(
            r.success, r.message, r.imbalance_before, r.imbalance_after_expected, r.moved_experts
        )
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
        answer = model_runner.tp_rank == 0 and getattr(model_runner, "pp_rank", 0) == 0
        record = manager.dump(to_file=msg.to_file, answer=answer)
        if record is None:
            return ExpertDistributionReqOutput(True, "dumped by rank 0")
        return ExpertDistributionReqOutput(True, "", record)
    except (RecorderError, OSError) as e:
        return ExpertDistributionReqOutput(False, str(e))
