"""``POST /generate``: SGLang's native API (text or input ids, ``sampling_params``, stream).

Response: ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", "cached_tokens", "weight_version", "revision", "output_token_logprobs",
"input_token_logprobs"}}`` (``weight_version`` / ``revision``: the weights that produced the
tokens, also in the ``X-Shardline-*`` headers, ``version_headers.py``);
logprob entries are ``[logprob, token_id, top]`` with ``top`` a list of ``[logprob, token_id]``.
A stream sends the same object after every step with the text so far (cumulative, as SGLang),
then ``data: [DONE]``. ``max_new_tokens: 0`` runs the prompt only (for prompt logprobs).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from shardline_runtime.constrained.grammar_spec import GrammarSpec
from shardline_runtime.entrypoints.choices import SafeJSONResponse, sse
from shardline_runtime.entrypoints.errors import guard_stream
from shardline_runtime.entrypoints.openai_serving import until_disconnect
from shardline_runtime.entrypoints.protocol import GenerateRequest
from shardline_runtime.entrypoints.structured_output import sampling_params_grammar
from shardline_runtime.entrypoints.version_headers import pin_from_headers, version_headers
from shardline_runtime.managers.io_struct import TokenizedGenerateReqInput, TokenLogprob
from shardline_runtime.managers.request_validation import RequestValidationError
from shardline_runtime.managers.tokenizer_manager import TokenizerManager
from shardline_runtime.sampling.sampling_params import SamplingParams, SamplingParamsError


def _params(
    req: GenerateRequest, input_ids: list[int], tm: TokenizerManager
) -> tuple[SamplingParams, GrammarSpec | None]:
    """The request's ``SamplingParams`` and its output constraint (SGLang's ``json_schema`` /
    ``regex`` / ``ebnf`` in ``sampling_params``, compiled here so a rejected one is a 400)."""
    values = dict(req.sampling_params)
    grammar = sampling_params_grammar(values)
    if grammar is not None:
        tm.validator.check_grammar(grammar)
    requested = values.get("max_new_tokens", 128)
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int)):
        raise RequestValidationError(
            f"sampling_params.max_new_tokens must be an integer, got {requested!r}",
            "sampling_params.max_new_tokens",
        )
    if requested is not None and requested < 0:
        raise RequestValidationError(
            f"sampling_params.max_new_tokens must be >= 0, got {requested}",
            "sampling_params.max_new_tokens",
        )
    values["max_new_tokens"] = tm.validator.check_lengths(input_ids, requested)
    try:
        params = SamplingParams.from_dict(values)
        params.verify_vocab(tm.info.vocab_size)
        return params, grammar
    except SamplingParamsError as exc:
        raise RequestValidationError(
            f"sampling_params.{exc}", f"sampling_params.{exc.field}"
        ) from None
    except TypeError as exc:
        raise RequestValidationError(f"sampling_params: {exc}", "sampling_params") from None


def _check_vectors(vectors: list[list[float]], hidden_size: int, field: str) -> None:
    for i, v in enumerate(vectors):
        if len(v) != hidden_size:
            raise RequestValidationError(
                f"{field}[{i}] has {len(v)} values; the model's hidden_size is {hidden_size}", field
            )
        if not all(math.isfinite(x) for x in v):
            raise RequestValidationError(f"{field}[{i}] has a non-finite value", field)


def input_embeds_override(
    req: GenerateRequest, prompt_len: int, hidden_size: int
) -> tuple[list[int] | None, list | None]:
    """``(positions, vectors)`` the request replaces the token embeddings with, or ``(None, None)``.

    ``input_embeds`` gives every prompt position; ``replace_embeds`` with ``replace_positions``
    overwrite some positions of a token prompt (the placeholder mechanism multimodal models use).

    Raises:
        RequestValidationError: a vector of another width than ``hidden_size``, a non-finite
            value, positions out of ``[0, prompt_len)``, repeated, or not one per vector.
    """
    if req.input_embeds is not None:
        if req.replace_embeds is not None or req.replace_positions is not None:
            raise RequestValidationError(
                "replace_embeds / replace_positions go with text or input_ids, not input_embeds",
                "replace_embeds",
            )
        if not req.input_embeds:
            raise RequestValidationError(
                "input_embeds must hold at least one vector", "input_embeds"
            )
        _check_vectors(req.input_embeds, hidden_size, "input_embeds")
        return list(range(prompt_len)), req.input_embeds
    if (req.replace_embeds is None) != (req.replace_positions is None):
        raise RequestValidationError(
            "replace_embeds and replace_positions go together", "replace_positions"
        )
    if req.replace_embeds is None or req.replace_positions is None:
        return None, None
    if len(req.replace_embeds) != len(req.replace_positions) or not req.replace_positions:
        raise RequestValidationError(
            f"replace_positions has {len(req.replace_positions)} entries, replace_embeds {len(req.replace_embeds)}: "
            "give one position per vector (at least one)",
            "replace_positions",
        )
    bad = [p for p in req.replace_positions if not 0 <= p < prompt_len]
    if bad:
        raise RequestValidationError(
            f"replace_positions {bad} are outside the prompt's [0, {prompt_len - 1}]",
            "replace_positions",
        )
    if len(set(req.replace_positions)) != len(req.replace_positions):
        raise RequestValidationError("replace_positions repeats a position", "replace_positions")
    _check_vectors(req.replace_embeds, hidden_size, "replace_embeds")
    return list(req.replace_positions), req.replace_embeds


def _entries(logprobs: list[TokenLogprob]) -> list[list]:
    """SGLang's ``[logprob, token_id, [[logprob, token_id], ...]]`` per position."""
    return [[e.logprob, e.token_id, [list(x) for x in e.top]] for e in logprobs]


async def serve_generate(req: GenerateRequest, tm: TokenizerManager, raw: Request):
    """Handle ``POST /generate``; raises RequestValidationError (400) / ServerNotReadyError (503)."""
    given = [
        name for name in ("text", "input_ids", "input_embeds") if getattr(req, name) is not None
    ]
    if len(given) != 1:
        raise RequestValidationError(
            f"give exactly one of text, input_ids or input_embeds (got {given or 'none'})", "text"
        )
    if req.input_embeds is not None:
        input_ids = [0] * len(req.input_embeds)  # placeholders: the KV comes from the given vectors
    elif req.text is not None:
        input_ids = tm.validator.tokenize(
            req.text, "text", add_special_tokens=req.add_special_tokens
        )
    else:  # exactly one was given: input_ids
        input_ids = tm.validator.tokenize(req.input_ids or [], "input_ids")
    embeds = input_embeds_override(req, len(input_ids), tm.info.hidden_size)
    params, grammar = _params(req, input_ids, tm)
    if req.logprob_start_len >= len(input_ids):
        raise RequestValidationError(
            f"logprob_start_len must be in [-1, {len(input_ids) - 1}], got {req.logprob_start_len}",
            "logprob_start_len",
        )
    tm.check_new_request(req.rid, req.lora_path)
    pin = pin_from_headers(raw.headers)
    # held during a weight update or a pause, 503 now: before a stream's headers go out
    await tm.admit(pin)
    admitted_on = tm.state.weights
    rid = req.rid or tm.new_rid()
    out: dict[str, Any] = {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": rid,
            "finish_reason": None,
            "weight_version": admitted_on.weight_version,
            "revision": admitted_on.revision,
        },
    }
    meta = out["meta_info"]
    if req.return_logprob:
        meta["output_token_logprobs"] = []
        meta["input_token_logprobs"] = None

    async def events() -> AsyncIterator[dict]:
        request = TokenizedGenerateReqInput(
            rid=rid,
            input_ids=input_ids,
            sampling_params=params,
            return_logprob=req.return_logprob,
            top_logprobs_num=req.top_logprobs_num,
            logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
            lora_name=req.lora_path,
            input_embeds_positions=embeds[0],
            input_embeds_values=embeds[1],
            grammar=grammar,
        )
        async for chunk in tm.generate(request, admitted=True, pin=pin):
            out["text"] += chunk.text
            out["output_ids"] += chunk.token_ids
            meta.update(
                finish_reason=None if chunk.finish is None else chunk.finish.to_dict(),
                prompt_tokens=chunk.usage.prompt_tokens,
                completion_tokens=chunk.usage.completion_tokens,
                cached_tokens=chunk.usage.cached_tokens,
                weight_version=chunk.weight_version or meta["weight_version"],
                revision=chunk.revision if chunk.weight_version else meta["revision"],
            )
            if req.return_logprob:
                meta["output_token_logprobs"] += _entries(chunk.logprobs)
                if chunk.prompt_logprobs is not None:
                    meta["input_token_logprobs"] = _entries(chunk.prompt_logprobs)
            yield out

    if req.stream:

        async def stream() -> AsyncIterator[str]:
            async for item in events():
                yield sse(item)
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            guard_stream(stream()),
            media_type="text/event-stream",
            headers=version_headers(admitted_on.revision, admitted_on.weight_version),
        )

    async def collect() -> None:
        async for _ in events():
            pass

    await until_disconnect(raw, collect)
    return SafeJSONResponse(out, headers=version_headers(meta["revision"], meta["weight_version"]))
