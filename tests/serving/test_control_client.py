"""ControlClient alone: a call is answered by the next message of its reply type."""

from __future__ import annotations

import asyncio

import pytest

from shardline_runtime.managers.admission_gate import ServerNotReadyError
from shardline_runtime.managers.control_client import ControlClient
from shardline_runtime.managers.io_struct import (
    ControlReqOutput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
)


class _Scheduler:
    """Records what the client sends; the test answers."""

    def __init__(self) -> None:
        self.sent: list = []

    async def send(self, msg) -> None:
        self.sent.append(msg)


def test_a_call_returns_the_reply_of_its_type():
    async def main():
        scheduler = _Scheduler()
        client = ControlClient(scheduler.send)
        call = asyncio.ensure_future(client.call(FlushCacheReqInput(), FlushCacheReqOutput, 1.0))
        await asyncio.sleep(0.01)
        other = client.deliver(ControlReqOutput(True, "not for this call"))
        mine = client.deliver(FlushCacheReqOutput(True, "flushed"))
        return scheduler.sent, other, mine, await call

    sent, other, mine, reply = asyncio.run(main())
    assert isinstance(sent[0], FlushCacheReqInput)
    assert other is False
    assert mine is True
    assert reply.message == "flushed"


def test_a_reply_nobody_waits_for_is_not_delivered():
    client = ControlClient(_Scheduler().send)
    assert client.deliver(FlushCacheReqOutput(True)) is False


def test_no_reply_within_the_timeout_is_a_503():
    async def main():
        client = ControlClient(_Scheduler().send)
        await client.call(FlushCacheReqInput(), FlushCacheReqOutput, 0.05)

    with pytest.raises(ServerNotReadyError, match="FlushCacheReqInput within 0.05s"):
        asyncio.run(main())


def test_calls_run_one_at_a_time():
    async def main():
        scheduler = _Scheduler()
        client = ControlClient(scheduler.send)
        first = asyncio.ensure_future(client.call(FlushCacheReqInput(), FlushCacheReqOutput, 1.0))
        second = asyncio.ensure_future(client.call(FlushCacheReqInput(), FlushCacheReqOutput, 1.0))
        await asyncio.sleep(0.02)
        sent_before_reply = len(scheduler.sent)
        client.deliver(FlushCacheReqOutput(True, "one"))
        await asyncio.sleep(0.02)
        client.deliver(FlushCacheReqOutput(True, "two"))
        return sent_before_reply, (await first).message, (await second).message

    sent_before_reply, first, second = asyncio.run(main())
    assert sent_before_reply == 1
    assert first == "one"
    assert second == "two"
