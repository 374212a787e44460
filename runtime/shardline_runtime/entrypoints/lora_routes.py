"""HTTP routes that load and unload LoRA adapters at runtime (SGLang's endpoint names).

- ``POST /load_lora_adapter`` ``{"lora_name", "lora_path"}``: 200 once every rank serves it;
  400 for a bad adapter (missing file, rank above ``--max-lora-rank``, another base model,
  a name already loaded or the served model's own name; ``param`` names the field); 503 when every pool slot holds an adapter
  in use. A full pool with an idle adapter evicts the least recently used one.
- ``POST /unload_lora_adapter`` ``{"lora_name"}``: new requests for it are refused at once;
  the reply comes once its queued and running requests have finished. 400 when not loaded.

Without ``--enable-lora`` both answer 400 naming the flag. Other adapters keep serving
throughout. Bodies are ``{"success", "message", "loaded_adapters"}``.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from shardline_runtime.managers.io_struct import (
    LoadLoRAAdapterReqInput,
    LoRAAdapterReqOutput,
    UnloadLoRAAdapterReqInput,
)


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /load_lora_adapter``: a PEFT adapter directory served under ``lora_name``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(..., min_length=1, max_length=256)
    lora_path: str = Field(..., min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /unload_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(..., min_length=1, max_length=256)


def _reply(out) -> JSONResponse:
    body = {"success": out.success, "message": out.message, "loaded_adapters": out.loaded}
    if not out.success:
        body["error"] = {
            "message": out.message,
            "type": "invalid_request_error" if out.status_code == 400 else "service_unavailable",
            "param": out.param,
            "code": out.status_code,
        }
    return JSONResponse(body, status_code=out.status_code if not out.success else 200)


def _disabled() -> JSONResponse:
    message = "LoRA is not enabled on this server: start it with --enable-lora"
    return JSONResponse(
        {
            "success": False,
            "message": message,
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": "lora_name",
                "code": 400,
            },
        },
        status_code=400,
    )


async def load_adapter(tm, lora_name: str, lora_path: str) -> LoRAAdapterReqOutput:
    """Load on every rank; the adapter serves as soon as this returns successfully."""
    out = await tm.control.call(
        LoadLoRAAdapterReqInput(lora_name, lora_path), LoRAAdapterReqOutput, timeout=600
    )
    tm.state.lora_adapters = dict(out.loaded)  # an eviction may have removed another
    return out


async def unload_adapter(tm, lora_name: str) -> LoRAAdapterReqOutput:
    """Stop admitting requests for ``lora_name`` now; unload once its requests finished."""
    path = tm.state.lora_adapters.pop(lora_name, None)
    out = await tm.control.call(
        UnloadLoRAAdapterReqInput(lora_name), LoRAAdapterReqOutput, timeout=600
    )
    if not out.success and path is not None and lora_name in out.loaded:
        tm.state.lora_adapters[lora_name] = path
    return out


def _base_name_taken(name: str, base_names: tuple[str, ...], loaded: dict) -> JSONResponse:
    message = (
        f"lora_name {name!r} is the served model's name: an adapter needs a name other than "
        f"{sorted(set(base_names))} (requests for that name reach the base model)"
    )
    return JSONResponse(
        {
            "success": False,
            "message": message,
            "loaded_adapters": loaded,
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": "lora_name",
                "code": 400,
            },
        },
        status_code=400,
    )


def add_lora_routes(app: FastAPI, tm, enabled: bool, base_names: tuple[str, ...] = ()) -> None:
    """Register the two routes on ``app`` (``tm``: the TokenizerManager; ``base_names``: the
    names that select the base model, refused as adapter names)."""

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        if not enabled:
            return _disabled()
        if body.lora_name in base_names:
            return _base_name_taken(body.lora_name, base_names, dict(tm.state.lora_adapters))
        return _reply(await load_adapter(tm, body.lora_name, body.lora_path))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        if not enabled:
            return _disabled()
        return _reply(await unload_adapter(tm, body.lora_name))
