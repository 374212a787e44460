"""HTTP routes of the expert-distribution recorder and EPLB (SGLang's endpoint names).

- ``POST /start_expert_distribution_record`` ``{"mode"?: "stat" | "per_pass"}`` (default
  ``--expert-distribution-recorder-mode``)
- ``POST /stop_expert_distribution_record``
- ``POST /dump_expert_distribution_record`` ``{"to_file"?: false}``: the record as JSON, or
  ``{"path": ...}`` of a JSON file in ``--expert-distribution-recorder-dir``
- ``POST /rebalance_experts``: re-place the experts from the record (all-or-nothing)

A request the server cannot satisfy (dense model, unknown mode, nothing recorded, no dump
directory) is a 400 whose message says why.
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from shardline_runtime.managers.io_struct import (
    ExpertDistributionReqInput,
    ExpertDistributionReqOutput,
    RebalanceExpertsReqInput,
    RebalanceExpertsReqOutput,
)

CONTROL_TIMEOUT_S = 600  # a rebalance moves expert weights between ranks


class StartRecordRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["stat", "per_pass"] | None = None


class DumpRecordRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to_file: bool = False


def add_expert_routes(app: FastAPI, tm, default_mode: str = "stat") -> None:
    """Register the four routes on ``app``; ``tm`` is the ``TokenizerManager``."""

    async def recorder(action: str, mode: str | None = None, to_file: bool = False) -> JSONResponse:
        out: ExpertDistributionReqOutput = await tm.control.call(
            ExpertDistributionReqInput(action, mode, to_file),
            ExpertDistributionReqOutput,
            timeout=CONTROL_TIMEOUT_S,
        )
        if not out.success:
            return JSONResponse({"success": False, "message": out.message}, status_code=400)
        if out.record is not None:
            return JSONResponse(out.record)
        return JSONResponse({"success": True, "message": out.message})

    @app.post("/start_expert_distribution_record")
    async def start_expert_distribution_record(body: StartRecordRequest | None = None):
        return await recorder("start", (body.mode if body else None) or default_mode)

    @app.post("/stop_expert_distribution_record")
    async def stop_expert_distribution_record():
        return await recorder("stop")

    @app.post("/dump_expert_distribution_record")
    async def dump_expert_distribution_record(body: DumpRecordRequest | None = None):
        return await recorder("dump", to_file=bool(body and body.to_file))

    @app.post("/rebalance_experts")
    async def rebalance_experts():
        out: RebalanceExpertsReqOutput = await tm.control.call(
            RebalanceExpertsReqInput(), RebalanceExpertsReqOutput, timeout=CONTROL_TIMEOUT_S
        )
        return JSONResponse(
            {
                "success": out.success,
                "message": out.message,
                "imbalance_before": out.imbalance_before,
                "imbalance_after_expected": out.imbalance_after_expected,
                "moved_experts": out.moved_experts,
            },
            status_code=200 if out.success else 400,
        )
