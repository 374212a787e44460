"""Rank 0's load report (``SchedulerStats``), computed only when it can have changed.

The loop reports after every iteration (``Scheduler.send_stats``). Counting the running and queued
requests, the KV and the adapters is a dozen calls, most of them from cold caches after the model's
forward: about a tenth of a batch-1 decode step's host work (``bench/host_overhead.py``). In
steady decode none of it changes but the KV counts, which the :class:`OutputSender` sends at most
every ``KV_STATS_INTERVAL_S`` while requests run. So :class:`StatsReport` keeps a cheap key of the
request counts (the running batch and its length, the queue's length, the chunked request, the
requests compiling their grammars) and skips the report while that key is the one of the last
report and the sender would hold a KV-only change anyway; the outcome is the same messages as
computing every time.

The key stands for the counts because between iterations a running batch holds no finished
request: every path that finishes or aborts one filters it out of the running batch in the same
call (``ResultProcessor.process``, ``BatchPlanner.abort``, ``DecodeManager``). That holds for the
one-slot loop; with pipeline micro-batches (an aborted request stays in its batch in flight),
LoRA (the adapter names are reported) or speculation (its counters change every step) the report
is computed every time.
"""

from __future__ import annotations

from typing import Any

from shardline_runtime.managers.batch_planner import BatchPlanner
from shardline_runtime.managers.cache_manager import CacheManager
from shardline_runtime.managers.decode_manager import DecodeManager
from shardline_runtime.managers.io_struct import SchedulerStats
from shardline_runtime.managers.prefill_manager import PrefillManager
from shardline_runtime.managers.scheduler_output import KV_STATS_INTERVAL_S, OutputSender
from shardline_runtime.managers.speculative_step import SpeculativeDecoding


class StatsReport:
    """Builds and sends rank 0's ``SchedulerStats`` (nothing on other ranks).

    Args:
        planner: the :class:`BatchPlanner` (the request counts and adapters).
        prefill: the :class:`PrefillManager` (the queue and the chunked request).
        decode: the one slot's :class:`DecodeManager`, or None when the report must be computed
            every time (pipeline micro-batches, LoRA).
        cache: the :class:`CacheManager` (KV counts).
        sender: rank 0's :class:`OutputSender`.
        grammar_queue: the requests compiling their grammars (counted as queued), or None.
        speculative: with speculation, its counters (reported, and changing every step).
    """

    def __init__(
        self,
        planner: BatchPlanner,
        prefill: PrefillManager,
        decode: DecodeManager | None,
        cache: CacheManager,
        sender: OutputSender,
        grammar_queue: Any = None,
        speculative: SpeculativeDecoding | None = None,
    ):
        self.planner = planner
        self.prefill = prefill
        self.decode = decode if speculative is None else None
        self.cache = cache
        self.sender = sender
        self.grammar_queue = grammar_queue
        self.speculative = speculative
        self._key: tuple[Any, ...] | None = None  # the request-count key of the last report

    def send(self) -> None:
        """Send the stats when the sender would (see ``OutputSender.send_stats``); computes
        them only when the request counts may have changed or a KV-only change may go out."""
        sender = self.sender
        if sender.socket is None:
            return
        key = self.count_key()
        if key is not None and key == self._key:
            last = sender.last_stats
            if (
                last is not None
                and (last.num_running_reqs or last.num_queued_reqs)
                and sender.clock() - sender.last_stats_at < KV_STATS_INTERVAL_S
            ):
                return  # the counts are the last report's: a KV change would be held back
        sender.send_stats(self.current())
        self._key = key

    def count_key(self) -> tuple[Any, ...] | None:
        """What the request counts of the one-slot loop are a function of (None where the
        report is computed every time)."""
        if self.decode is None:
            return None
        batch = self.decode.running_batch
        prefill, grammars = self.prefill, self.grammar_queue
        return (
            batch,
            0 if batch is None else len(batch.reqs),
            len(prefill.waiting_queue),
            prefill.chunked_req,
            0 if grammars is None else len(grammars),
            self.cache.max_total_num_tokens,
        )

    def current(self) -> SchedulerStats:
        """The stats as they are now (every count computed)."""
        running, queued, running_lora, waiting_lora = self.planner.load_report()
        if self.grammar_queue is not None:
            queued += len(self.grammar_queue)  # compiling their grammars
        stats = SchedulerStats(
            running,
            queued,
            self.cache.used_tokens(),
            self.cache.tree_cache.evictable_size(),
            self.cache.max_total_num_tokens,
            running_lora,
            waiting_lora,
        )
        if self.speculative is not None:
            stats.speculative = self.speculative.stats.snapshot()
        return stats
