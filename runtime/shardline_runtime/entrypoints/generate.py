"""``POST /generate``: SGLang's native API (text or input ids, ``sampling_params``, stream).

Response: ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", "cached_tokens", "weight_version", "output_token_logprobs", "input_token_logprobs"}}``;
logprob entries are ``[logprob, token_id, top]`` with ``top`` a list of ``[logprob, token_id]``.
A stream sends the same object after every step with the text so far (cumulative, as SGLang),
then ``data: [DONE]``. ``max_new_tokens: 0`` runs the prompt only (for prompt logprobs).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from shardline_runtime.entrypoints.choices import SafeJSONResponse, sse
from shardline_runtime.entrypoints.openai_serving import until_disconnect
from shardline_runtime.entrypoints.protocol import GenerateRequest
from shardline_runtime.managers.tokenizer_manager import RequestValidationError, TokenizerManager
from shardline_runtime.sampling.sampling_params import SamplingParams, SamplingParamsError


def _params(req: GenerateRequest, input_ids: list[int], tm: TokenizerManager) -> SamplingParams:
    values = dict(req.sampling_params)
    requested = values.get("max_new_tokens", 128)
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int)):
        raise RequestValidationError(
            f"sampling_params.max_new_tokens must be an integer, got {requested!r}", "sampling_params.max_new_tokens"
        )
    if requested is not None and requested < 0:
        raise RequestValidationError(f"sampling_params.max_new_tokens must be >= 0, got {requested}", "sampling_params.max_new_tokens")
    values["max_new_tokens"] = tm.check_lengths(input_ids, requested)
    try:
        params = SamplingParams.from_dict(values)
        params.verify_vocab(tm.info.vocab_size)
        return params
    except SamplingParamsError as exc:
        raise RequestValidationError(f"sampling_params.{exc}", f"sampling_params.{exc.field}") from None
    except TypeError as exc:
        raise RequestValidationError(f"sampling_params: {exc}", "sampling_params") from None


async def serve_generate(req: GenerateRequest, tm: TokenizerManager, raw: Request):
    """Handle ``POST /generate``; raises RequestValidationError (400) / ServerNotReadyError (503)."""
    if (req.text is None) == (req.input_ids is None):
        raise RequestValidationError("give exactly one of text or input_ids", "text")
    if req.text is not None:
        input_ids = tm.tokenize(req.text, "text", add_special_tokens=req.add_special_tokens)
    else:
        input_ids = tm.tokenize(req.input_ids, "input_ids")
    params = _params(req, input_ids, tm)
    if req.logprob_start_len >= len(input_ids):
        raise RequestValidationError(
            f"logprob_start_len must be in [-1, {len(input_ids) - 1}], got {req.logprob_start_len}", "logprob_start_len"
        )
    await tm.admit()  # held while a weight update runs
    rid = req.rid or tm.new_rid()
    out: dict[str, Any] = {"text": "", "output_ids": [], "meta_info": {"id": rid, "finish_reason": None,
                                                                       "weight_version": tm.weight_version}}
    meta = out["meta_info"]
    if req.return_logprob:
        meta["output_token_logprobs"] = []
        meta["input_token_logprobs"] = None

    async def events() -> AsyncIterator[dict]:
        logprob_start = req.logprob_start_len if req.return_logprob else -1
        async for chunk in tm.generate(input_ids, params, rid, req.return_logprob, req.top_logprobs_num, logprob_start):
            out["text"] += chunk.text
            out["output_ids"] += chunk.token_ids
            meta.update(finish_reason=chunk.finish_reason, prompt_tokens=chunk.prompt_tokens,
                        completion_tokens=chunk.completion_tokens, cached_tokens=chunk.cached_tokens,
                        weight_version=chunk.weight_version or meta["weight_version"])
            if req.return_logprob:
                meta["output_token_logprobs"] += [[lp, t, [list(x) for x in top]] for lp, t, top in chunk.logprobs]
                if chunk.prompt_logprobs is not None:
                    meta["input_token_logprobs"] = [[lp, t, [list(x) for x in top]] for lp, t, top in chunk.prompt_logprobs]
            yield out

    if req.stream:
        async def stream() -> AsyncIterator[str]:
            async for item in events():
                yield sse(item)
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def collect() -> None:
        async for _ in events():
            pass

    await until_disconnect(raw, collect)
    return SafeJSONResponse(out)
