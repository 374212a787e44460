"""What rank 0 sends to the HTTP process: token outputs, stats and control replies.

:class:`OutputSender` holds the ZMQ PUSH socket (rank 0 of stage 0 only; on every other rank it
has none and sends nothing). :func:`token_output` builds one ``BatchTokenIDOut`` with the new
tokens (and logprobs) of every request that advanced in a step; it is the one place that knows
that message's layout.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from shardline_runtime.managers.io_struct import BatchTokenIDOut, SchedulerStats
from shardline_runtime.managers.req import FinishReason, Req

logger = logging.getLogger(__name__)


def _reason_dict(reason: FinishReason | None) -> dict | None:
    if reason is None:
        return None
    out: dict = {"type": reason.type}
    if reason.type == "stop":
        out["matched"] = reason.matched
    elif reason.type == "length":
        out["length"] = reason.matched
    if reason.message:
        out["message"] = reason.message
    return out


def token_output(reqs: Iterable[Req]) -> BatchTokenIDOut | None:
    """The new tokens, finish reasons and logprobs of ``reqs`` since their last output, or None
    when none of them has news. Marks what it takes as sent (``req.sent_len``,
    ``req.input_logprobs_sent``)."""
    out = BatchTokenIDOut([], [], [], [], [], [], [], [], [], [])
    for req in reqs:
        new = req.output_ids[req.sent_len :]
        if not new and not req.finished():
            continue
        out.rids.append(req.rid)
        out.output_ids.append(list(new))
        out.finished_reasons.append(_reason_dict(req.finished_reason))
        out.prompt_tokens.append(len(req.origin_input_ids))
        out.completion_tokens.append(len(req.output_ids))
        out.cached_tokens.append(req.cached_tokens)
        if req.return_logprob and req.output_token_logprobs:
            lps = req.output_token_logprobs[req.sent_len :]
            out.output_token_logprobs.append(list(zip(lps, new)))
            tops = req.output_top_logprobs[req.sent_len :] if req.top_logprobs_num else None
            out.output_top_logprobs.append([list(zip(v, ids)) for v, ids in tops] if tops else None)
        else:
            out.output_token_logprobs.append(None)
            out.output_top_logprobs.append(None)
        prompt = None
        if (
            req.return_logprob
            and req.logprob_start_len >= 0
            and not req.input_logprobs_sent
            and (new or req.finished())
        ):
            scored = {pos: (value, top) for pos, value, top in req.prompt_logprobs}
            prompt = [
                (
                    scored.get(pos, (None, []))[0],
                    req.origin_input_ids[pos],
                    scored.get(pos, (None, []))[1],
                )
                for pos in range(req.logprob_start_len, len(req.origin_input_ids))
            ]
            req.input_logprobs_sent = True
        out.input_token_logprobs.append(
            [(lp, t) for lp, t, _ in prompt] if prompt is not None else None
        )
        out.input_top_logprobs.append([top for _, _, top in prompt] if prompt is not None else None)
        req.sent_len = len(req.output_ids)
    return out if out.rids else None


def rejection_output(rid: str, prompt_tokens: int, message: str) -> BatchTokenIDOut:
    """The one output of a request that can never run: finished with ``abort`` and ``message``."""
    return BatchTokenIDOut(
        [rid],
        [[]],
        [{"type": "abort", "message": message}],
        [prompt_tokens],
        [0],
        [0],
        [None],
        [None],
        [None],
        [None],
    )


class OutputSender:
    """Rank 0's side of the output socket to the HTTP process.

    Args:
        socket: a ZMQ PUSH socket (anything with ``send_pyobj``), or None on ranks that send
            nothing.

    Attributes:
        last_stats: the last ``SchedulerStats`` sent (stats are sent only when they change).
    """

    def __init__(self, socket: Any = None):
        self.socket = socket
        self.last_stats: SchedulerStats | None = None

    @property
    def enabled(self) -> bool:
        return self.socket is not None

    def send(self, msg: Any) -> None:
        if self.socket is not None:
            self.socket.send_pyobj(msg)

    def stream(self, reqs: Iterable[Req]) -> None:
        """Send the news of ``reqs`` (new tokens, finish reasons) as one output."""
        if self.socket is None:
            return
        out = token_output(reqs)
        if out is not None:
            self.send(out)

    def reject(self, rid: str, prompt_tokens: int, message: str) -> None:
        """Answer a request that can never run (the HTTP process validates first; defensive)."""
        logger.warning("rejecting %s: %s", rid, message)
        self.send(rejection_output(rid, prompt_tokens, message))

    def send_stats(self, stats: SchedulerStats) -> None:
        """Send ``stats`` when they differ from the last sent."""
        if self.socket is not None and stats != self.last_stats:
            self.last_stats = stats
            self.send(stats)
