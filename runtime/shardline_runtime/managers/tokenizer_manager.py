"""TokenizerManager: the HTTP process's side of a request (tokenize, send, detokenize, collect).

It lives in the HTTP (node rank 0) process, next to FastAPI. It tokenizes and validates a
request against the limits the schedulers reported, sends a ``TokenizedGenerateReqInput`` over
ZMQ to the rank-0 scheduler, and a background task receives ``BatchTokenIDOut`` messages,
detokenizes them incrementally per request (:class:`IncrementalDetokenizer`) and hands
:class:`GenerateChunk` objects to the waiting handler. A stop string matched here finishes the
request at once and tells the scheduler to free it (``AbortReq`` with a ``stop`` reason).
Leaving the :meth:`generate` iterator early (client disconnect) aborts the request.

During a weight update new requests are *held*, as SGLang's ``TokenizerManager`` does: from the
moment ``/update_weights_from_disk`` arrives until the schedulers report ``serving`` (or
``failed``: the old weights keep serving) nothing new is sent to them, so held requests run on
the new weights. A request held longer than ``--weight-update-hold-timeout`` gets a 503 with
``Retry-After`` (:class:`WeightUpdateHoldTimeout`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from shardline_runtime.managers.detokenizer import IncrementalDetokenizer
from shardline_runtime.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    ControlReqOutput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    SchedulerInfo,
    SchedulerStats,
    ServingStateOut,
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromDiskReqOutput,
)
from shardline_runtime.managers.update_hold import HELD_SECONDS, first_chunk
from shardline_runtime.managers.weights_state import WeightsState
from shardline_runtime.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shardline_runtime.managers.lora_control import LoRAAdapterReqOutput

logger = logging.getLogger(__name__)


class RequestValidationError(ValueError):
    """A request the client can fix (HTTP 400); ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ServerNotReadyError(RuntimeError):
    """The server cannot take the request now (HTTP 503): loading, updating weights, draining.

    ``retry_after_seconds`` (or None) becomes the ``Retry-After`` header.
    """

    retry_after_seconds: int | None = None


class WeightUpdateHoldTimeout(ServerNotReadyError):
    """A request waited ``--weight-update-hold-timeout`` seconds for a weight update to end."""

    def __init__(self, message: str, retry_after_seconds: int):
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


UPDATING_PHASES = ("loading", "recapturing")


@dataclass
class GenerateChunk:
    """What one request produced since the last chunk.

    ``text`` is the safe text delta; ``token_ids`` the tokens it came from (for a stop-string
    finish, only those consumed up to the match); ``logprobs`` pairs with ``token_ids``:
    ``(logprob, token_id, top)`` where ``top`` is a list of ``(logprob, token_id)``;
    ``text_offsets`` pairs with ``token_ids`` too: where each token's text starts in the
    request's whole output text (characters).
    ``finish_reason`` is None until the last chunk, then a dict with ``type`` in
    ``stop | length | abort`` (and ``matched`` / ``message``).
    """

    text: str
    token_ids: list[int]
    logprobs: list[tuple[float, int, list[tuple[float, int]]]]
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_logprobs: list[tuple[float | None, int, list[tuple[float, int]]]] | None = None
    weight_version: str | None = None
    text_offsets: list[int] = field(default_factory=list)


@dataclass
class _ReqState:
    detok: IncrementalDetokenizer
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    created: float = field(default_factory=time.monotonic)
    last_token_time: float | None = None


class TokenizerManager:
    """Owns the tokenizer, the ZMQ sockets to the rank-0 scheduler and in-flight request state.

    Args:
        tokenizer: HuggingFace tokenizer of the model.
        info: limits from the rank-0 scheduler (:class:`SchedulerInfo`).
        scheduler_input_addr: ZMQ address the rank-0 scheduler PULLs requests from.
        output_addr: ZMQ address this process PULLs scheduler outputs on (bound here).
        metrics: a ``ServingMetrics`` (or None).
        hold_timeout: seconds a request waits for a weight update to end (0: refuse at once).
    """

    def __init__(
        self,
        tokenizer: Any,
        info: SchedulerInfo,
        scheduler_input_addr: str,
        output_addr: str,
        metrics=None,
        hold_timeout: float = 60.0,
    ):
        self.tokenizer = tokenizer
        self.info = info
        self.metrics = metrics
        self.context = zmq.asyncio.Context()
        self.send_socket = self.context.socket(zmq.PUSH)
        self.send_socket.connect(scheduler_input_addr)
        self.recv_socket = self.context.socket(zmq.PULL)
        self.recv_socket.bind(output_addr)
        self.states: dict[str, _ReqState] = {}
        self._max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) + 1
        self.stats = SchedulerStats(0, 0, 0, 0, info.max_total_num_tokens)
        self.weights_phase = "serving"
        self.weights_revision = info.weights.revision
        self.model_path = info.weights.model_path
        self.weights_digest = info.weights.digest
        self.last_weight_update: dict[str, Any] | None = (
            None  # phase times of the last disk update run
        )
        self.hold_timeout = hold_timeout
        self._serving = asyncio.Event()  # set unless a weight update is running
        self._serving.set()
        self._updating = (
            asyncio.Event()
        )  # the inverse of _serving (update_hold.first_chunk waits on both)
        self.draining = False  # SIGTERM received: /ready is 503, requests are still served
        self.closing = False  # the drain ended: new requests are refused
        self.held = 0  # requests waiting for a weight update to end
        self.weight_version = info.weights.weight_version
        self.blocked: str | None = None  # memory released / weights missing (from the scheduler)
        self.paused: str | None = None  # pause_generation mode; new requests wait here meanwhile
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._control_lock = asyncio.Lock()
        self._control_waiters: dict[type, asyncio.Future] = {}
        self._recv_task: asyncio.Task | None = None
        self._counter = itertools.count()
        self.lora_adapters: dict[
            str, str
        ] = {}  # loaded LoRA adapters, name -> path (set by the launcher)

    def start(self) -> None:
        """Start the receive loop (call from inside the running event loop)."""
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    # ---------------------------------------------------------------- validation

    def encode_text(self, text: str, add_special_tokens: bool) -> tuple[list[int], int]:
        """Token ids of ``text`` and how many of them the tokenizer added in front of it.

        ``add_special_tokens=True`` applies the tokenizer's own post-processor (a Llama-style
        tokenizer prepends BOS), as vLLM and SGLang do for text prompts; a text that already
        starts with the BOS token gets no second one (vLLM drops the duplicate the same way).
        """
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not add_special_tokens:
            return ids, 0
        full = self.tokenizer.encode(text, add_special_tokens=True)
        added = next(
            (k for k in range(len(full) - len(ids) + 1) if full[k : k + len(ids)] == ids), 0
        )
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if added and bos is not None and ids and ids[0] == bos and full[added - 1] == bos:
            full = full[: added - 1] + full[added:]
            added -= 1
        return full, added

    def tokenize(
        self, prompt: str | list[int], param: str = "prompt", add_special_tokens: bool = False
    ) -> list[int]:
        """Token ids of ``prompt`` (a string, or ids checked against the vocabulary).

        ``add_special_tokens`` applies to a string only (see :meth:`encode_text`); token ids are
        sent as given.

        Raises:
            RequestValidationError: empty prompt, or an id outside ``[0, vocab_size)``.
        """
        if isinstance(prompt, str):
            self.check_text_length(prompt, param)
            ids, _ = self.encode_text(prompt, add_special_tokens)
        else:
            ids = list(prompt)
            bad = [
                t
                for t in ids
                if not isinstance(t, int)
                or isinstance(t, bool)
                or not 0 <= t < self.info.vocab_size
            ]
            if bad:
                raise RequestValidationError(
                    f"{param} token ids must be integers in [0, {self.info.vocab_size}), got {bad[0]!r}",
                    param,
                )
        if not ids:
            raise RequestValidationError(f"{param} must contain at least one token", param)
        return ids

    def check_text_length(self, text: str, param: str) -> None:
        """Reject an empty text, and one surely over the prompt limit without tokenizing it.

        Raises:
            RequestValidationError: ``text`` is empty or too long.
        """
        if text == "":
            raise RequestValidationError(f"{param} must not be empty", param)
        # A token covers at most ``_max_token_chars`` characters, so a longer text is surely
        # over the limit: reject it without tokenizing (which would block the event loop).
        if len(text) > self._max_token_chars * self.info.max_req_input_len:
            raise RequestValidationError(
                f"{param} has {len(text)} characters: more than the {self.info.max_req_input_len} tokens "
                "this server accepts",
                param,
            )

    def check_lengths(self, input_ids: list[int], max_new_tokens: int | None) -> int:
        """Validate prompt length and ``max_tokens`` against the context; return max_new_tokens.

        ``None`` means "as many as fit in the context". The KV pool (not the context) may clip
        a request further; it then ends with ``finish_reason: "length"``.

        Raises:
            RequestValidationError: the prompt or prompt + ``max_tokens`` exceed the limits.
        """
        n = len(input_ids)
        limit = self.info.max_req_input_len
        if n > limit:
            raise RequestValidationError(
                f"the prompt has {n} tokens but this server accepts at most {limit} prompt tokens "
                f"(context length {self.info.context_len}, KV pool {self.info.max_total_num_tokens} tokens)",
                "prompt",
            )
        # As SGLang: prompt + output must stay below the context length (max_req_len).
        limit_total = self.info.context_len - 1
        room = limit_total - n
        if max_new_tokens is None:
            return room
        if n + max_new_tokens > limit_total:
            raise RequestValidationError(
                f"the prompt has {n} tokens and max_tokens is {max_new_tokens}: {n + max_new_tokens} "
                f"exceeds {limit_total} (context length {self.info.context_len} - 1); ask for at most {room} tokens",
                "max_tokens",
            )
        return max_new_tokens

    def check_ready(self) -> None:
        """Raises ServerNotReadyError once the server takes no new requests (its drain ended).

        While draining (``/ready`` is 503 so balancers move away) requests are still served, and a
        weight update does not refuse either: :meth:`admit` holds the request instead.
        """
        if self.closing:
            raise ServerNotReadyError("the server is shutting down")
        if self.blocked:
            raise ServerNotReadyError(self.blocked)

    @property
    def in_flight(self) -> int:
        """Requests admitted or held and not yet answered."""
        return len(self.states) + self.held

    def set_weights_phase(self, phase: str) -> None:
        """Record the schedulers' weights phase; requests are held while it is an update phase."""
        self.weights_phase = phase
        if phase in UPDATING_PHASES:
            self._serving.clear()
            self._updating.set()
        else:
            self._serving.set()
            self._updating.clear()

    async def admit(self) -> None:
        """Return once the request may be sent to the schedulers: at once when serving; after
        the running weight update when one runs (the request is held, counted in the
        ``weight_update_held_requests`` metric and its wait in ``weight_update_hold_seconds``).

        Then, while generation is paused, hold until ``/continue_generation``. The HTTP handlers
        call it before they answer, so a request refused after its hold is a 503, never a cut stream.

        The time held here is kept in ``update_hold.HELD_SECONDS`` for :meth:`generate`, which
        bounds the request's whole hold (here, then in the scheduler) by ``hold_timeout``.

        Raises:
            ServerNotReadyError: the server is shutting down, or memory is released.
            WeightUpdateHoldTimeout: the update outlasted ``hold_timeout`` seconds.
        """
        self.check_ready()
        HELD_SECONDS.set(0.0)
        if self._serving.is_set():
            await self._hold_while_paused()
            return
        started = time.monotonic()
        self.held += 1
        try:
            await asyncio.wait_for(self._serving.wait(), self.hold_timeout)
        except asyncio.TimeoutError:
            raise self.hold_timeout_error() from None
        finally:
            self.held -= 1
            HELD_SECONDS.set(time.monotonic() - started)
            if self.metrics:
                self.metrics.observe_hold(time.monotonic() - started)
        self.check_ready()
        await self._hold_while_paused()

    def hold_timeout_error(self) -> WeightUpdateHoldTimeout:
        """The 503 (with ``Retry-After``) for a request held past ``hold_timeout``."""
        return WeightUpdateHoldTimeout(
            f"the server is updating its weights (phase {self.weights_phase}) and the request waited "
            f"{self.hold_timeout:g}s (--weight-update-hold-timeout); retry shortly",
            retry_after_seconds=max(1, min(30, round(self.hold_timeout / 4))),
        )

    async def _hold_while_paused(self) -> None:
        """Hold while generation is paused (SGLang: held, not refused, until
        ``/continue_generation``); a shutdown releases the held requests with a 503."""
        if self.paused is None:
            return
        self.held += 1  # counted in /get_server_info's num_held_reqs, as a weight update's holds
        try:
            await self._unpaused.wait()
        finally:
            self.held -= 1
        if self.paused is not None and self.draining:
            raise ServerNotReadyError("the server is shutting down")
        self.check_ready()

    # ---------------------------------------------------------------- requests

    def new_rid(self) -> str:
        return f"{uuid.uuid4().hex[:16]}-{next(self._counter)}"

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        include_stop_str_in_output: bool = False,
        lora_name: str | None = None,
        input_embeds_positions: list[int] | None = None,
        input_embeds_values: list[list[float]] | None = None,
        admitted: bool = False,
    ) -> AsyncIterator[GenerateChunk]:
        """Run one request; yields chunks until the one with ``finish_reason`` set.

        Leaving the iterator before the end (client disconnect, cancellation) aborts the
        request in the scheduler, which frees its KV within a step. A request that arrives during
        a weight update is held first (:meth:`admit`), unless the caller already ``admitted`` it:
        the HTTP handlers admit before a stream's headers go out, and a second hold after them
        could only end in a cut stream (a request admitted just before an update began is sent
        now, and the scheduler runs it whole on the new weights once the update is done).

        Until its first output, the time an update holds it in the scheduler counts against what
        ``hold_timeout`` left after :meth:`admit` (``update_hold.first_chunk``); past it, it is
        aborted there and this raises ``WeightUpdateHoldTimeout`` (a 503 before a response's
        headers, an error event and ``[DONE]`` after a stream's).
        """
        if not admitted:
            await self.admit()
        if lora_name is not None and lora_name not in self.lora_adapters:
            raise RequestValidationError(
                f"LoRA adapter {lora_name!r} is not loaded; loaded: {sorted(self.lora_adapters)}",
                "lora_path",
            )
        rid = rid or self.new_rid()
        if rid in self.states:
            raise RequestValidationError(f"request id {rid!r} is already in use", "rid")
        detok = IncrementalDetokenizer(
            self.tokenizer,
            input_ids,
            params.stop,
            params.skip_special_tokens,
            include_stop_str_in_output,
        )
        state = _ReqState(detok)
        self.states[rid] = state
        msg = TokenizedGenerateReqInput(
            rid,
            input_ids,
            params,
            return_logprob,
            top_logprobs_num,
            logprob_start_len,
            lora_name=lora_name,
            input_embeds_positions=input_embeds_positions,
            input_embeds_values=input_embeds_values,
        )
        await self.send_socket.send_pyobj(msg)
        try:
            try:
                chunk = await first_chunk(
                    state.queue,
                    self._updating,
                    self._serving,
                    self.hold_timeout - HELD_SECONDS.get(),
                )
            except asyncio.TimeoutError:
                state.finished = True
                await self._send_abort(
                    rid, {"type": "abort", "message": "held past --weight-update-hold-timeout"}
                )
                raise self.hold_timeout_error() from None
            while True:
                yield chunk
                if chunk.finish_reason is not None:
                    return
                chunk = await state.queue.get()
        finally:
            if not state.finished:
                state.finished = True
                if self.metrics:
                    self.metrics.observe_disconnect()
                await self._send_abort(rid, {"type": "abort", "message": "client disconnected"})
            self.states.pop(rid, None)

    async def _send_abort(self, rid: str | None, reason: dict) -> None:
        try:
            await self.send_socket.send_pyobj(AbortReq(rid, reason))
        except zmq.ZMQError as exc:
            logger.warning("could not send abort for %s: %s", rid, exc)

    async def abort(self, rid: str | None) -> bool:
        """Abort ``rid`` (None: every request). Returns whether such a request was running."""
        found = rid is None or rid in self.states
        await self._send_abort(rid, {"type": "abort", "message": "aborted by /abort_request"})
        return found

    async def abort_all_local(self, message: str) -> None:
        """Finish every in-flight request here with an abort (the scheduler is gone)."""
        for state in list(self.states.values()):
            if not state.finished:
                state.finished = True
                state.queue.put_nowait(
                    GenerateChunk("", [], [], {"type": "abort", "message": message}, 0, 0, 0)
                )

    # ---------------------------------------------------------------- control

    async def control(self, request: Any, reply_type: type, timeout: float | None = None) -> Any:
        """Send a control message to the schedulers and wait for its reply (one at a time).

        Raises:
            ServerNotReadyError: no reply within ``timeout`` seconds.
        """
        async with self._control_lock:
            fut = asyncio.get_running_loop().create_future()
            self._control_waiters[reply_type] = fut
            await self.send_socket.send_pyobj(request)
            try:
                return await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                raise ServerNotReadyError(
                    f"the scheduler did not answer {type(request).__name__} within {timeout}s"
                ) from None
            finally:
                self._control_waiters.pop(reply_type, None)

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self.control(FlushCacheReqInput(), FlushCacheReqOutput, timeout=60)

    async def control_request(self, req: Any, timeout: float | None = None) -> ControlReqOutput:
        """A weight-sync or memory control (every rank runs it); see ``control_plane.py``."""
        return await self.control(req, ControlReqOutput, timeout)

    def start_draining(self) -> None:
        """Shutting down: ``/ready`` turns 503 (requests are still served while the listener is
        open), and those held by ``/pause_generation`` are released with a 503 instead of being
        left to the listener's close."""
        self.draining = True
        self._unpaused.set()

    def set_paused(self, mode: str | None) -> None:
        self.paused = mode
        if mode is None or self.draining:
            self._unpaused.set()
        else:
            self._unpaused.clear()

    async def update_weights_from_disk(
        self, req: UpdateWeightsFromDiskReqInput
    ) -> UpdateWeightsFromDiskReqOutput:
        """Run a weight update; requests arriving from now until it ends are held (:meth:`admit`).

        What serves afterwards (revision, digest, phase times) arrives as a ``WeightsState``
        just before the reply.
        """
        self.set_weights_phase("loading")
        try:
            out = await self.control(req, UpdateWeightsFromDiskReqOutput)
        finally:
            if self.weights_phase in UPDATING_PHASES:  # the schedulers' last phase message was lost
                self.set_weights_phase("serving")
        return out

    def lora_for_model(self, model: str | None) -> str | None:
        """The LoRA adapter an OpenAI ``model`` names (None: the base model)."""
        return model if model is not None and model in self.lora_adapters else None

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> LoRAAdapterReqOutput:
        """Load on every rank; the adapter serves as soon as this returns successfully."""
        from shardline_runtime.managers.lora_control import (
            LoadLoRAAdapterReqInput,
            LoRAAdapterReqOutput,
        )

        out = await self.control(
            LoadLoRAAdapterReqInput(lora_name, lora_path), LoRAAdapterReqOutput, timeout=600
        )
        self.lora_adapters = dict(out.loaded)  # an eviction may have removed another adapter
        return out

    async def unload_lora_adapter(self, lora_name: str) -> LoRAAdapterReqOutput:
        """Stop admitting requests for ``lora_name`` now; unload once its requests finished."""
        from shardline_runtime.managers.lora_control import (
            LoRAAdapterReqOutput,
            UnloadLoRAAdapterReqInput,
        )

        path = self.lora_adapters.pop(lora_name, None)
        out = await self.control(
            UnloadLoRAAdapterReqInput(lora_name), LoRAAdapterReqOutput, timeout=600
        )
        if not out.success and path is not None and lora_name in out.loaded:
            self.lora_adapters[lora_name] = path
        return out

    # ---------------------------------------------------------------- receive loop

    async def _recv_loop(self) -> None:
        while True:
            msg = await self.recv_socket.recv_pyobj()
            try:
                self._handle(msg)
            except Exception:  # a bug in one message must not stop every request
                logger.exception("failed to handle scheduler output %s", type(msg).__name__)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, BatchTokenIDOut):
            self._handle_batch(msg)
        elif isinstance(msg, SchedulerStats):
            self.stats = msg
            if self.metrics:
                self.metrics.observe_stats(msg)
        elif isinstance(msg, WeightsState):
            self.set_weights_phase(msg.phase.value)
            self.weights_revision, self.model_path = msg.revision, msg.model_path
            self.weight_version, self.weights_digest = msg.weight_version, msg.digest
            last = msg.last_update
            self.last_weight_update = None if last is None else last.model_dump()
        elif isinstance(msg, ServingStateOut):
            self.blocked = msg.blocked
            self.set_paused(msg.paused)
        else:
            fut = self._control_waiters.get(type(msg))
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _handle_batch(self, out: BatchTokenIDOut) -> None:
        now = time.monotonic()
        for i, rid in enumerate(out.rids):
            state = self.states.get(rid)
            if state is None or state.finished:
                continue
            reason = out.finished_reasons[i]
            new_ids = out.output_ids[i]
            detok = state.detok
            before = detok.num_tokens
            exclude_last = bool(
                reason and reason.get("type") == "stop" and isinstance(reason.get("matched"), int)
            )
            text = detok.add_tokens(new_ids, exclude_last=exclude_last)
            consumed = detok.num_tokens - before
            if detok.stopped and reason is None:
                reason = {"type": "stop", "matched": detok.matched_stop}
                asyncio.get_running_loop().create_task(self._send_abort(rid, reason))
            elif detok.stopped:
                reason = {"type": "stop", "matched": detok.matched_stop}
            if reason is not None:
                text += detok.finish()
                state.finished = True
            logprobs = []
            output_lps, input_lps = out.output_token_logprobs[i], out.input_token_logprobs[i]
            if output_lps is not None:
                tops = out.output_top_logprobs[i] or [[] for _ in new_ids]
                logprobs = [(lp, tid, top) for (lp, tid), top in zip(output_lps, tops)][:consumed]
            prompt_logprobs = None
            if input_lps is not None:
                tops = out.input_top_logprobs[i] or [[] for _ in input_lps]
                prompt_logprobs = [(lp, tid, top) for (lp, tid), top in zip(input_lps, tops)]
            chunk = GenerateChunk(
                text,
                list(new_ids[:consumed]),
                logprobs,
                reason,
                out.prompt_tokens[i],
                detok.num_tokens,
                out.cached_tokens[i],
                prompt_logprobs,
                self.weight_version,
                detok.token_offsets[before : before + consumed],
            )
            if self.metrics and consumed:
                self.metrics.observe_tokens(state, now, consumed)
            if self.metrics and reason is not None:
                self.metrics.observe_finish(state, now, chunk)
            state.queue.put_nowait(chunk)
