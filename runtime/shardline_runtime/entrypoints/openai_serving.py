"""OpenAI ``/v1/completions`` and ``/v1/chat/completions`` responses (JSON and SSE streams).

Streamed and non-streamed responses are built from the same chunks: the non-streamed text is
the concatenation of the deltas a stream would send, so the two are equal by construction.
A non-streamed request whose client disconnects is aborted (the HTTP request is polled while
waiting); a stream is aborted when Starlette cancels the generator.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from shardline_runtime.entrypoints.choices import (
    ChoiceResult,
    SafeJSONResponse,
    chat_choices,
    completion_choices,
    finish_reason_name,
    now_seconds,
    run_choices,
    sse,
    usage_dict,
)
from shardline_runtime.entrypoints.errors import guard_stream
from shardline_runtime.entrypoints.logprobs import (
    chat_logprobs,
    completion_logprobs,
    merge_logprobs,
    prompt_text_offsets,
)
from shardline_runtime.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from shardline_runtime.managers.tokenizer_manager import GenerateChunk, TokenizerManager

_DISCONNECT_POLL_S = 0.1


class ClientDisconnected(Exception):
    """The client of a non-streamed request went away; its requests were aborted."""


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
    return StreamingResponse(
        guard_stream(gen), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def serve_completion(req: CompletionRequest, tm: TokenizerManager, model: str, raw: Request):
    """Handle ``POST /v1/completions`` (validated body); raises RequestValidationError for 400s."""
    specs = completion_choices(req, tm)
    await (
        tm.admit()
    )  # held during a weight update or a pause, 503 now: before a stream's headers go out
    rid, created = f"cmpl-{uuid.uuid4().hex}", now_seconds()
    results = [ChoiceResult(prompt_index=s.prompt_index) for s in specs]
    started: set[int] = set()
    want_lp = req.logprobs is not None
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    metadata = {
        "weight_version": tm.weight_version
    }  # SGLang's response metadata: the weights that ran

    def body(choices: list[dict], usage: dict | None = None) -> dict:
        out = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage
        out["metadata"] = metadata
        return out

    def absorb(index: int, chunk: GenerateChunk) -> dict:
        """Fold ``chunk`` into choice ``index``; the first chunk also carries the echoed prompt
        (and its logprobs, which arrive with it)."""
        metadata["weight_version"] = chunk.weight_version or metadata["weight_version"]
        r, spec = results[index], specs[index]
        text = chunk.text
        lp = (
            completion_logprobs(tm, chunk.logprobs, chunk.text_offsets, len(spec.echo_text))
            if want_lp
            else None
        )
        if index not in started:
            started.add(index)
            text = spec.echo_text + text
            if want_lp and chunk.prompt_logprobs is not None:
                offsets = prompt_text_offsets(tm, spec.input_ids, spec.added_prefix, spec.echo_text)
                prompt_lp = completion_logprobs(tm, chunk.prompt_logprobs, offsets, 0)
                lp = merge_logprobs(prompt_lp, lp) if lp else prompt_lp
        r.text += text
        r.logprobs = merge_logprobs(r.logprobs or None, lp) if lp else r.logprobs
        r.finish_reason, r.prompt_tokens = chunk.finish_reason, chunk.prompt_tokens
        r.completion_tokens, r.cached_tokens = chunk.completion_tokens, chunk.cached_tokens
        return {
            "index": index,
            "text": text,
            "logprobs": lp,
            "finish_reason": finish_reason_name(chunk.finish_reason),
        }

    events = run_choices(
        tm,
        specs,
        want_lp,
        req.logprobs or 0,
        req.include_stop_str_in_output,
        tm.lora_for_model(req.model),
    )
    if req.stream:

        async def stream() -> AsyncIterator[str]:
            async for index, chunk in events:
                choice = absorb(index, chunk)
                if (
                    choice["text"]
                    or choice["finish_reason"]
                    or (choice["logprobs"] and choice["logprobs"]["tokens"])
                ):
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
        {
            "index": i,
            "text": r.text,
            "logprobs": r.logprobs or None,
            "finish_reason": finish_reason_name(r.finish_reason),
        }
        for i, r in enumerate(results)
    ]
    return SafeJSONResponse(body(choices, usage_dict(results)))


async def serve_chat(req: ChatCompletionRequest, tm: TokenizerManager, model: str, raw: Request):
    """Handle ``POST /v1/chat/completions`` (validated body); raises RequestValidationError for 400s."""
    specs = chat_choices(req, tm)
    await (
        tm.admit()
    )  # held during a weight update or a pause, 503 now: before a stream's headers go out
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", now_seconds()
    results = [ChoiceResult() for _ in specs]
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    metadata = {
        "weight_version": tm.weight_version
    }  # SGLang's response metadata: the weights that ran

    def body(
        choices: list[dict], usage: dict | None = None, obj: str = "chat.completion.chunk"
    ) -> dict:
        out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        out["metadata"] = metadata
        return out

    def absorb(index: int, chunk: GenerateChunk) -> dict | None:
        metadata["weight_version"] = chunk.weight_version or metadata["weight_version"]
        r = results[index]
        lp = chat_logprobs(tm, chunk.logprobs) if req.logprobs else None
        r.text += chunk.text
        r.logprobs = merge_logprobs(r.logprobs or None, lp) if lp else r.logprobs
        r.finish_reason, r.prompt_tokens = chunk.finish_reason, chunk.prompt_tokens
        r.completion_tokens, r.cached_tokens = chunk.completion_tokens, chunk.cached_tokens
        return lp

    events = run_choices(
        tm,
        specs,
        bool(req.logprobs),
        req.top_logprobs or 0,
        req.include_stop_str_in_output,
        tm.lora_for_model(req.model),
    )
    if req.stream:

        async def stream() -> AsyncIterator[str]:
            for s in specs:
                yield sse(
                    body(
                        [
                            {
                                "index": s.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                )
            async for index, chunk in events:
                lp = absorb(index, chunk)
                reason = finish_reason_name(chunk.finish_reason)
                if chunk.text or lp:
                    yield sse(
                        body(
                            [
                                {
                                    "index": index,
                                    "delta": {"content": chunk.text},
                                    "logprobs": lp,
                                    "finish_reason": None,
                                }
                            ]
                        )
                    )
                if reason is not None:
                    yield sse(
                        body(
                            [
                                {
                                    "index": index,
                                    "delta": {},
                                    "logprobs": None,
                                    "finish_reason": reason,
                                }
                            ]
                        )
                    )
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
