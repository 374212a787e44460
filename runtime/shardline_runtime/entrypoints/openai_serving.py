"""OpenAI ``/v1/completions`` and ``/v1/chat/completions`` responses (JSON and SSE streams).

Streamed and non-streamed responses are built from the same chunks: the non-streamed text is
the concatenation of the deltas a stream would send, so the two are equal by construction.
A non-streamed request whose client disconnects is aborted (the HTTP request is polled while
waiting); a stream is aborted when Starlette cancels the generator.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from shardline_runtime.entrypoints.choices import (
    SafeJSONResponse,
    ChoiceResult,
    chat_choices,
    completion_choices,
    finish_reason_name,
    now_seconds,
    run_choices,
    sse,
    usage_dict,
)
from shardline_runtime.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from shardline_runtime.managers.tokenizer_manager import GenerateChunk, TokenizerManager

_DISCONNECT_POLL_S = 0.1


class ClientDisconnected(Exception):
    """The client of a non-streamed request went away; its requests were aborted."""


def _token_text(tm: TokenizerManager, token_id: int) -> str:
    return tm.tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(tm: TokenizerManager, chunk: GenerateChunk, offset: int) -> dict[str, list]:
    tokens, lps, tops, offsets = [], [], [], []
    for lp, tid, top in chunk.logprobs:
        text = _token_text(tm, tid)
        tokens.append(text)
        lps.append(lp)
        best: dict[str, float] = {}
        for v, t in top:  # tokens with the same text (e.g. partial UTF-8 bytes) share one key
            key = _token_text(tm, t)
            best[key] = max(v, best.get(key, v))
        tops.append(best)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: the printable character each byte-level BPE
    vocabulary uses for a byte -> that byte (Radford et al. 2019, used by every ByteLevel tokenizer)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _gpt2_byte_decoder()


def _token_bytes(tm: TokenizerManager, token_id: int, text: str) -> list[int]:
    """The token's own bytes (a partial UTF-8 byte token is not U+FFFD's bytes)."""
    backend = getattr(tm.tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.decoder).__name__ == "ByteLevel":
        piece = tm.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and all(ch in _BYTE_DECODER for ch in piece):
            return [_BYTE_DECODER[ch] for ch in piece]
    return list(text.encode("utf-8"))


def _chat_logprobs(tm: TokenizerManager, chunk: GenerateChunk) -> dict[str, list]:
    def entry(lp: float, tid: int) -> dict[str, Any]:
        text = _token_text(tm, tid)
        return {"token": text, "logprob": lp, "bytes": _token_bytes(tm, tid, text)}

    return {"content": [dict(entry(lp, tid), top_logprobs=[entry(v, t) for v, t in top]) for lp, tid, top in chunk.logprobs]}


def _merge_logprobs(acc: dict | None, new: dict) -> dict:
    if acc is None:
        return new
    for key, value in new.items():
        acc[key] = acc[key] + value
    return acc


async def until_disconnect(raw: Request, work: Callable[[], Any]) -> Any:
    """Run ``work()`` (a coroutine factory) but cancel it if the client disconnects."""
    task = asyncio.create_task(work())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()


def _streaming(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def serve_completion(req: CompletionRequest, tm: TokenizerManager, model: str, raw: Request):
    """Handle ``POST /v1/completions`` (validated body); raises RequestValidationError for 400s."""
    specs = completion_choices(req, tm)
    await tm.admit()  # held while a weight update runs
    rid, created = f"cmpl-{uuid.uuid4().hex}", now_seconds()
    results = [ChoiceResult(prompt_index=s.prompt_index, text=s.echo_text) for s in specs]
    want_lp = req.logprobs is not None
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    metadata = {"weight_version": tm.weight_version}  # SGLang's response metadata: the weights that ran

    def body(choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        out["metadata"] = metadata
        return out

    def absorb(index: int, chunk: GenerateChunk) -> dict:
        metadata["weight_version"] = chunk.weight_version or metadata["weight_version"]
        r = results[index]
        lp = _completion_logprobs(tm, chunk, len(r.text)) if want_lp else None
        r.text += chunk.text
        r.logprobs = _merge_logprobs(r.logprobs or None, lp) if lp else r.logprobs
        r.finish_reason, r.prompt_tokens = chunk.finish_reason, chunk.prompt_tokens
        r.completion_tokens, r.cached_tokens = chunk.completion_tokens, chunk.cached_tokens
        return {"index": index, "text": chunk.text, "logprobs": lp, "finish_reason": finish_reason_name(chunk.finish_reason)}

    events = run_choices(tm, specs, want_lp, req.logprobs or 0, req.include_stop_str_in_output)
    if req.stream:
        async def stream() -> AsyncIterator[str]:
            for s in specs:
                if s.echo_text:
                    yield sse(body([{"index": s.index, "text": s.echo_text, "logprobs": None, "finish_reason": None}]))
            async for index, chunk in events:
                choice = absorb(index, chunk)
                if choice["text"] or choice["finish_reason"] or chunk.logprobs:
                    yield sse(body([choice]))
            if include_usage:
                yield sse(body([], usage_dict(results)))
            yield "data: [DONE]\n\n"

        return _streaming(stream())

    async def collect() -> None:
        async for index, chunk in events:
            absorb(index, chunk)

    await until_disconnect(raw, collect)
    choices = [
        {"index": i, "text": r.text, "logprobs": r.logprobs or None, "finish_reason": finish_reason_name(r.finish_reason)}
        for i, r in enumerate(results)
    ]
    return SafeJSONResponse(body(choices, usage_dict(results)))


async def serve_chat(req: ChatCompletionRequest, tm: TokenizerManager, model: str, raw: Request):
    """Handle ``POST /v1/chat/completions`` (validated body); raises RequestValidationError for 400s."""
    specs = chat_choices(req, tm)
    await tm.admit()  # held while a weight update runs
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", now_seconds()
    results = [ChoiceResult() for _ in specs]
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    metadata = {"weight_version": tm.weight_version}  # SGLang's response metadata: the weights that ran

    def body(choices: list[dict], usage: dict | None = None, obj: str = "chat.completion.chunk") -> dict:
        out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        out["metadata"] = metadata
        return out

    def absorb(index: int, chunk: GenerateChunk) -> dict | None:
        metadata["weight_version"] = chunk.weight_version or metadata["weight_version"]
        r = results[index]
        lp = _chat_logprobs(tm, chunk) if req.logprobs else None
        r.text += chunk.text
        r.logprobs = _merge_logprobs(r.logprobs or None, lp) if lp else r.logprobs
        r.finish_reason, r.prompt_tokens = chunk.finish_reason, chunk.prompt_tokens
        r.completion_tokens, r.cached_tokens = chunk.completion_tokens, chunk.cached_tokens
        return lp

    events = run_choices(tm, specs, bool(req.logprobs), req.top_logprobs or 0, req.include_stop_str_in_output)
    if req.stream:
        async def stream() -> AsyncIterator[str]:
            for s in specs:
                yield sse(body([{"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]))
            async for index, chunk in events:
                lp = absorb(index, chunk)
                reason = finish_reason_name(chunk.finish_reason)
                if chunk.text or lp:
                    yield sse(body([{"index": index, "delta": {"content": chunk.text}, "logprobs": lp, "finish_reason": None}]))
                if reason is not None:
                    yield sse(body([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}]))
            if include_usage:
                yield sse(body([], usage_dict(results)))
            yield "data: [DONE]\n\n"

        return _streaming(stream())

    async def collect() -> None:
        async for index, chunk in events:
            absorb(index, chunk)

    await until_disconnect(raw, collect)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": r.text},
            "logprobs": r.logprobs or None,
            "finish_reason": finish_reason_name(r.finish_reason),
        }
        for i, r in enumerate(results)
    ]
    return SafeJSONResponse(body(choices, usage_dict(results), obj="chat.completion"))
