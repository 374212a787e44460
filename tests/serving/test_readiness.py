"""``/ready`` and ``/health`` of the rank-0 HTTP app follow what the schedulers report.

The app and its TokenizerManager are the real ones, in process; the test plays rank 0's
scheduler on the same ZMQ socket, sending the same ``WeightsState`` messages, so each phase
lasts exactly as long as the test needs (a real weight load of a tiny checkpoint is over in
milliseconds). That the scheduler sends ``loading`` before it loads is tested in
``test_scheduler.py``; startup (503 until every rank loaded) and SIGTERM in
``test_multinode.py``.
"""

from __future__ import annotations

import asyncio

import httpx
import zmq
import zmq.asyncio

from shardline_runtime.entrypoints.http_server import build_app
from shardline_runtime.managers.io_struct import SchedulerInfo
from shardline_runtime.managers.tokenizer_manager import TokenizerManager
from shardline_runtime.weights_state import WeightsPhase, WeightsState
from shardline_runtime.server_args import ServerArgs


async def _wait_phase(tm: TokenizerManager, phase: str) -> None:
    for _ in range(500):
        if tm.state.weights.phase.value == phase:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"phase {phase!r} never arrived (is {tm.state.weights.phase!r})")


def test_ready_is_503_while_loading_recapturing_or_draining(tokenizer, serving_checkpoint, tmp_path):
    info = SchedulerInfo(0, 2048, 2047, 2046, 4096, tokenizer.vocab_size, 64, WeightsState(model_path=str(serving_checkpoint), revision="rev-a"))
    args = ServerArgs(model_path=str(serving_checkpoint))
    to_scheduler, from_scheduler = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"

    async def scenario() -> list[tuple[str, int, int]]:
        tm = TokenizerManager(tokenizer, info, to_scheduler, from_scheduler)
        tm.start()
        app = build_app(tm, args, None, {"healthy": True})
        rank0 = zmq.asyncio.Context.instance().socket(zmq.PUSH)
        rank0.connect(from_scheduler)
        seen = []
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
                async def look(what: str) -> None:
                    seen.append((what, (await client.get("/ready")).status_code,
                                 (await client.get("/health")).status_code))

                await look("serving")
                for phase in ("loading", "recapturing", "serving", "loading", "failed"):
                    await rank0.send_pyobj(info.weights.model_copy(update={"phase": WeightsPhase(phase)}))
                    await _wait_phase(tm, phase)
                    await look(phase)
                tm.gate.draining = True  # what the launcher's SIGTERM handler sets
                await look("draining")
        finally:
            rank0.close(0)
            tm.close()
        return seen

    seen = asyncio.run(scenario())
    assert seen == [
        ("serving", 200, 200), ("loading", 503, 200), ("recapturing", 503, 200), ("serving", 200, 200),
        ("loading", 503, 200), ("failed", 200, 200),  # a failed update keeps the old weights serving
        ("draining", 503, 200),
    ], seen

