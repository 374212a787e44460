"""OpenAI requests -> choices: validation, tokenization, sampling params, and running them.

Each (prompt, choice) pair runs as one scheduler request (one ``TokenizedGenerateReqInput``)
through ``TokenizerManager.generate``; :func:`run_choices` merges their chunks in arrival order.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, cast

from fastapi.responses import JSONResponse

from shardline_runtime.constrained.grammar_spec import GrammarSpec
from shardline_runtime.entrypoints.chat_messages import chat_prompt_ids
from shardline_runtime.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from shardline_runtime.entrypoints.refused_fields import check_refused_chat_fields
from shardline_runtime.entrypoints.structured_output import request_grammar
from shardline_runtime.entrypoints.tool_calls import ToolPlan, tool_plan
from shardline_runtime.entrypoints.tool_parsers import ToolCallFormat
from shardline_runtime.managers.io_struct import FinishReason, TokenizedGenerateReqInput
from shardline_runtime.managers.request_validation import RequestValidationError
from shardline_runtime.managers.step_detokenizer import GenerateChunk
from shardline_runtime.managers.tokenizer_manager import TokenizerManager
from shardline_runtime.managers.version_pin import VersionPin
from shardline_runtime.sampling.sampling_params import SamplingParams, SamplingParamsError

_SEED_MAX = 2**63 - 1


@dataclass
class ChoiceSpec:
    index: int
    input_ids: list[int]
    params: SamplingParams
    prompt_index: int = 0
    echo_text: str = ""
    logprob_start_len: int = -1  # 0: return prompt logprobs (echo + logprobs)
    added_prefix: int = 0  # tokens the tokenizer put before a text prompt (BOS)
    grammar: GrammarSpec | None = None  # constrained decoding (None: free text)


@dataclass
class ChoiceResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: dict | None = None  # OpenAI logprobs object, merged chunk by chunk
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_index: int = 0


def finish_reason_name(reason: FinishReason | None) -> str | None:
    """OpenAI ``finish_reason``: ``stop``, ``length`` or ``abort`` (None while running)."""
    return None if reason is None else reason.type


def build_params(req, max_new_tokens: int | None, choice: int) -> SamplingParams:
    """SamplingParams of choice ``choice`` (seed + choice when seeded).

    Raises:
        RequestValidationError: a sampling field is out of range (names the field).
    """
    values = req.sampling_dict(max_new_tokens)
    if "seed" in values and choice:
        if isinstance(values["seed"], int) and values["seed"] >= 0:
            values["seed"] = (values["seed"] + choice) % (_SEED_MAX + 1)
    try:
        return SamplingParams(**values)
    except SamplingParamsError as exc:
        raise RequestValidationError(str(exc), exc.field) from None


def _check_common(req, tm: TokenizerManager) -> GrammarSpec | None:
    """Checks both endpoints share; returns the request's output constraint (compiled once here,
    so a schema the grammar library rejects is a 400 naming its field)."""
    grammar = request_grammar(req)
    if grammar is not None:
        tm.validator.check_grammar(grammar)
    if req.logit_bias:
        raise RequestValidationError("logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        # OpenAI's and vLLM's answer: usage options of a stream would be silently dropped
        raise RequestValidationError(
            "stream_options is only allowed when stream is true", "stream_options"
        )
    if req.stop_token_ids:
        bad = [t for t in req.stop_token_ids if not 0 <= t < tm.info.vocab_size]
        if bad:
            raise RequestValidationError(
                f"stop_token_ids must be in [0, {tm.info.vocab_size}), got {bad[0]}",
                "stop_token_ids",
            )
    return grammar


def _max_tokens(value: int | None, name: str, echo: bool = False) -> int | None:
    """``max_tokens`` checked: >= 1, or 0 with ``echo`` (score the prompt only, as lm-eval asks;
    vLLM and OpenAI's legacy completions accept it too)."""
    if value is not None and value < (0 if echo else 1):
        allowed = ">= 0 with echo" if echo else ">= 1 (0 only with echo: true)"
        raise RequestValidationError(f"{name} must be {allowed}, got {value}", name)
    return value


def completion_choices(req: CompletionRequest, tm: TokenizerManager) -> list[ChoiceSpec]:
    """Tokenize and validate a completion request into ``len(prompts) * n`` choices."""
    grammar = _check_common(req, tm)
    if req.suffix:
        raise RequestValidationError("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise RequestValidationError(
            f"best_of must equal n ({req.n}) when set, got {req.best_of}", "best_of"
        )
    prompt = req.prompt
    prompts: list[str | list[int]]
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [cast("str | list[int]", prompt)]  # one prompt: text or token ids
    else:
        prompts = cast("list[str | list[int]]", list(prompt))  # a batch of texts or token-id lists
    if not prompts:
        raise RequestValidationError("prompt must not be empty", "prompt")
    max_tokens = _max_tokens(req.max_tokens, "max_tokens", req.echo)
    prompt_logprobs = req.echo and req.logprobs is not None
    specs: list[ChoiceSpec] = []
    for k, p in enumerate(prompts):
        added = 0
        if isinstance(p, str):
            tm.validator.check_text_length(p, "prompt")
            p_ids, added = tm.validator.encode_text(p, req.add_special_tokens)
        # checks ids and emptiness
        ids = tm.validator.tokenize(p_ids if isinstance(p, str) else p, "prompt")
        budget = tm.validator.check_lengths(ids, max_tokens)
        echo = (p if isinstance(p, str) else tm.tokenizer.decode(ids)) if req.echo else ""
        for j in range(req.n):
            specs.append(
                ChoiceSpec(
                    len(specs),
                    ids,
                    build_params(req, budget, j),
                    k,
                    echo,
                    0 if prompt_logprobs else -1,
                    added,
                    grammar,
                )
            )
    return specs


def chat_choices(
    req: ChatCompletionRequest, tm: TokenizerManager, tool_format: ToolCallFormat | None = None
) -> tuple[list[ChoiceSpec], ToolPlan]:
    """Validate and tokenize a chat request into its ``n`` choices, and its tool plan
    (``tool_format``: the server's tool-call format, None when its model has none).

    Raises:
        RequestValidationError: a refused or malformed field (names it).
    """
    check_refused_chat_fields(req.model_extra or {})
    grammar = _check_common(req, tm)
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, tool_format)
    if plan.grammar is not None:
        # OpenAI's response_format shapes a text reply; a forced reply is calls only, so the
        # call's grammar is the whole constraint. regex / ebnf constrain the whole reply: a clash.
        if grammar is not None and grammar.param != "response_format":
            raise RequestValidationError(
                f"tool_choice: a forced tool call is an output constraint, and {grammar.param} "
                "is set too (one per request); use tool_choice auto with it",
                "tool_choice",
            )
        grammar = plan.grammar
        tm.validator.check_grammar(grammar)
    if req.top_logprobs and not req.logprobs:
        raise RequestValidationError("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = _max_tokens(
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        "max_tokens",
    )
    ids = chat_prompt_ids(req, tm, plan.tools)
    budget = tm.validator.check_lengths(ids, max_tokens)
    specs = [
        ChoiceSpec(j, ids, build_params(req, budget, j), grammar=grammar) for j in range(req.n)
    ]
    return specs, plan


async def run_choices(
    tm: TokenizerManager,
    specs: list[ChoiceSpec],
    return_logprob: bool,
    top_logprobs: int,
    include_stop: bool,
    lora_name: str | None = None,
    pin: VersionPin | None = None,
) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """Run every choice (with LoRA adapter ``lora_name``, None: the base model; fenced to
    ``pin``'s weights); yield ``(index, chunk)`` in arrival order. Leaving early aborts them
    all. The caller has already admitted the request (``TokenizerManager.admit``), so no choice
    is held again."""
    tm.gate.check_ready()

    def request(spec: ChoiceSpec) -> TokenizedGenerateReqInput:
        return TokenizedGenerateReqInput(
            rid=tm.new_rid(),
            input_ids=spec.input_ids,
            sampling_params=spec.params,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs,
            logprob_start_len=spec.logprob_start_len,
            include_stop_str_in_output=include_stop,
            lora_name=lora_name,
            grammar=spec.grammar,
        )

    if len(specs) == 1:  # one choice: its chunks as they come, no task or queue in between
        (only,) = specs
        async with aclosing(tm.generate(request(only), admitted=True, pin=pin)) as chunks:
            async for chunk in chunks:  # leaving early closes ``chunks``: aborts the request
                yield only.index, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(spec: ChoiceSpec) -> None:
        try:
            async for chunk in tm.generate(request(spec), admitted=True, pin=pin):
                queue.put_nowait((spec.index, chunk))
        except Exception as exc:  # surfaced to the consumer below
            queue.put_nowait((spec.index, exc))

    tasks = [asyncio.create_task(pump(s)) for s in specs]
    remaining = len(specs)
    try:
        while remaining:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item.finish is not None:
                remaining -= 1
            yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage_dict(results: list[ChoiceResult]) -> dict[str, Any]:
    """OpenAI ``usage``: each distinct prompt counted once (its ``n`` choices share it)."""
    first: dict[int, ChoiceResult] = {}
    for r in results:
        first.setdefault(r.prompt_index, r)
    prompt = sum(r.prompt_tokens for r in first.values())
    cached = sum(r.cached_tokens for r in first.values())
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats replaced so it is valid JSON: ``-inf`` -> -9999.0 (the
    floor vLLM reports for impossible tokens), NaN and ``+inf`` -> None (broken weights)."""
    if isinstance(value, float) and not math.isfinite(value):
        return -9999.0 if value == float("-inf") else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class SafeJSONResponse(JSONResponse):
    """A JSONResponse that never emits the non-JSON constants NaN / Infinity."""

    def render(self, content: Any) -> bytes:
        return json.dumps(json_safe(content), ensure_ascii=False, allow_nan=False).encode("utf-8")


def sse(data: Any) -> str:
    """One server-sent event of ``data`` as JSON (non-finite floats as :func:`json_safe` says).

    The common event (text, no logprobs) has no non-finite float, so it is dumped as it is;
    only an event that fails that is walked by :func:`json_safe` and dumped again.
    """
    try:
        body = json.dumps(data, ensure_ascii=False, allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere (a logprob of -inf)
        body = json.dumps(json_safe(data), ensure_ascii=False, allow_nan=False)
    return f"data: {body}\n\n"


def now_seconds() -> int:
    return int(time.time())
