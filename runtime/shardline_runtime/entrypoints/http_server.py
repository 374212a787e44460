"""FastAPI app of the rank-0 HTTP process: OpenAI API, SGLang-style native API, health, metrics.

Every error a client can cause is an OpenAI-style error object
``{"error": {"message", "type", "param", "code"}}``: 400 naming the field and the allowed range,
404 for an unknown model, 503 while the server is not ready (loading, updating weights,
draining) or does not serve the version a request is pinned to. Pydantic's 422 is turned into
400. Every response names the weights in ``X-Shardline-Revision`` / ``X-Shardline-Weight-Version``
(``version_headers.py``).
"""

from __future__ import annotations

import logging
import time
import typing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardline_runtime.entrypoints.chat_output import ChatParsers
from shardline_runtime.entrypoints.embeddings import (
    add_embedding_routes,
    refuse_for_embedding_model,
)
from shardline_runtime.entrypoints.errors import error_response
from shardline_runtime.entrypoints.expert_routes import add_expert_routes
from shardline_runtime.entrypoints.generate import serve_generate
from shardline_runtime.entrypoints.json_body import CheckedJSONRoute
from shardline_runtime.entrypoints.lora_routes import add_lora_routes
from shardline_runtime.entrypoints.openai_serving import (
    ClientDisconnected,
    serve_chat,
    serve_completion,
)
from shardline_runtime.entrypoints.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from shardline_runtime.entrypoints.version_headers import VersionHeadersMiddleware
from shardline_runtime.entrypoints.weight_sync_routes import add_weight_sync_routes
from shardline_runtime.entrypoints.weight_update_routes import add_weight_update_routes
from shardline_runtime.managers.admission_gate import ServerNotReadyError
from shardline_runtime.managers.io_struct import (
    FlushCacheReqInput,
    FlushCacheReqOutput,
    TokenizedGenerateReqInput,
)
from shardline_runtime.managers.request_validation import RequestValidationError
from shardline_runtime.managers.tokenizer_manager import TokenizerManager
from shardline_runtime.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _body_fields(request: Request) -> list[str]:
    """Field names of the route's body model (for "unknown field" messages), or []."""
    body_field = getattr(request.scope.get("route"), "body_field", None)
    annotation = getattr(getattr(body_field, "field_info", None), "annotation", None)
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return list(candidate.model_fields)
    return []


def _pydantic_message(
    exc: FastAPIValidationError, request: Request | None = None
) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None  # the top-level field; the message carries the full path
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {msg}", None
    if first.get("type") == "extra_forbidden":
        allowed = _body_fields(request) if request is not None else []
        msg = f"unknown field; allowed fields: {allowed}" if allowed else "unknown field"
    return (f"{'.'.join(loc)}: {msg}" if loc else msg), param


def build_app(tm: TokenizerManager, server_args, metrics, state: dict[str, Any]) -> FastAPI:
    """The app. ``state`` is shared with the launcher: ``healthy`` (bool), ``ready`` (bool)."""
    app = FastAPI(title="Shardline runtime", version="0.1.0")
    app.router.route_class = CheckedJSONRoute  # before any route is added
    app.add_middleware(VersionHeadersMiddleware, weights=lambda: tm.state.weights)
    model_name = server_args.model_name
    parsers = ChatParsers.resolve(
        server_args.tool_call_parser, server_args.reasoning_parser, server_args.model_path
    )

    @app.exception_handler(FastAPIValidationError)
    async def _validation(request: Request, exc: FastAPIValidationError):
        message, param = _pydantic_message(exc, request)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError):
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(ServerNotReadyError)
    async def _not_ready(_: Request, exc: ServerNotReadyError):
        response = error_response(503, str(exc))
        if exc.retry_after_seconds is not None:
            response.headers["Retry-After"] = str(exc.retry_after_seconds)
        return response

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected):
        return error_response(499, "client disconnected", err_type="client_closed_request")

    def check_model(model: str | None) -> None:
        if (
            model is not None
            and model not in (model_name, server_args.model_path)
            and model not in tm.state.lora_adapters
        ):
            available = [model_name, *sorted(tm.state.lora_adapters)]
            raise RequestValidationError(
                f"model {model!r} is not served here; available: {available}", "model"
            )

    @app.get("/health")
    async def health():
        if not state.get("healthy", True):
            return error_response(503, state.get("fatal", "unhealthy"))
        return PlainTextResponse("OK")

    @app.get("/ready")
    async def ready():
        # 503 during a weight update, so balancers send new traffic elsewhere (requests that
        # still come are held, not refused), unless it was sent with keep_ready (its caller
        # routed traffic away first); /health stays 200.
        phase, draining = tm.state.weights.phase, tm.gate.draining
        updating = phase.updating and not tm.gate.keep_ready
        if not state.get("healthy", True) or draining or updating:
            return error_response(
                503, f"not ready (weights_phase {phase.value}, draining {draining})"
            )
        if tm.gate.blocked:
            return error_response(503, f"not ready: {tm.gate.blocked}")
        return PlainTextResponse("OK")

    @app.get("/health_generate")
    async def health_generate():
        await tm.gate.admit()
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        probe = TokenizedGenerateReqInput(
            rid=tm.new_rid(),
            input_ids=[tm.info.eos_token_ids[0] if tm.info.eos_token_ids else 1],
            sampling_params=params,
        )
        async for chunk in tm.generate(probe, admitted=True):
            if chunk.finish is not None and chunk.finish.type == "abort":
                return error_response(503, f"generation failed: {chunk.finish.message}")
        return PlainTextResponse("OK")

    def model_card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "created": int(state.get("started", time.time())),
            "owned_by": "shardline",
            "root": tm.state.weights.model_path,
            "max_model_len": tm.info.context_len,
        }

    def adapter_cards() -> list[dict[str, Any]]:
        """One card per loaded LoRA adapter: ``id`` its name, ``root`` its path, ``parent`` the base."""
        return [
            {**model_card(), "id": name, "root": path, "parent": model_name}
            for name, path in sorted(tm.state.lora_adapters.items())
        ]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(), *adapter_cards()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        if model_id in tm.state.lora_adapters:
            return next(c for c in adapter_cards() if c["id"] == model_id)
        if model_id not in (model_name, server_args.model_path):
            available = [model_name, *sorted(tm.state.lora_adapters)]
            return error_response(
                404, f"The model {model_id!r} does not exist; available: {available}", "model"
            )
        return model_card()

    @app.get("/get_model_info")
    async def model_info():
        return {
            "model_path": tm.state.weights.model_path,
            "tokenizer_path": server_args.tokenizer_path or server_args.model_path,
            "served_model_name": model_name,
            "is_generation": tm.info.is_generation,
            "vocab_size": tm.info.vocab_size,
            "context_length": tm.info.context_len,
        }

    # SGLang serves the same document at /server_info (its newer name); the model gateway (smg)
    # probes that path to recognise an SGLang-API worker.
    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        s = tm.state.stats
        return {
            **tm.state.weights_info(),
            "num_held_reqs": tm.gate.held,
            "served_model_name": model_name,
            "tp_size": server_args.tp_size,
            "pp_size": server_args.pp_size,
            "nnodes": server_args.nnodes,
            "max_total_num_tokens": tm.info.max_total_num_tokens,
            "max_req_input_len": tm.info.max_req_input_len,
            "max_req_len": tm.info.max_req_len,
            "context_length": tm.info.context_len,
            "max_running_requests": tm.info.max_running_requests,
            "chunked_prefill_size": server_args.chunked_prefill_size,
            "overlap_schedule": tm.info.overlap_schedule,
            "enable_torch_compile": server_args.enable_torch_compile,
            "torch_compile_max_bs": server_args.torch_compile_max_bs,
            "model_kind": "generate" if tm.info.is_generation else "embed",
            "num_running_reqs": s.num_running_reqs,
            "num_queued_reqs": s.num_queued_reqs,
            "kv_used_tokens": s.kv_used_tokens,
            "kv_evictable_tokens": s.kv_evictable_tokens,
            "draining": tm.gate.draining,
            "version": "0.1.0",
            "generation_paused": tm.gate.paused,
            "memory_blocked": tm.gate.blocked,
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model)
        refuse_for_embedding_model(tm, "/v1/completions")
        return await serve_completion(
            body, tm, tm.state.lora_for_model(body.model) or model_name, raw
        )

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        refuse_for_embedding_model(tm, "/v1/chat/completions")
        model = tm.state.lora_for_model(body.model) or model_name
        return await serve_chat(body, tm, model, raw, parsers)

    @app.post("/generate")
    async def generate(body: GenerateRequest, raw: Request):
        refuse_for_embedding_model(tm, "/generate")
        return await serve_generate(body, tm, raw)

    @app.post("/flush_cache")
    async def flush_cache():
        out = await tm.control.call(FlushCacheReqInput(), FlushCacheReqOutput, timeout=60)
        status = 200 if out.success else 400
        return JSONResponse({"success": out.success, "message": out.message}, status_code=status)

    add_embedding_routes(app, tm, model_name, check_model)
    add_weight_update_routes(app, tm, error_response, server_args)

    add_weight_sync_routes(
        app, tm, metrics, error_response, server_args.tp_size, server_args.pp_size
    )

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest):
        if body.rid is None and not body.abort_all:
            raise RequestValidationError("give rid, or abort_all: true", "rid")
        found = await tm.abort(None if body.abort_all else body.rid)
        return {"success": found}

    add_expert_routes(app, tm, getattr(server_args, "expert_distribution_recorder_mode", "stat"))
    add_lora_routes(
        app,
        tm,
        getattr(server_args, "enable_lora", False),
        (model_name, server_args.model_path),
    )

    @app.get("/metrics")
    async def metrics_endpoint():
        if metrics is None:
            return error_response(404, "metrics are disabled")
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
