"""AdmissionGate alone: hold during an update, pause, drain, close, blocked (no server)."""

from __future__ import annotations

import asyncio

import pytest

from shardline_runtime.managers.admission_gate import (
    AdmissionGate,
    ServerNotReadyError,
    WeightUpdateHoldTimeout,
)
from shardline_runtime.managers.update_hold import HELD_SECONDS
from shardline_runtime.weights_state import WeightsPhase


def run(coro):
    return asyncio.run(coro)


def test_a_request_is_admitted_at_once_while_serving():
    async def main():
        gate = AdmissionGate(hold_timeout=1.0)
        await asyncio.wait_for(gate.admit(), 0.5)
        return gate.held

    assert run(main()) == 0


def test_a_request_during_an_update_is_held_until_serving():
    async def main():
        gate = AdmissionGate(hold_timeout=5.0)
        gate.set_phase(WeightsPhase.LOADING)
        admit = asyncio.ensure_future(gate.admit())
        await asyncio.sleep(0.05)
        held_meanwhile = gate.held
        gate.set_phase(WeightsPhase.RECAPTURING)
        await asyncio.sleep(0.05)
        still_waiting = not admit.done()
        gate.set_phase(WeightsPhase.SERVING)
        await asyncio.wait_for(admit, 1.0)
        return held_meanwhile, still_waiting, gate.held, HELD_SECONDS.get()

    held_meanwhile, still_waiting, held_after, _ = run(main())
    assert held_meanwhile == 1
    assert still_waiting, "recapturing is an update phase too"
    assert held_after == 0


def test_a_failed_update_releases_held_requests():
    async def main():
        gate = AdmissionGate(hold_timeout=5.0)
        gate.set_phase(WeightsPhase.LOADING)
        admit = asyncio.ensure_future(gate.admit())
        await asyncio.sleep(0.02)
        gate.set_phase(WeightsPhase.FAILED)  # the old weights keep serving
        await asyncio.wait_for(admit, 1.0)

    run(main())


def test_a_hold_past_the_timeout_is_a_503_with_retry_after():
    async def main():
        gate = AdmissionGate(hold_timeout=0.1)
        gate.set_phase(WeightsPhase.LOADING)
        await gate.admit()

    with pytest.raises(WeightUpdateHoldTimeout) as caught:
        run(main())
    assert caught.value.retry_after_seconds == 1
    assert "phase loading" in str(caught.value)


def test_a_paused_server_holds_until_continued():
    async def main():
        gate = AdmissionGate()
        gate.set_paused("retract")
        admit = asyncio.ensure_future(gate.admit())
        await asyncio.sleep(0.05)
        waiting, held = not admit.done(), gate.held
        gate.set_paused(None)
        await asyncio.wait_for(admit, 1.0)
        return waiting, held, gate.held

    waiting, held, held_after = run(main())
    assert waiting
    assert held == 1, "a request held by a pause counts in num_held_reqs"
    assert held_after == 0


def test_draining_releases_paused_requests_with_a_503():
    async def main():
        gate = AdmissionGate()
        gate.set_paused("abort")
        admit = asyncio.ensure_future(gate.admit())
        await asyncio.sleep(0.02)
        gate.start_draining()
        await admit

    with pytest.raises(ServerNotReadyError, match="shutting down"):
        run(main())


def test_draining_still_admits_but_closing_refuses():
    async def main():
        gate = AdmissionGate()
        gate.start_draining()
        await gate.admit()
        gate.closing = True
        await gate.admit()

    with pytest.raises(ServerNotReadyError, match="shutting down"):
        run(main())


def test_blocked_generation_is_refused_with_its_reason():
    gate = AdmissionGate()
    gate.blocked = "memory is released"
    with pytest.raises(ServerNotReadyError, match="memory is released"):
        gate.check_ready()


def test_first_output_counts_the_update_against_the_hold_budget():
    async def main():
        gate = AdmissionGate(hold_timeout=0.1)
        queue: asyncio.Queue = asyncio.Queue()
        gate.set_phase(WeightsPhase.LOADING)  # began after the request was sent
        await gate.first_output(queue)

    with pytest.raises(WeightUpdateHoldTimeout):
        run(main())


async def held_until_serving(gate: AdmissionGate) -> int:
    """Admit one request, let the gate report serving, and return how many were held meanwhile."""
    held = asyncio.ensure_future(gate.admit())
    await asyncio.sleep(0.05)
    held_meanwhile = gate.held
    gate.set_phase(WeightsPhase.SERVING)
    await asyncio.wait_for(held, 1.0)
    return held_meanwhile


def test_requests_are_admitted_during_an_updates_admission_window_and_held_after():
    async def main():
        gate = AdmissionGate(hold_timeout=5.0)
        gate.open_window()
        gate.set_phase(WeightsPhase.LOADING)  # the schedulers report staging
        await asyncio.wait_for(gate.admit(), 0.5)  # admitted at once, on the old weights
        gate.close_window()
        return await held_until_serving(gate)

    assert run(main()) == 1


def test_closing_the_window_holds_even_before_the_schedulers_report_loading():
    async def main():
        gate = AdmissionGate(hold_timeout=5.0)
        gate.open_window()
        gate.close_window()
        return await held_until_serving(gate)

    assert run(main()) == 1
