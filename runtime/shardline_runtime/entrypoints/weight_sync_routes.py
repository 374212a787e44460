"""HTTP routes for RL training loops: weight sync, pause/continue, memory release (SGLang's API).

The routes are left out of ``/openapi.json``: they are stateful administrative controls (pause,
release memory, join a process group at a caller-given address) that a schema-driven client or
fuzzer must not drive blindly; docs/api.md documents them and targeted tests cover their errors.

Every route answers ``{"success", "message", "weight_version"}``: 200 on success, 400 when the
request was refused (the message names the parameter or field; no weight changed on any rank),
503 while another weight update runs. ``/get_weights_by_name`` answers the bare list of values on
success, as SGLang does.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from shardline_runtime.entrypoints.weight_sync_protocol import (
    DestroyWeightsUpdateGroupRequest,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    MemoryOccupationRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
)
from shardline_runtime.managers.io_struct import (
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    GetWeightsByNameReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)
from shardline_runtime.managers.tokenizer_manager import RequestValidationError, TokenizerManager


def add_weight_sync_routes(
    app: FastAPI, tm: TokenizerManager, metrics: Any, error_response, tp_size: int, pp_size: int = 1
) -> None:
    """Register the routes on ``app`` (``error_response(status, message)`` builds 503s;
    ``tp_size x pp_size`` engine ranks join a weight-sync group)."""

    async def call(req: Any) -> JSONResponse:
        out = await tm.control_request(req)
        if metrics is not None:
            metrics.set_weight_version(tm.weight_version)
        body = {
            "success": out.success,
            "message": out.message,
            "weight_version": tm.weight_version,
        }
        return JSONResponse(body, status_code=200 if out.success else 400)

    def busy() -> JSONResponse | None:
        if tm.weights_phase in ("loading", "recapturing"):
            return error_response(
                503, f"a weight update is already running (phase {tm.weights_phase})"
            )
        return None

    @app.post("/init_weights_update_group", include_in_schema=False)
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest):
        if (
            body.rank_offset + tp_size * pp_size > body.world_size
        ):  # every rank of every stage joins
            raise RequestValidationError(
                f"world_size {body.world_size} is too small for rank_offset {body.rank_offset} + tp_size x pp_size "
                f"({tp_size} x {pp_size}) engine ranks",
                "world_size",
            )
        return await call(
            InitWeightsUpdateGroupReqInput(
                body.master_address,
                body.master_port,
                body.rank_offset,
                body.world_size,
                body.group_name,
                body.backend,
                body.timeout_s,
            )
        )

    @app.post("/destroy_weights_update_group", include_in_schema=False)
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupRequest):
        return await call(DestroyWeightsUpdateGroupReqInput(body.group_name))

    @app.post("/update_weights_from_distributed", include_in_schema=False)
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest):
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            raise RequestValidationError(
                f"names, dtypes and shapes must have the same length, got {len(body.names)}, "
                f"{len(body.dtypes)}, {len(body.shapes)}",
                "names",
            )
        return busy() or await call(
            UpdateWeightsFromDistributedReqInput(
                body.names,
                body.dtypes,
                body.shapes,
                body.group_name,
                body.flush_cache,
                body.abort_all_requests,
                body.weight_version,
            )
        )

    @app.post("/update_weights_from_tensor", include_in_schema=False)
    async def update_weights_from_tensor(raw: Request):
        # JSON (SGLang-style, base64) or the safetensors bytes themselves as the body, with the
        # options in the query string: the raw form skips base64 and JSON (much faster when large).
        if raw.headers.get("content-type", "").startswith("application/octet-stream"):
            data = await raw.body()
            try:
                body = UpdateWeightsFromTensorRequest.model_validate(
                    {**dict(raw.query_params), "serialized_named_tensors": "-"}
                )
            except ValidationError as exc:
                raise FastAPIValidationError(exc.errors()) from None
            if not data:
                raise RequestValidationError(
                    "the body must be the bytes of a safetensors file", "body"
                )
        else:
            _refuse_pickled_tensors(await raw.body())
            try:
                body = UpdateWeightsFromTensorRequest.model_validate_json(await raw.body())
            except ValidationError as exc:
                raise FastAPIValidationError(exc.errors()) from None
            try:
                data = base64.b64decode(body.serialized_named_tensors, validate=True)
            except (binascii.Error, ValueError):
                raise RequestValidationError(
                    "serialized_named_tensors must be base64 of a safetensors file",
                    "serialized_named_tensors",
                ) from None
        return busy() or await call(
            UpdateWeightsFromTensorReqInput(
                data, body.flush_cache, body.abort_all_requests, body.weight_version
            )
        )

    @app.post("/get_weights_by_name", include_in_schema=False)
    async def get_weights_by_name(body: GetWeightsByNameRequest):
        # SGLang answers the bare (truncated) list, which clients compare with a tensor's tolist().
        out = await tm.control_request(GetWeightsByNameReqInput(body.name, body.truncate_size))
        if out.success:
            return JSONResponse(out.data)
        return JSONResponse(
            {"success": False, "message": out.message, "weight_version": tm.weight_version},
            status_code=400,
        )

    @app.post("/pause_generation", include_in_schema=False)
    async def pause_generation(body: PauseGenerationRequest | None = None):
        mode = body.mode if body is not None else "abort"
        tm.set_paused(mode)  # hold new requests from now on (the scheduler pauses on its next step)
        response = await call(PauseGenerationReqInput(mode))
        if response.status_code != 200:
            tm.set_paused(None)
        return response

    @app.post("/continue_generation", include_in_schema=False)
    async def continue_generation():
        response = await call(ContinueGenerationReqInput())
        tm.set_paused(None)
        return response

    @app.post("/release_memory_occupation", include_in_schema=False)
    async def release_memory_occupation(body: MemoryOccupationRequest | None = None):
        return await call(ReleaseMemoryOccupationReqInput(body.tags if body is not None else None))

    @app.post("/resume_memory_occupation", include_in_schema=False)
    async def resume_memory_occupation(body: MemoryOccupationRequest | None = None):
        return await call(ResumeMemoryOccupationReqInput(body.tags if body is not None else None))


PICKLED_TENSORS_MESSAGE = (
    "{field}: SGLang's list of pickled tensors (MultiprocessingSerializer, load_format null, "
    "'direct' or 'flattened_bucket') is not accepted: unpickling a request would run code the "
    "client sent. Send 'serialized_named_tensors' as one base64 string of a safetensors file "
    "(safetensors.torch.save({{name: tensor}})) with load_format 'safetensors' or absent, or the "
    "safetensors bytes as an application/octet-stream body; see docs/api.md, "
    "'/update_weights_from_tensor'"
)


def _refuse_pickled_tensors(raw: bytes) -> None:
    """400 naming the field when a body has SGLang's shape (a list of serialized tensors, or a
    ``load_format`` other than safetensors, null included: SGLang's null means pickle). The
    bytes are only parsed as JSON, never unpickled.

    Raises:
        RequestValidationError: ``serialized_named_tensors`` is a list, or ``load_format`` names
            a pickle-based format.
    """
    try:
        body = json.loads(raw)
    except ValueError:
        return  # not JSON: the model's validation reports it
    if not isinstance(body, dict):
        return
    if isinstance(body.get("serialized_named_tensors"), list):
        field = "serialized_named_tensors"
    elif "load_format" in body and body["load_format"] != "safetensors":
        field = "load_format"
    else:
        return
    raise RequestValidationError(PICKLED_TENSORS_MESSAGE.format(field=field), field)
