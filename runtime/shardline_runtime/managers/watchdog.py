"""The scheduler's step watchdog: a stuck collective or a dead peer becomes an error, never a hang."""

from __future__ import annotations

import logging
import os
import threading
import time

from shardline_runtime.termination_log import write_termination_log

logger = logging.getLogger(__name__)


class Watchdog:
    """Exits the process when one loop iteration (the broadcast of its messages, the forward,
    the results) runs longer than ``limit`` seconds (``--watchdog-timeout``).

    The loop calls :meth:`begin` and :meth:`end` around each iteration; work that may rightly
    take longer (loading a checkpoint, joining a weight-sync group) calls :meth:`end` first, so
    it is not timed.

    Args:
        limit: seconds one iteration may take.
        tp_rank: for the log line.
    """

    def __init__(self, limit: float, tp_rank: int):
        self.limit = limit
        self.tp_rank = tp_rank
        self.step_started: float | None = None  # time.monotonic() of the iteration running

    def begin(self) -> None:
        self.step_started = time.monotonic()

    def end(self) -> None:
        self.step_started = None

    def overdue(self, now: float) -> bool:
        """True when the iteration running at ``now`` (monotonic seconds) is past the limit."""
        started = self.step_started
        return started is not None and now - started > self.limit

    def start(self) -> None:
        """Start the watching thread (a daemon)."""
        threading.Thread(target=self._watch, name="scheduler-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(min(5.0, self.limit / 4))
            if self.overdue(time.monotonic()):
                message = (
                    f"[tp {self.tp_rank}] watchdog: a forward step ran over {self.limit}s "
                    "(a peer rank may be dead)"
                )
                logger.error(message)
                write_termination_log(message)
                os._exit(1)
