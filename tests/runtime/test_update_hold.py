"""update_hold.first_chunk: the hold bound counts only time under an update, summed over back-to-back
updates (issue 9: the bound once covered only the wait in the HTTP process)."""

from __future__ import annotations

import asyncio

import pytest

from shardline_runtime.managers.update_hold import HELD_SECONDS, first_chunk


class Updates:
    """The two events ``AdmissionGate.set_phase`` keeps."""

    def __init__(self) -> None:
        self.updating, self.serving = asyncio.Event(), asyncio.Event()
        self.serving.set()

    def begin(self) -> None:
        self.serving.clear(), self.updating.set()

    def end(self) -> None:
        self.updating.clear(), self.serving.set()


def run(coro):
    return asyncio.run(coro)


def test_output_without_an_update_is_returned_however_long_it_queues():
    async def main():
        u, queue = Updates(), asyncio.Queue()
        asyncio.get_running_loop().call_later(0.3, queue.put_nowait, "chunk")
        return await first_chunk(queue, u.updating, u.serving, budget=0.05)  # load is not a hold

    assert run(main()) == "chunk"


def test_back_to_back_updates_are_bounded_together():
    """Two updates of 0.2 s each hold the request 0.4 s: past a 0.3 s budget, though each alone is not."""

    async def main():
        u, queue = Updates(), asyncio.Queue()
        loop = asyncio.get_running_loop()
        u.begin()
        loop.call_later(0.2, u.end)
        loop.call_later(0.25, u.begin)
        loop.call_later(0.45, u.end)
        loop.call_later(0.5, queue.put_nowait, "late")
        await first_chunk(queue, u.updating, u.serving, budget=0.3)

    with pytest.raises(asyncio.TimeoutError):
        run(main())


def test_an_update_within_the_budget_lets_the_output_through():
    async def main():
        u, queue = Updates(), asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, u.begin)  # begins while the request is queued
        loop.call_later(0.15, u.end)
        loop.call_later(0.2, queue.put_nowait, "chunk")
        return await first_chunk(queue, u.updating, u.serving, budget=1.0)

    assert run(main()) == "chunk"


def test_no_budget_left_fails_as_soon_as_an_update_holds_it():
    async def main():
        u, queue = Updates(), asyncio.Queue()
        u.begin()
        await first_chunk(queue, u.updating, u.serving, budget=0.0)

    with pytest.raises(asyncio.TimeoutError):
        run(main())
    assert HELD_SECONDS.get() == 0.0  # outside a request: nothing held
