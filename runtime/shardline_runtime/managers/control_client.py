"""ControlClient: typed request/reply calls from the HTTP process to the schedulers.

A control message (flush, weight update, weight sync, memory, LoRA, experts) goes to the rank-0
scheduler like a request; rank 0 answers with one reply whose *type* identifies the call
(``FlushCacheReqOutput``, ``ControlReqOutput``, ``LoRAAdapterReqOutput``, ...). Calls run one at
a time, so the reply type is enough to route the answer to its caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from shardline_runtime.managers.admission_gate import ServerNotReadyError

Reply = TypeVar("Reply")


class ControlClient:
    """One control call at a time, answered by reply type.

    Args:
        send: coroutine function that sends a message to the rank-0 scheduler.
    """

    def __init__(self, send: Callable[[Any], Awaitable[None]]):
        self._send = send
        self._lock = asyncio.Lock()
        self._waiters: dict[type, asyncio.Future] = {}

    async def call(
        self,
        request: Any,
        reply_type: type[Reply],
        timeout: float | None = None,
        sent: asyncio.Event | None = None,
    ) -> Reply:
        """Send ``request`` and wait for the next message of ``reply_type``; ``sent`` (if
        given) is set once ``request`` went out (after any call before it).

        Raises:
            ServerNotReadyError: no reply within ``timeout`` seconds (None: wait forever).
        """
        async with self._lock:
            future = asyncio.get_running_loop().create_future()
            self._waiters[reply_type] = future
            await self._send(request)
            if sent is not None:
                sent.set()
            try:
                return await asyncio.wait_for(future, timeout)
            except asyncio.TimeoutError:
                raise ServerNotReadyError(
                    f"the scheduler did not answer {type(request).__name__} within {timeout}s"
                ) from None
            finally:
                self._waiters.pop(reply_type, None)

    def deliver(self, msg: Any) -> bool:
        """Hand ``msg`` to the call waiting for its type; False when none waits."""
        future = self._waiters.get(type(msg))
        if future is None or future.done():
            return False
        future.set_result(msg)
        return True
