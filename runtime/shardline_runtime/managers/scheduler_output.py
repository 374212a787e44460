"""What rank 0 sends to the HTTP process: token outputs, stats and control replies.

:class:`OutputSender` holds the ZMQ PUSH socket (rank 0 of stage 0 only; on every other rank it
has none and sends nothing). Each step's news go out as one ``BatchTokenOut``: a ``TokenOut`` per
request that advanced, built by ``token_out.build_token_outs``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from shardline_runtime.managers.io_struct import BatchTokenOut, SchedulerStats
from shardline_runtime.managers.req import Req
from shardline_runtime.managers.token_out import build_token_outs, rejected_token_out

logger = logging.getLogger(__name__)


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
        outs = build_token_outs(reqs)
        if outs:
            self.send(BatchTokenOut(outs))

    def reject(self, rid: str, prompt_tokens: int, message: str) -> None:
        """Answer a request that can never run (the HTTP process validates first; defensive)."""
        logger.warning("rejecting %s: %s", rid, message)
        self.send(BatchTokenOut([rejected_token_out(rid, prompt_tokens, message)]))

    def send_stats(self, stats: SchedulerStats) -> None:
        """Send ``stats`` when they differ from the last sent."""
        if self.socket is not None and stats != self.last_stats:
            self.last_stats = stats
            self.send(stats)
