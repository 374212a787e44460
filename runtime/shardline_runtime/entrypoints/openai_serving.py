"""OpenAI ``/v1/completions`` and ``/v1/chat/completions`` responses (JSON and SSE streams).

Both run one skeleton, :class:`OpenAIServing` (``collect`` / ``stream`` / ``body``), with two
hooks per endpoint: ``piece`` (a chunk's text and logprobs object for its choice) and ``render``
(the choice objects of a stream event, or of the final body). After SGLang's
``entrypoints/openai/serving_base.py``.

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

from shardline_runtime.entrypoints.chat_output import ChatOutput, ChatParsers
from shardline_runtime.entrypoints.choices import (
    ChoiceResult,
    ChoiceSpec,
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
from shardline_runtime.entrypoints.structured_output import request_grammar
from shardline_runtime.entrypoints.version_headers import pin_from_headers, version_headers
from shardline_runtime.managers.step_detokenizer import GenerateChunk
from shardline_runtime.managers.tokenizer_manager import TokenizerManager
from shardline_runtime.managers.version_pin import VersionPin

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


def _streaming(gen: AsyncIterator[str], headers: dict[str, str]) -> StreamingResponse:
    return StreamingResponse(
        guard_stream(gen),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", **headers},
    )


class OpenAIServing:
    """One OpenAI request: run its choices, then answer as one body or as an SSE stream.

    Subclasses give ``object_name`` / ``chunk_object`` and the two hooks :meth:`piece` and
    :meth:`render`; :meth:`opening` may add stream events before the first token.
    """

    object_name = ""
    chunk_object = ""

    def __init__(
        self,
        tm: TokenizerManager,
        model: str,
        specs: list[ChoiceSpec],
        prefix: str,
        pin: VersionPin | None = None,
    ):
        self.tm, self.model, self.specs, self.pin = tm, model, specs, pin
        self.rid, self.created = f"{prefix}-{uuid.uuid4().hex}", now_seconds()
        self.results = [ChoiceResult(prompt_index=s.prompt_index) for s in specs]
        # SGLang's response metadata: the weights that ran (plus their revision)
        weights = tm.state.weights
        self.metadata = {"weight_version": weights.weight_version, "revision": weights.revision}
        self._started: set[int] = set()

    # ---------------------------------------------------------------- hooks

    def piece(self, index: int, chunk: GenerateChunk, first: bool) -> tuple[str, dict | None]:
        """The text ``chunk`` adds to choice ``index`` and its logprobs object (or None)."""
        raise NotImplementedError

    def render(
        self, index: int, text: str, logprobs: dict | None, finish: str | None, final: bool
    ) -> list[dict]:
        """Choice objects: of one stream event (``final`` False; [] sends nothing) or the one
        choice of the final body (``final`` True: whole text, logprobs and finish)."""
        raise NotImplementedError

    def opening(self) -> list[dict]:
        """Choice objects sent, one event each, before the first chunk of a stream."""
        return []

    # ---------------------------------------------------------------- skeleton

    def body(self, choices: list[dict], usage: dict | None = None, final: bool = False) -> dict:
        out: dict[str, Any] = {
            "id": self.rid,
            "object": self.object_name if final else self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage
        out["metadata"] = self.metadata
        return out

    def absorb(self, index: int, chunk: GenerateChunk) -> tuple[str, dict | None]:
        """Fold ``chunk`` into choice ``index``; returns its text and logprobs piece."""
        if chunk.weight_version is not None:
            self.metadata.update(weight_version=chunk.weight_version, revision=chunk.revision)
        text, lp = self.piece(index, chunk, index not in self._started)
        self._started.add(index)
        r = self.results[index]
        r.text += text
        r.logprobs = merge_logprobs(r.logprobs or None, lp) if lp else r.logprobs
        r.finish_reason = chunk.finish
        r.prompt_tokens = chunk.usage.prompt_tokens
        r.completion_tokens = chunk.usage.completion_tokens
        r.cached_tokens = chunk.usage.cached_tokens
        return text, lp

    async def stream(
        self, events: AsyncIterator[tuple[int, GenerateChunk]], include_usage: bool
    ) -> AsyncIterator[str]:
        for choice in self.opening():
            yield sse(self.body([choice]))
        async for index, chunk in events:
            text, lp = self.absorb(index, chunk)
            for choice in self.render(index, text, lp, finish_reason_name(chunk.finish), False):
                yield sse(self.body([choice]))
        if include_usage:
            yield sse(self.body([], usage_dict(self.results)))
        yield "data: [DONE]\n\n"

    async def collect(self, events: AsyncIterator[tuple[int, GenerateChunk]]) -> dict:
        async for index, chunk in events:
            self.absorb(index, chunk)
        choices = [
            c
            for i, r in enumerate(self.results)
            for c in self.render(
                i, r.text, r.logprobs or None, finish_reason_name(r.finish_reason), True
            )
        ]
        return self.body(choices, usage_dict(self.results), final=True)

    async def respond(self, req: Any, raw: Request, want_lp: bool, top_logprobs: int):
        """Run the choices of ``req`` (already admitted) and answer."""
        events = run_choices(
            self.tm,
            self.specs,
            want_lp,
            top_logprobs,
            req.include_stop_str_in_output,
            self.tm.state.lora_for_model(req.model),
            self.pin,
        )
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _streaming(self.stream(events, include_usage), self._headers())
        body: dict = await until_disconnect(raw, lambda: self.collect(events))
        return SafeJSONResponse(body, headers=self._headers())

    def _headers(self) -> dict[str, str]:
        return version_headers(self.metadata["revision"], self.metadata["weight_version"])


class _CompletionServing(OpenAIServing):
    """``/v1/completions``: the first chunk of a choice carries the echoed prompt (and its
    logprobs, which arrive with it)."""

    object_name = "text_completion"
    chunk_object = "text_completion"
    want_lp = False

    def piece(self, index: int, chunk: GenerateChunk, first: bool) -> tuple[str, dict | None]:
        spec, tm = self.specs[index], self.tm
        text = chunk.text
        lp = None
        if self.want_lp:
            lp = completion_logprobs(
                chunk.token_texts, chunk.logprobs, chunk.text_offsets, len(spec.echo_text)
            )
        if first:
            text = spec.echo_text + text
            if self.want_lp and chunk.prompt_logprobs is not None:
                offsets = prompt_text_offsets(tm, spec.input_ids, spec.added_prefix, spec.echo_text)
                prompt_lp = completion_logprobs(
                    chunk.token_texts, chunk.prompt_logprobs, offsets, 0
                )
                lp = merge_logprobs(prompt_lp, lp) if lp else prompt_lp
        return text, lp

    def render(
        self, index: int, text: str, logprobs: dict | None, finish: str | None, final: bool
    ) -> list[dict]:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if final or text or finish or (logprobs and logprobs["tokens"]):
            return [choice]
        return []


class _ChatServing(OpenAIServing):
    """``/v1/chat/completions``: a stream opens with each choice's role, and ends each choice
    with an empty delta carrying its ``finish_reason``. Each choice's reply goes through its
    :class:`ChatOutput` (reasoning and tool-call parsers); a reply with tool calls that
    stopped by itself finishes with ``tool_calls``."""

    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    want_lp = False
    outputs: list[ChatOutput]  # one per choice, set by serve_chat

    def piece(self, index: int, chunk: GenerateChunk, first: bool) -> tuple[str, dict | None]:
        return chunk.text, chat_logprobs(
            self.tm, chunk.token_texts, chunk.logprobs
        ) if self.want_lp else None

    def opening(self) -> list[dict]:
        return [
            {
                "index": s.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for s in self.specs
        ]

    def render(
        self, index: int, text: str, logprobs: dict | None, finish: str | None, final: bool
    ) -> list[dict]:
        output = self.outputs[index]
        if final:
            message, has_calls = output.message(text)
            finish = "tool_calls" if has_calls and finish == "stop" else finish
            return [
                {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
            ]
        out = []
        delta = output.delta(text, final=finish is not None)
        if delta or logprobs:
            out.append(
                {
                    "index": index,
                    "delta": delta or {"content": ""},
                    "logprobs": logprobs,
                    "finish_reason": None,
                }
            )
        if finish is not None:
            finish = "tool_calls" if output.has_tool_calls and finish == "stop" else finish
            out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish})
        return out


async def serve_completion(req: CompletionRequest, tm: TokenizerManager, model: str, raw: Request):
    """Handle ``POST /v1/completions`` (validated body); raises RequestValidationError for 400s."""
    await tm.validator.compile_grammar(request_grammar(req))  # off the event loop
    specs = completion_choices(req, tm)
    pin = pin_from_headers(raw.headers)
    # held during a weight update or a pause, 503 now: before a stream's headers go out
    await tm.admit(pin)
    serving = _CompletionServing(tm, model, specs, "cmpl", pin)
    serving.want_lp = req.logprobs is not None
    return await serving.respond(req, raw, serving.want_lp, req.logprobs or 0)


async def serve_chat(
    req: ChatCompletionRequest,
    tm: TokenizerManager,
    model: str,
    raw: Request,
    parsers: ChatParsers | None = None,
):
    """Handle ``POST /v1/chat/completions`` (validated body) with the server's ``parsers``
    (None: none); raises RequestValidationError for 400s. A constrained reply (a grammar from
    ``response_format`` or a forced tool call) is not split for reasoning: the grammar holds
    from its first token."""
    parsers = parsers or ChatParsers()
    await tm.validator.compile_grammar(request_grammar(req))  # as serve_completion
    specs, plan = chat_choices(req, tm, parsers.tool_format)
    pin = pin_from_headers(raw.headers)
    await tm.admit(pin)  # as serve_completion
    serving = _ChatServing(tm, model, specs, "chatcmpl", pin)
    serving.want_lp = bool(req.logprobs)
    serving.outputs = [
        ChatOutput(
            parsers.reasoning if spec.grammar is None else None,
            parsers.tool_format if plan.parse else None,
        )
        for spec in specs
    ]
    return await serving.respond(req, raw, serving.want_lp, req.top_logprobs or 0)
