"""OpenAI ``/v1/embeddings`` for embedding models, and the refusals between the model kinds.

The request (OpenAI's shape): ``input`` as a string, a list of strings, a list of token ids or a
list of token-id lists (one embedding per string or id list, at most ``MAX_INPUTS``);
``encoding_format`` ``float`` (default) or ``base64`` (little-endian float32 bytes, what the
openai SDK asks for by default); ``dimensions`` (Matryoshka truncation, for models trained for
it: keep the first ``dimensions`` values, then L2-normalise again when the model normalises,
as vLLM does); ``user`` is accepted and ignored. Strings are tokenized with the tokenizer's
special tokens, as sentence-transformers' ``encode`` does. Each input runs as one request
through the scheduler (an EXTEND, chunked when long, pooled by the model: ``layers/pooler.py``);
the inputs of one call run concurrently and are batched by the scheduler.

A generation model answers ``/v1/embeddings`` with a 400 naming ``model``; an embedding model
answers the text endpoints (``/v1/completions``, ``/v1/chat/completions``, ``/generate``) the
same way (:func:`refuse_for_embedding_model`).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from shardline_runtime.entrypoints.errors import error_response
from shardline_runtime.entrypoints.openai_serving import until_disconnect
from shardline_runtime.managers.io_struct import TokenizedGenerateReqInput
from shardline_runtime.managers.request_validation import RequestValidationError
from shardline_runtime.managers.tokenizer_manager import TokenizerManager
from shardline_runtime.sampling.sampling_params import SamplingParams

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(BaseModel):
    """The body of ``POST /v1/embeddings`` (unknown fields are refused, naming them)."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def refuse_for_embedding_model(tm: TokenizerManager, endpoint: str) -> None:
    """Raises RequestValidationError (400, ``model``) when an embedding model serves here."""
    if not tm.info.is_generation:
        raise RequestValidationError(
            f"{endpoint} needs a generation model; this server runs an embedding model: "
            "use /v1/embeddings",
            "model",
        )


def _inputs(tm: TokenizerManager, value: str | list[Any]) -> list[list[int]]:
    """Token ids of every input. Raises RequestValidationError naming ``input``."""
    items: list[Any] = [value] if isinstance(value, str) else list(value)
    if items and all(isinstance(t, int) for t in items):
        items = [items]  # one input given as token ids
    if not items:
        raise RequestValidationError("input must contain at least one item", "input")
    if len(items) > MAX_INPUTS:
        raise RequestValidationError(
            f"input has {len(items)} items; at most {MAX_INPUTS} per request", "input"
        )
    limit = tm.info.max_req_input_len
    out = []
    for i, item in enumerate(items):
        try:
            ids = tm.validator.tokenize(item, f"input[{i}]", add_special_tokens=True)
        except RequestValidationError as exc:
            raise RequestValidationError(str(exc), "input") from None
        if len(ids) > limit:
            raise RequestValidationError(
                f"input[{i}] has {len(ids)} tokens; this model accepts at most {limit}", "input"
            )
        out.append(ids)
    return out


def _encode(vector: list[float], dimensions: int | None, normalize: bool, fmt: str) -> Any:
    values = np.asarray(vector, dtype=np.float32)
    if dimensions is not None:
        values = values[:dimensions]
        if normalize:  # renormalise the cut vector (vLLM's order: truncate, then normalise)
            values = values / max(float(np.linalg.norm(values)), 1e-12)
    if fmt == "base64":
        return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
    return values.tolist()


async def _embed(tm: TokenizerManager, ids: list[int]) -> list[float]:
    """Run one input; its pooled vector. Raises RuntimeError when the scheduler aborted it."""
    req = TokenizedGenerateReqInput(
        rid=tm.new_rid(), input_ids=ids, sampling_params=SamplingParams(max_new_tokens=0)
    )
    async for chunk in tm.generate(req, admitted=True):
        if chunk.finish is not None:
            if chunk.embedding is None:
                raise RuntimeError(chunk.finish.message or "the request ended without an embedding")
            return chunk.embedding
    raise RuntimeError("the request ended without an embedding")


async def serve_embeddings(
    body: EmbeddingRequest, tm: TokenizerManager, model_name: str, raw: Request
) -> JSONResponse:
    """Answer one ``/v1/embeddings`` request (see the module docstring).

    Raises:
        RequestValidationError: a generation model, bad ``input`` or ``dimensions`` (400).
        ServerNotReadyError: refused by the admission gate (503).
    """
    pooling = tm.info.pooling
    if pooling is None:
        raise RequestValidationError(
            f"model {model_name!r} is a generation model; /v1/embeddings needs an embedding "
            "model (a checkpoint with sentence-transformers' modules.json)",
            "model",
        )
    if body.dimensions is not None:
        problem = pooling.dimensions_problem(body.dimensions)
        if problem is not None:
            raise RequestValidationError(problem, "dimensions")
    inputs = _inputs(tm, body.input)
    await tm.gate.admit()

    async def run_all() -> list[list[float]]:
        return list(await asyncio.gather(*(_embed(tm, ids) for ids in inputs)))

    try:
        vectors = await until_disconnect(raw, run_all)
    except RuntimeError as exc:
        return error_response(503, f"embedding failed: {exc}")
    tokens = sum(len(ids) for ids in inputs)
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": _encode(v, body.dimensions, pooling.normalize, body.encoding_format),
        }
        for i, v in enumerate(vectors)
    ]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


def add_embedding_routes(app: FastAPI, tm: TokenizerManager, model_name: str, check_model) -> None:
    """``POST /v1/embeddings`` (``check_model``: the server's served-model-name check)."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request):
        check_model(body.model)
        return await serve_embeddings(body, tm, model_name, raw)
