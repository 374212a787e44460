"""What rank 0 sends to the HTTP process: token outputs, stats and control replies.

:class:`OutputSender` holds the ZMQ PUSH socket (rank 0 of stage 0 only; on every other rank it
has none and sends nothing). Each step's news go out as one ``BatchTokenOut``: a ``TokenOut`` per
request that advanced, built by ``token_out.build_token_outs``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from shardline_runtime.managers.io_struct import BatchTokenOut, SchedulerStats
from shardline_runtime.managers.req import Req
from shardline_runtime.managers.token_out import build_token_outs, rejected_token_out

logger = logging.getLogger(__name__)

# A change of the KV counts alone (every decode step) is reported at most this often, seconds.
KV_STATS_INTERVAL_S = 0.02


class OutputSender:
    """Rank 0's side of the output socket to the HTTP process.

    Args:
        socket: a ZMQ PUSH socket (anything with ``send_pyobj``), or None on ranks that send
            nothing.
        clock: seconds, monotonic (for :meth:`send_stats`' interval).

    Attributes:
        last_stats: the last ``SchedulerStats`` sent (stats are sent only when they change).
    """

    def __init__(self, socket: Any = None, clock: Callable[[], float] = time.monotonic):
        self.socket = socket
        self.clock = clock
        self.last_stats: SchedulerStats | None = None
        self.last_stats_at = float("-inf")
        self._last_key: tuple[Any, ...] | None = None  # _without_kv(last_stats)

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
        """Send ``stats`` when they differ from the last sent: at once when a request count,
        the adapters or the speculative counters changed, or nothing runs or waits; when only
        the KV counts changed (every decode step does), at most every ``KV_STATS_INTERVAL_S``
        (the loop calls this after every step, so a held change goes out with a later call)."""
        last = self.last_stats
        if self.socket is None:
            return
        key = _without_kv(stats)
        now = None
        if last is not None and key == self._last_key:  # at most the KV counts changed
            if (
                stats.kv_used_tokens == last.kv_used_tokens
                and stats.kv_evictable_tokens == last.kv_evictable_tokens
            ):
                return  # equal to the last sent
            now = self.clock()
            if (
                stats.num_running_reqs or stats.num_queued_reqs
            ) and now - self.last_stats_at < KV_STATS_INTERVAL_S:
                return
        self.last_stats, self._last_key = stats, key
        self.last_stats_at = self.clock() if now is None else now
        self.send(stats)


def _without_kv(stats: SchedulerStats) -> tuple[Any, ...]:
    return (
        stats.num_running_reqs,
        stats.num_queued_reqs,
        stats.max_total_num_tokens,
        stats.running_lora_adapters,
        stats.waiting_lora_adapters,
        stats.speculative,
    )
