"""Per-request step outputs, built on the scheduler side (rank 0) for the HTTP process.

:func:`build_token_outs` turns the requests that advanced in a step into one :class:`TokenOut`
each (new ids, their logprobs, the finish reason, the usage so far) and advances each request's
``sent_len``; :func:`rejected_token_out` answers a request that never ran. The HTTP process
reads them as they are: no positional lists to zip, no dicts to parse. After SGLang's
``BatchTokenIDOutput`` turned per request, as mini-sglang's ``DetokenizeMsg``.
"""

from __future__ import annotations

from collections.abc import Iterable

from shardline_runtime.managers.io_struct import (
    FinishReason,
    TokenLogprob,
    TokenOut,
    Usage,
)
from shardline_runtime.managers.req import Req


def _output_logprobs(req: Req, new: list[int]) -> list[TokenLogprob]:
    """Logprobs of ``new`` (the ids since ``sent_len``); empty when not asked."""
    if not (req.return_logprob and req.output_token_logprobs):
        return []
    values = req.output_token_logprobs[req.sent_len :]
    tops: list[list[tuple[float, int]]] = [[] for _ in new]
    if req.top_logprobs_num:
        tops = [list(zip(v, ids)) for v, ids in req.output_top_logprobs[req.sent_len :]]
    return [TokenLogprob(lp, tid, top) for lp, tid, top in zip(values, new, tops)]


def _prompt_logprobs(req: Req, has_news: bool) -> list[TokenLogprob] | None:
    """Prompt logprobs from ``logprob_start_len`` (once, with the first output); a position the
    model did not score (the first prompt token) has logprob None."""
    if not (
        req.return_logprob
        and req.logprob_start_len >= 0
        and not req.input_logprobs_sent
        and has_news
    ):
        return None
    scored = {pos: (value, top) for pos, value, top in req.prompt_logprobs}
    req.input_logprobs_sent = True
    out = []
    for pos in range(req.logprob_start_len, len(req.origin_input_ids)):
        value, top = scored.get(pos, (None, []))
        out.append(TokenLogprob(value, req.origin_input_ids[pos], list(top)))
    return out


def build_token_outs(reqs: Iterable[Req]) -> list[TokenOut]:
    """One :class:`TokenOut` per request of ``reqs`` with new tokens or a finish; marks what was
    built as sent (``sent_len``, ``input_logprobs_sent``). Requests with no news are skipped."""
    outs = []
    for req in reqs:  # runs per request per step: attributes read once, no call without logprobs
        output_ids, finish = req.output_ids, req.finished_reason
        new = output_ids[req.sent_len :]  # a new list
        if not new and finish is None:
            continue
        logprobs = req.return_logprob
        outs.append(
            TokenOut(
                rid=req.rid,
                ids=new,
                usage=Usage(len(req.origin_input_ids), len(output_ids), req.cached_tokens),
                logprobs=_output_logprobs(req, new) if logprobs else [],
                prompt_logprobs=_prompt_logprobs(req, True) if logprobs else None,
                finish=finish,
                embedding=req.embedding if finish is not None else None,
            )
        )
        req.sent_len = len(output_ids)
    return outs


def rejected_token_out(rid: str, prompt_tokens: int, message: str) -> TokenOut:
    """The answer to a request that can never run: aborted with ``message``, no tokens."""
    return TokenOut(
        rid=rid,
        ids=[],
        usage=Usage(prompt_tokens, 0, 0),
        finish=FinishReason("abort", message=message),
    )
