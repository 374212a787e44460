"""TokenizerManager: the HTTP process's side of a request, composed of four parts.

- :class:`RequestValidator` (``request_validation.py``): tokenize and check against the limits;
- :class:`AdmissionGate` (``admission_gate.py``): hold for a weight update, pause, drain;
- :class:`RequestStreams` (``request_streams.py``): send, receive, per-request queues; its
  ``OutputReceiver`` thread receives each step and detokenizes it (``step_detokenizer.py``);
- :class:`ControlClient` (``control_client.py``): control calls answered by reply type;
- :class:`ServerState` (``server_state.py``): the one ``WeightsState`` copy, stats, adapters.

This class wires them together: it routes each scheduler message to its part and runs one
request (:meth:`generate`) and the weight update, which the admission gate must see at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from shardline_runtime.managers.admission_gate import AdmissionGate, WeightUpdateHoldTimeout
from shardline_runtime.managers.control_client import ControlClient
from shardline_runtime.managers.io_struct import (
    AbortWeightUpdateReqInput,
    SchedulerInfo,
    SchedulerStats,
    ServingStateOut,
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromDiskReqOutput,
    WeightUpdateCutoffReqInput,
)
from shardline_runtime.managers.request_streams import RequestStreams
from shardline_runtime.managers.request_validation import (
    RequestValidationError,
    RequestValidator,
)
from shardline_runtime.managers.server_state import ServerState
from shardline_runtime.managers.step_detokenizer import GenerateChunk
from shardline_runtime.managers.update_hold import ADMITTED_AT
from shardline_runtime.managers.version_pin import VersionNotServedError, VersionPin
from shardline_runtime.weights_state import WeightsPhase, WeightsState

logger = logging.getLogger(__name__)


class TokenizerManager:
    """The parts above, for one HTTP process.

    Args:
        tokenizer: HuggingFace tokenizer of the model.
        info: limits and served weights from the rank-0 scheduler (:class:`SchedulerInfo`).
        scheduler_input_addr: ZMQ address the rank-0 scheduler PULLs requests from.
        output_addr: ZMQ address this process PULLs scheduler outputs on (bound here).
        metrics: a ``ServingMetrics`` (or None).
        hold_timeout: seconds a request waits for a weight update to end (0: refuse at once).
        lora_adapters: adapters every rank loaded at start, ``name -> path``.
    """

    def __init__(
        self,
        tokenizer: Any,
        info: SchedulerInfo,
        scheduler_input_addr: str,
        output_addr: str,
        metrics: Any = None,
        hold_timeout: float = 60.0,
        lora_adapters: dict[str, str] | None = None,
    ):
        self.tokenizer = tokenizer
        self.info = info
        self.metrics = metrics
        self.validator = RequestValidator(tokenizer, info)
        self.state = ServerState(info, lora_adapters)
        self.gate = AdmissionGate(hold_timeout, metrics)
        self.streams = RequestStreams(
            tokenizer,
            scheduler_input_addr,
            output_addr,
            self._on_message,
            lambda: self.state.weights,
            metrics,
        )
        self.control = ControlClient(self.streams.send)
        self.disk_update: asyncio.Future | None = None  # the reply of the disk update in flight
        self._counter = itertools.count()
        if metrics is not None:
            metrics.set_weights(self.state.weights)

    def start(self) -> None:
        """Start receiving (call from inside the running event loop)."""
        self.streams.start()

    def close(self) -> None:
        """Stop receiving; close sockets and threads."""
        self.streams.close()

    @property
    def in_flight(self) -> int:
        """Requests admitted or held and not yet answered."""
        return len(self.streams.states) + self.gate.held

    def _on_message(self, msg: Any) -> None:
        """Route a scheduler message that is not a step's tokens to the part it concerns."""
        if isinstance(msg, WeightsState):
            self.state.set_weights(msg)
            self.gate.set_phase(msg.phase)
            if self.metrics is not None:
                self.metrics.set_weights(msg)
        elif isinstance(msg, SchedulerStats):
            self.state.stats = msg
            if self.metrics is not None:
                self.metrics.observe_stats(msg)
        elif isinstance(msg, ServingStateOut):
            self.gate.blocked = msg.blocked
            self.gate.set_paused(msg.paused)
        elif not self.control.deliver(msg):
            logger.warning("unexpected scheduler message %s", type(msg).__name__)

    # ---------------------------------------------------------------- requests

    def new_rid(self) -> str:
        return f"{uuid.uuid4().hex[:16]}-{next(self._counter)}"

    def check_new_request(self, rid: str | None, lora_name: str | None) -> None:
        """Raises RequestValidationError for an adapter not loaded or a request id in use."""
        if lora_name is not None and lora_name not in self.state.lora_adapters:
            raise RequestValidationError(
                f"lora_path {lora_name!r} is not a loaded LoRA adapter; "
                f"loaded: {sorted(self.state.lora_adapters)}",
                "lora_path",
            )
        if rid is not None and rid in self.streams.states:
            raise RequestValidationError(f"request id {rid!r} is already in use", "rid")

    async def admit(self, pin: VersionPin | None = None) -> None:
        """Admit a new request (:meth:`AdmissionGate.admit`); a pinned one is checked against
        the served weights before (so it is never held for an update) and after admission.

        Raises:
            VersionNotServedError: ``pin`` names weights this server does not serve now.
            ServerNotReadyError: refused by the admission gate.
        """
        if pin is not None:
            pin.check(self._admitted_onto())
        await self.gate.admit()
        if pin is not None:
            pin.check(self._admitted_onto())

    def _admitted_onto(self) -> WeightsState:
        """The weights a request admitted now runs on: in an update's admission window, the
        ones serving (it is served before the commit), not an update whose outcome is open."""
        weights = self.state.weights
        if self.gate.window_open and weights.phase.updating:
            return weights.model_copy(update={"phase": WeightsPhase.SERVING})
        return weights

    async def generate(
        self, req: TokenizedGenerateReqInput, admitted: bool = False, pin: VersionPin | None = None
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Run one request; yields chunks until the one with ``finish`` set.

        Leaving the iterator before the end (client disconnect, cancellation) aborts the
        request in the scheduler, which frees its KV within a step. A request is admitted first
        (:meth:`AdmissionGate.admit`) unless the caller already ``admitted`` it: the HTTP
        handlers admit before a stream's headers go out, as a later hold could only end in a cut
        stream. Until its first output, the time an update holds it in the scheduler counts
        against what the hold timeout left; past it, it is aborted there and this raises
        ``WeightUpdateHoldTimeout`` (a 503 before a response's headers, an error event after).

        With a ``pin``, a chunk from other weights (the request waited in the scheduler's queue
        across an update) aborts the request and raises ``VersionNotServedError``.

        Raises:
            RequestValidationError: see :meth:`check_new_request`.
            ServerNotReadyError: refused by the admission gate.
            VersionNotServedError: see ``pin``.
        """
        if not admitted:
            await self.admit(pin)
        self.check_new_request(req.rid, req.lora_name)
        req.admitted_at = ADMITTED_AT.get() or time.monotonic()
        stream = await self.streams.open(req)
        try:
            try:
                chunk = await self.gate.first_output(stream.queue)
            except WeightUpdateHoldTimeout:
                await self.streams.release(req.rid, "held past --weight-update-hold-timeout")
                raise
            while True:
                refused = (
                    None if pin is None else pin.mismatch(chunk.revision, chunk.weight_version)
                )
                if refused is not None:
                    await self.streams.release(req.rid, refused)
                    raise VersionNotServedError(refused)
                yield chunk
                if chunk.finish is not None:
                    return
                chunk = await stream.queue.get()
        finally:
            if not stream.finished and self.metrics:
                self.metrics.observe_disconnect()
            await self.streams.release(req.rid, "client disconnected")

    async def abort(self, rid: str | None) -> bool:
        """Abort ``rid`` (None: every request). Returns whether such a request was running."""
        found = rid is None or rid in self.streams.states
        await self.streams.send_abort(
            rid, {"type": "abort", "message": "aborted by /abort_request"}
        )
        return found

    # ---------------------------------------------------------------- state-changing calls

    async def update_weights_from_disk(
        self, req: UpdateWeightsFromDiskReqInput, keep_ready: bool = False
    ) -> UpdateWeightsFromDiskReqOutput:
        """Run a weight update; requests arriving from now until it ends are held. The
        schedulers' ``WeightsState`` (new path, revision, digest, phase times) arrives before
        the reply.

        With ``req.admit_seconds`` the schedulers start staging at once, but new requests are
        admitted for that many seconds more (served on the old weights before the commit); then
        the gate closes and a :class:`WeightUpdateCutoffReqInput` tells the schedulers when
        (an update that ended first sends none).

        With ``keep_ready`` ``/ready`` stays 200 until it ends (``AdmissionGate.keep_ready``):
        the caller routed traffic away first. The schedulers never see it."""
        self.gate.keep_ready = keep_ready
        self.state.mark_updating()
        window = max(0.0, req.admit_seconds)
        if window > 0:
            self.gate.open_window()
            req.requested_at = None  # the cutoff message brings it
        else:
            self.gate.set_phase(WeightsPhase.LOADING)
            # Requests admitted before this moment are served before the update pauses; the
            # ones held from now on run on the new weights.
            req.requested_at = time.monotonic()
        ended: asyncio.Future = asyncio.get_running_loop().create_future()
        self.disk_update = ended
        out = None
        try:
            sent = asyncio.Event()
            call = asyncio.ensure_future(
                self.control.call(req, UpdateWeightsFromDiskReqOutput, sent=sent)
            )
            if window > 0:
                # The window counts from the update's sending; the cutoff must follow it.
                went_out = asyncio.ensure_future(sent.wait())
                try:
                    await asyncio.wait({call, went_out}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    went_out.cancel()
                done, _ = await asyncio.wait({call}, timeout=window)
                if not done:
                    self.gate.close_window()
                    await self.streams.send(WeightUpdateCutoffReqInput(time.monotonic()))
            out = await call
            return out
        finally:
            self.disk_update = None
            ended.set_result(out)
            self.state.end_update_if_silent()
            self.gate.window_open = False
            self.gate.keep_ready = False
            self.gate.set_phase(self.state.weights.phase)

    async def abort_weight_update(self) -> UpdateWeightsFromDiskReqOutput | None:
        """Ask the schedulers to abort the disk update in flight and wait for its reply (which
        says ``aborted``, or that it committed or failed first). None when no disk update runs
        (or it ended without a reply)."""
        ended = self.disk_update
        if ended is None:
            return None
        await self.streams.send(AbortWeightUpdateReqInput())
        return await asyncio.shield(ended)
