"""Detokenization of one scheduler step, off the HTTP event loop.

:class:`StepDetokenizer` runs each step's :class:`TokenOut` records through their requests'
:class:`IncrementalDetokenizer` (batched per step, in arrival order) and returns one
:class:`GenerateChunk` per request. It is called from the HTTP process's output receiver
thread (``request_streams.OutputReceiver``), which also receives and unpickles the step, so
the event loop only routes the chunks and no ``tokenizer.decode`` runs on it. After SGLang's
``DetokenizerManager`` (which batches the decode per step in its own process) and mini-sglang's
per-request ``DetokenizeMsg``.

A stop string matched here finishes the request (``FinishReason("stop", <the string>)``); the
caller tells the scheduler to free it. The decodes use a copy of the tokenizer, so the event
loop's own tokenizer calls (encode) never share a Rust tokenizer object with them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from shardline_runtime.managers.detokenizer import IncrementalDetokenizer
from shardline_runtime.managers.io_struct import FinishReason, TokenLogprob, TokenOut, Usage


@dataclass(kw_only=True)
class GenerateChunk:
    """What one request produced since the last chunk.

    ``text`` is the safe text delta; ``token_ids`` the tokens it came from (for a stop-string
    finish, only those consumed up to the match); ``logprobs`` pairs with ``token_ids``;
    ``text_offsets`` pairs with ``token_ids`` too: where each token's text starts in the
    request's whole output text (characters). ``finish`` is None until the last chunk.
    ``usage.completion_tokens`` counts the tokens consumed so far (up to a stop match).
    ``token_texts``: the text of every token id in ``logprobs`` and ``prompt_logprobs`` (their
    alternatives included), decoded alone with special tokens kept (for OpenAI logprobs).
    ``weight_version`` / ``revision``: the weights that produced the chunk (stamped on receipt).
    ``embedding``: an embedding model's vector, on the last chunk.
    """

    text: str
    token_ids: list[int]
    usage: Usage
    finish: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    weight_version: str | None = None
    revision: str | None = None
    text_offsets: list[int] = field(default_factory=list)
    token_texts: dict[int, str] = field(default_factory=dict)
    embedding: list[float] | None = None


def detokenize_out(detok: IncrementalDetokenizer, out: TokenOut) -> tuple[GenerateChunk, bool]:
    """Feed ``out`` to its request's ``detok``; returns the chunk and whether a stop string
    matched in this step while the scheduler still runs the request (it must be freed)."""
    reason = out.finish
    before = detok.num_tokens
    exclude_last = reason is not None and reason.type == "stop" and isinstance(reason.matched, int)
    text = detok.add_tokens(out.ids, exclude_last=exclude_last)
    consumed = detok.num_tokens - before
    stopped_here = False
    if detok.stopped:
        stopped_here = reason is None
        reason = FinishReason("stop", detok.matched_stop)
    if reason is not None:
        text += detok.finish()
    chunk = GenerateChunk(
        text=text,
        token_ids=out.ids[:consumed],
        usage=Usage(out.usage.prompt_tokens, detok.num_tokens, out.usage.cached_tokens),
        finish=reason,
        logprobs=out.logprobs[:consumed],
        prompt_logprobs=out.prompt_logprobs,
        text_offsets=detok.token_offsets[before : before + consumed],
        embedding=out.embedding,
    )
    return chunk, stopped_here


class StepDetokenizer:
    """Per-request incremental detokenizers, fed a step at a time by one thread (the output
    receiver's; never the event loop).

    Args:
        tokenizer: the HuggingFace tokenizer (copied, so the thread owns its copy).
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = copy.deepcopy(tokenizer)

    def new_request(
        self, prompt_ids: list[int], stop: Any, skip_special_tokens: bool, include_stop: bool
    ) -> IncrementalDetokenizer:
        """A detokenizer for one request (decodes nothing until fed)."""
        return IncrementalDetokenizer(
            self.tokenizer, prompt_ids, stop or (), skip_special_tokens, include_stop
        )

    def detokenize(
        self, detok: IncrementalDetokenizer, out: TokenOut
    ) -> tuple[GenerateChunk, bool]:
        """:func:`detokenize_out`, plus the texts of the chunk's logprob tokens (alternatives
        included, decoded alone with special tokens kept)."""
        chunk, stopped_here = detokenize_out(detok, out)
        for entry in (*chunk.logprobs, *(chunk.prompt_logprobs or ())):
            for token_id in (entry.token_id, *(t for _, t in entry.top)):
                if token_id not in chunk.token_texts:
                    chunk.token_texts[token_id] = self.tokenizer.decode(
                        [token_id], skip_special_tokens=False
                    )
        return chunk, stopped_here

    def step(
        self, pairs: list[tuple[IncrementalDetokenizer, TokenOut]]
    ) -> list[tuple[GenerateChunk, bool]]:
        """:meth:`detokenize` of every pair, in order (one scheduler step)."""
        return [self.detokenize(d, o) for d, o in pairs]
