"""The SIGTERM drain (``shardline_runtime/drain.py``): unready at once, serving and accepting while
requests run or clients still arrive, then the listener closes (issue 23: a deleted leader must
answer every request that reached it).

The steps are a table over :func:`drain_step`; the counting is :class:`RequestTracker` around a
real ASGI app; the whole drain runs in a real server process in the ``slow`` test.
"""

from __future__ import annotations

import asyncio
import math
import signal
import time

import httpx
import pytest
from serving_server import start_server

from shardline_runtime.drain import QUIET_SECONDS, DrainStep, RequestTracker, drain_step

DEADLINE = 100.0


@pytest.mark.parametrize(
    ("now", "quiet_since", "in_flight", "step"),
    [
        (10.0, 9.5, 0, DrainStep.ACCEPT),  # a client still arrives: keep accepting
        (10.0, 10.0 - QUIET_SECONDS / 2, 0, DrainStep.ACCEPT),  # quiet, not for long yet
        (10.0, 10.0 - QUIET_SECONDS, 2, DrainStep.ACCEPT),  # quiet, requests still run
        (10.0, 10.0 - QUIET_SECONDS, 0, DrainStep.DONE),  # quiet and nothing runs: exit
        (DEADLINE, DEADLINE, 4, DrainStep.TIMEOUT),
        (DEADLINE + 1, 0.0, 0, DrainStep.TIMEOUT),
    ],
)
def test_drain_step(now, quiet_since, in_flight, step):
    assert drain_step(now, quiet_since, in_flight, DEADLINE) == step


def _tracked_call(path: str) -> tuple[RequestTracker, list[int]]:
    """Call a tracker-wrapped app on ``path``; the in-progress counts the app saw inside."""
    seen: list[int] = []

    async def app(scope, receive, send):
        seen.append(tracker.in_progress)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    tracker = RequestTracker(app, clock=lambda: 42.0)

    async def call():
        transport = httpx.ASGITransport(app=tracker)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            await client.post(path, json={})

    asyncio.run(call())
    return tracker, seen


def test_a_serving_request_counts_while_it_runs():
    _, seen = _tracked_call("/v1/completions")
    assert seen == [1]


def test_a_serving_request_stops_counting_once_answered():
    tracker, _ = _tracked_call("/v1/completions")
    assert tracker.in_progress == 0


def test_a_serving_request_records_its_arrival():
    tracker, _ = _tracked_call("/v1/completions")
    assert tracker.last_arrival == 42.0


@pytest.mark.parametrize("path", ["/ready", "/health", "/get_server_info", "/metrics"])
def test_probes_and_info_reads_never_hold_the_drain_open(path):
    tracker, seen = _tracked_call(path)
    assert (seen, tracker.last_arrival) == ([0], -math.inf)


def test_an_admin_call_counts_in_flight_without_counting_as_client_traffic():
    tracker, seen = _tracked_call("/flush_cache")
    assert (seen, tracker.last_arrival) == ([1], -math.inf)


def _complete(url: str) -> int | str:
    try:
        return httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


@pytest.mark.slow
def test_sigterm_serves_clients_that_still_arrive_then_closes_and_exits_zero(serving_checkpoint, checkpoint_dir):
    """A client that has not noticed the SIGTERM keeps sending for 3 s (longer than the quiet
    window): every request is served, /ready says 503 throughout, and once the client stops the
    listener closes and the process exits 0 within the quiet window plus a margin."""
    server = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", "1024", "--drain-timeout", "60")
    try:
        assert _complete(server.url) == 200
        server.proc.send_signal(signal.SIGTERM)
        answers, ready = [], set()
        until = time.monotonic() + 1.5 * QUIET_SECONDS
        while time.monotonic() < until:
            answers.append(_complete(server.url))
            ready.add(httpx.get(server.url + "/ready", timeout=30).status_code)
            time.sleep(0.3)
        stopped = time.monotonic()
        code = server.proc.wait(60)
        exited_after = time.monotonic() - stopped
        refused = _complete(server.url)
    finally:
        server.stop()
    assert set(answers) == {200}, answers
    assert ready == {503}
    assert code == 0
    assert exited_after < QUIET_SECONDS + 10
    assert refused == "ConnectError"
