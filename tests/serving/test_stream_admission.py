"""A stream's fate is decided before its headers go out (issue 16, W4 under load).

W4 once failed with "incomplete chunked read": a streamed request passed the handler's
admission just before a weight update began, its ``200`` went out, then ``generate`` held it a
second time and the hold timed out inside the stream. Now a request is admitted once, before the
headers; anything that still fails after them ends the stream with an error event and
``data: [DONE]``.

The app and its TokenizerManager are the real ones, in process; the test plays rank 0's
scheduler on the same ZMQ sockets (as ``test_readiness.py`` does), so the update begins exactly
between admission and sending.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import zmq
import zmq.asyncio

from shardline_runtime.entrypoints.errors import guard_stream
from shardline_runtime.entrypoints.http_server import build_app
from shardline_runtime.managers.admission_gate import ServerNotReadyError
from shardline_runtime.managers.io_struct import SchedulerInfo, TokenizedGenerateReqInput
from shardline_runtime.managers.request_validation import RequestValidationError
from shardline_runtime.managers.tokenizer_manager import TokenizerManager
from shardline_runtime.weights_state import WeightsPhase, WeightsState
from shardline_runtime.sampling.sampling_params import SamplingParams
from shardline_runtime.server_args import ServerArgs


class _Rank0:
    """The test's side of the scheduler sockets: receives what the manager sends, sends phases."""

    def __init__(self, to_scheduler: str, from_scheduler: str):
        ctx = zmq.asyncio.Context.instance()
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.bind(to_scheduler)
        self.outbox = ctx.socket(zmq.PUSH)
        self.outbox.connect(from_scheduler)

    async def received(self, timeout: float):
        return await asyncio.wait_for(self.inbox.recv_pyobj(), timeout)

    def close(self) -> None:
        self.inbox.close(0)
        self.outbox.close(0)


async def _phase(tm: TokenizerManager, rank0: _Rank0, phase: str) -> None:
    await rank0.outbox.send_pyobj(tm.info.weights.model_copy(update={"phase": WeightsPhase(phase)}))
    for _ in range(500):
        if tm.state.weights.phase.value == phase:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"phase {phase!r} never arrived")


def _run(tokenizer, checkpoint, tmp_path, scenario, hold_timeout: float = 0.5):
    info = SchedulerInfo(0, 2048, 2047, 2046, 4096, tokenizer.vocab_size, 64, WeightsState(model_path=str(checkpoint), revision="rev-a"))
    to_scheduler, from_scheduler = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"

    async def main():
        rank0 = _Rank0(to_scheduler, from_scheduler)
        tm = TokenizerManager(tokenizer, info, to_scheduler, from_scheduler, hold_timeout=hold_timeout)
        tm.start()
        try:
            return await scenario(tm, rank0)
        finally:
            tm.close()
            rank0.close()

    return asyncio.run(main())


def test_an_admitted_request_is_sent_even_if_an_update_begins_before_it_is(tokenizer, serving_checkpoint, tmp_path):
    """Admitted, then an update begins: ``generate(admitted=True)`` sends it at once (the
    scheduler runs it after the update); without ``admitted`` it is held, then refused."""
    params = SamplingParams(max_new_tokens=4, temperature=0.0)

    async def scenario(tm: TokenizerManager, rank0: _Rank0):
        await tm.gate.admit()
        await _phase(tm, rank0, "loading")

        def request(rid: str) -> TokenizedGenerateReqInput:
            return TokenizedGenerateReqInput(rid=rid, input_ids=[5, 6, 7], sampling_params=params)

        admitted = tm.generate(request("admitted"), admitted=True)
        first = asyncio.ensure_future(admitted.__anext__())
        sent = await rank0.received(timeout=5)
        first.cancel()
        fresh = tm.generate(request("fresh"))
        with pytest.raises(ServerNotReadyError, match="--weight-update-hold-timeout"):
            await fresh.__anext__()
        later = []  # the cancelled one's abort; the held request never reached the scheduler
        while True:
            try:
                later.append(await rank0.received(timeout=0.3))
            except asyncio.TimeoutError:
                break
        await admitted.aclose()
        assert not [m for m in later if isinstance(m, TokenizedGenerateReqInput)], later
        return sent

    sent = _run(tokenizer, serving_checkpoint, tmp_path, scenario)
    assert isinstance(sent, TokenizedGenerateReqInput) and sent.rid == "admitted"


def test_a_streamed_duplicate_rid_is_400_before_the_headers(tokenizer, serving_checkpoint, tmp_path):
    args = ServerArgs(model_path=str(serving_checkpoint))

    async def scenario(tm: TokenizerManager, rank0: _Rank0):
        app = build_app(tm, args, None, {"healthy": True})
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            body = {"input_ids": [5, 6, 7], "rid": "r1", "sampling_params": {"max_new_tokens": 4}}
            first = asyncio.ensure_future(client.post("/generate", json=body))
            assert (await rank0.received(timeout=5)).rid == "r1"  # r1 is in flight now
            second = await client.post("/generate", json={**body, "stream": True})
            first.cancel()
            return second.status_code, second.json()

    status, body = _run(tokenizer, serving_checkpoint, tmp_path, scenario)
    assert status == 400 and body["error"]["param"] == "rid", body


@pytest.mark.parametrize("exc, code", [
    (RequestValidationError("request id 'x' is already in use", "rid"), 400),
    (ServerNotReadyError("the server is shutting down"), 503),
    (RuntimeError("boom"), 500),
])
def test_a_stream_that_fails_after_its_headers_ends_with_an_error_event_and_done(exc, code):
    async def events():
        yield 'data: {"text": "a"}\n\n'
        raise exc

    async def collect():
        return [line async for line in guard_stream(events())]

    lines = asyncio.run(collect())
    assert lines[0] == 'data: {"text": "a"}\n\n' and lines[-1] == "data: [DONE]\n\n" and len(lines) == 3
    error = json.loads(lines[1].removeprefix("data: "))["error"]
    assert error["code"] == code and str(exc) in error["message"]
    if code == 400:
        assert error["param"] == "rid"
