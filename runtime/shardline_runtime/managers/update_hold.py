"""The bound on how long a request is held by weight updates (``--weight-update-hold-timeout``).

A request is held in the HTTP process (``AdmissionGate.admit`` waits while an update runs); one
admitted before an update began is served before that update pauses (``ADMITTED_AT`` against
the update's ``requested_at``), but while the update is pending its first output may still wait
in the scheduler's queue behind the requests the update waits for. The bound covers both:
:data:`HELD_SECONDS` carries what ``admit`` spent to the request's ``generate`` (a context
variable, so the HTTP handlers need not pass it), and :func:`first_chunk` counts the time its
first output waits while an update runs against what is left. Time queued behind other requests
while no update runs is load, not a hold, and is not counted.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from typing import Any

# Seconds the current request was held by ``admit`` (0.0 when it was not held).
HELD_SECONDS: contextvars.ContextVar[float] = contextvars.ContextVar(
    "shardline_held_seconds", default=0.0
)
# When ``admit`` let the current request through (``time.monotonic``; None: not yet). A request
# admitted before a disk update's ``requested_at`` is served before that update pauses.
ADMITTED_AT: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "shardline_admitted_at", default=None
)


async def _race(*aws: Any, timeout: float | None = None) -> set[asyncio.Task]:
    """Wait until the first of ``aws`` ends (or ``timeout`` seconds); cancel the rest.
    Returns the tasks that ended."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
    return done


async def first_chunk(
    queue: asyncio.Queue, updating: asyncio.Event, serving: asyncio.Event, budget: float
) -> Any:
    """The first item of ``queue``; the time it waits while ``updating`` is set may not exceed
    ``budget`` seconds in all (``serving`` is set when the update ends).

    Raises:
        asyncio.TimeoutError: the update(s) held it past ``budget`` with nothing in ``queue``.
    """
    left = max(0.0, budget)
    while True:
        if not queue.empty():
            return queue.get_nowait()
        get = asyncio.ensure_future(queue.get())
        if not updating.is_set():  # not held: wait for output, or for an update to begin
            done = await _race(get, updating.wait())
        else:
            began = time.monotonic()
            done = await _race(get, serving.wait(), timeout=left)
            left -= time.monotonic() - began
            if not done:
                raise asyncio.TimeoutError
        if get in done:
            return get.result()
        if left <= 0 and updating.is_set():
            raise asyncio.TimeoutError
