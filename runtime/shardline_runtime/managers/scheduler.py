"""Scheduler: one per TP rank; continuous batching over a TpModelWorker (SGLang's Scheduler).

The loop, every rank in lockstep::

    while True:
        messages = recv_requests()          # rank 0 reads ZMQ, broadcast_pyobj to every rank
        process_input_requests(messages)    # new requests, aborts, flush, weight updates
        batch = get_next_batch_to_run()     # EXTEND of admitted requests, else DECODE of running
        if batch: process_batch_result(batch, run_batch(batch))  # the worker gets a ModelWorkerBatch

With overlap scheduling (the default) step N+1 is launched before step N's result is processed
(``run_step``; ``managers/overlap.py``).

Every rank receives the same messages and takes the same decisions from the same state, so
their batches (and collectives) always match. Rank 0 alone sends outputs to the HTTP process.
With pipeline parallelism every stage runs a scheduler and the loop is ``event_loop_pp``
(``scheduler_pp.py``): micro-batches in flight through the stages.
Batching policy is small objects the scheduler wires together: ``CacheManager`` (KV slots,
prefix cache, request rows), ``PrefillManager`` (waiting queue, chunked prefill; its
``PrefillAdder`` budgets one EXTEND batch), ``DecodeManager`` (running batch, retraction), over
one ``NewTokenRatio`` (``schedule_policy.py``). Result handling and outputs are in
``scheduler_output.py``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any

import torch
import zmq

from shardline_runtime.distributed import broadcast_pyobj
from shardline_runtime.managers.cache_manager import CacheManager
from shardline_runtime.managers.decode_manager import DecodeManager
from shardline_runtime.managers.expert_control import handle_expert_control
from shardline_runtime.managers.io_struct import (
    AbortReq,
    ExpertDistributionReqInput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    LoadLoRAAdapterReqInput,
    RebalanceExpertsReqInput,
    SchedulerInfo,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReqInput,
)
from shardline_runtime.managers.lora_control import LoRAControl
from shardline_runtime.managers.overlap import FutureMap, InFlightStep, launch_step
from shardline_runtime.managers.prefill_manager import PrefillManager
from shardline_runtime.managers.req import FinishReason, Req
from shardline_runtime.managers.schedule_batch import ScheduleBatch
from shardline_runtime.managers.schedule_policy import BatchLimits, NewTokenRatio
from shardline_runtime.managers.scheduler_output import SchedulerOutputMixin
from shardline_runtime.managers.scheduler_pp import SchedulerPPMixin
from shardline_runtime.managers.scheduler_weight_sync import (
    UPDATE_REQUESTS,
    SchedulerWeightSyncMixin,
)
from shardline_runtime.managers.weights_state import UpdateTimings, WeightsPhase, WeightsState
from shardline_runtime.mem_cache.radix_cache import RadixCache
from shardline_runtime.model_executor.generation_result import GenerationBatchResult
from shardline_runtime.model_loader.checkpoint_digest import safe_checkpoint_digest
from shardline_runtime.termination_log import write_termination_log

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500  # rank 0 heartbeat while idle: keeps other ranks' broadcast within its timeout


def eos_token_ids(model_config: Any) -> list[int]:
    """EOS ids from ``config.json`` and ``generation_config.json`` (int or list in either)."""
    ids: list[int] = []
    sources = [getattr(model_config, "hf_config", {}) or {}]
    gen_path = os.path.join(getattr(model_config, "model_path", ""), "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            sources.append(json.load(f))
    for cfg in sources:
        value = cfg.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids


class Scheduler(SchedulerOutputMixin, SchedulerWeightSyncMixin, SchedulerPPMixin):
    """Request queue, batching, KV budget and finishing for one TP rank (of one pipeline stage).

    Args:
        server_args: the validated ``ServerArgs``.
        tp_rank: this process's TP rank (its stage is ``worker.pp_rank``).
        worker: the rank's ``TpModelWorker`` (built by the caller, after the process group).
        input_addr / output_addr: ZMQ addresses (rank 0 only): requests are PULLed from
            ``input_addr`` (bound here), outputs PUSHed to ``output_addr``.
    """

    def __init__(
        self,
        server_args: Any,
        tp_rank: int,
        worker: Any,
        input_addr: str | None = None,
        output_addr: str | None = None,
    ):
        self.server_args = server_args
        self.tp_rank = tp_rank
        self.worker = worker
        self.tp_size = server_args.tp_size
        self.pp_size = getattr(worker, "pp_size", 1)
        self.running_mbs = None  # micro-batch slots (pipeline parallelism only)
        self.max_req_len = worker.max_req_len
        self.max_req_input_len = worker.max_req_input_len
        self.max_total_num_tokens = worker.max_total_num_tokens
        self.max_running_requests = min(
            server_args.max_running_requests, worker.max_running_requests
        )
        chunk = server_args.chunked_prefill_size
        self.allocator = worker.token_to_kv_pool_allocator
        self.req_to_token_pool = worker.req_to_token_pool
        # KV computed under one LoRA adapter must not serve another: no shared prefixes with LoRA.
        lora = getattr(server_args, "enable_lora", False)
        self.tree_cache = RadixCache(
            self.allocator.free, disable=server_args.disable_radix_cache or lora
        )
        self.cache = CacheManager(
            self.allocator, self.req_to_token_pool, self.tree_cache, self.max_total_num_tokens
        )
        self.new_token_ratio = NewTokenRatio()
        limits = BatchLimits(
            max_running_requests=self.max_running_requests,
            max_prefill_tokens=server_args.max_prefill_tokens,
            chunked_prefill_size=chunk if chunk and chunk > 0 else None,
            max_req_len=self.max_req_len,
        )
        self.prefill_manager = PrefillManager(
            self.cache, self.new_token_ratio, limits, self.new_batch
        )
        self.decode_manager = DecodeManager(self.cache, self.new_token_ratio, self.max_req_len)
        self.lora_control = LoRAControl(self) if lora else None
        self.eos_token_ids = eos_token_ids(worker.model_config)
        self.pending_update: Any = (
            None  # one of UPDATE_REQUESTS, waiting for running requests to finish
        )
        self.weights_state_sent: WeightsState | None = None  # what the HTTP process holds
        self.weights_digest: str | None = None  # rank 0: digest of the served checkpoint
        self.last_update: UpdateTimings | None = None  # rank 0: the last disk update's outcome
        self.last_stats = None
        self.step_started = None
        # Overlap scheduling (default; --disable-overlap-schedule). Off with LoRA (adapter slots
        # are loaded and evicted between steps, which must see no step in flight) and with
        # pipeline parallelism (its micro-batch loop keeps the stages busy instead).
        overlap = (
            not getattr(server_args, "disable_overlap_schedule", False)
            and not lora
            and self.pp_size == 1
        )
        self.future_map = FutureMap(self.req_to_token_pool.size, worker.device) if overlap else None
        self.in_flight: InFlightStep | None = None
        stream = getattr(worker.model_runner, "forward_stream", None)
        if overlap and stream is not None:
            # Every device op of this process (batch preparation, merges, the steps) is queued on
            # the forward stream in program order; the host waits only when it reads a result.
            torch.cuda.set_stream(stream)
        self.recv_socket = self.send_socket = None
        if self.pp_size > 1:
            self.init_pp_loop()
        if tp_rank == 0 and getattr(worker, "pp_rank", 0) == 0 and input_addr is not None:
            ctx: zmq.Context = zmq.Context.instance()
            self.recv_socket = ctx.socket(zmq.PULL)
            self.recv_socket.bind(input_addr)
            self.send_socket = ctx.socket(zmq.PUSH)
            self.send_socket.connect(output_addr)
            self.poller = zmq.Poller()
            self.poller.register(self.recv_socket, zmq.POLLIN)
            self.weights_digest = safe_checkpoint_digest(worker.model_path)

    # ------------------------------------------------------------------ state (read-only views)

    @property
    def waiting_queue(self):
        return self.prefill_manager.waiting_queue

    @property
    def chunked_req(self) -> Req | None:
        return self.prefill_manager.chunked_req

    @property
    def running_batch(self) -> ScheduleBatch | None:
        return self.decode_manager.running_batch

    # ------------------------------------------------------------------ info

    def scheduler_info(self) -> SchedulerInfo:
        info = self.worker.get_worker_info()
        return SchedulerInfo(
            tp_rank=self.tp_rank,
            max_total_num_tokens=self.max_total_num_tokens,
            max_req_len=self.max_req_len,
            max_req_input_len=self.max_req_input_len,
            context_len=info["context_len"],
            vocab_size=info["vocab_size"],
            max_running_requests=self.max_running_requests,
            weights_revision=info["weights_revision"],
            model_path=info["model_path"],
            eos_token_ids=self.eos_token_ids,
            weight_version=info["weight_version"],
            hidden_size=getattr(self.worker.model_config, "hidden_size", 0),
            overlap_schedule=self.future_map is not None,
            weights_digest=self.weights_digest,
        )

    # ------------------------------------------------------------------ loop

    def event_loop(self, should_stop=lambda: False) -> None:
        """Run until ``should_stop()`` (checked once per iteration) returns True."""
        if self.pp_size > 1:
            self.event_loop_pp(should_stop)
            return
        self.start_watchdog()
        while not should_stop():
            self.step_started = (
                time.monotonic()
            )  # the watchdog covers the broadcast and the forward
            self.run_step(self.recv_requests())
            self.send_stats()
            self.step_started = None
        self.drain_in_flight()

    def run_step(self, messages: list[Any]) -> None:
        """One iteration: handle ``messages``, then run the next batch.

        Without overlap the batch runs and its result is processed at once. With overlap
        (``managers/overlap.py``) the batch is launched and then the *previous* step's result is
        processed, so the host prepares step N+1 while step N computes. A control message, an
        abort or a waiting weight update first drains the step in flight (they act on settled
        state); so does a retraction (``DecodeManager.schedule(settle=...)``).
        """
        if self.pending_update is not None or any(
            not isinstance(m, TokenizedGenerateReqInput) for m in messages
        ):
            self.drain_in_flight()
        self.process_input_requests(messages)
        self.join_in_flight_extend()
        batch = self.get_next_batch_to_run()
        if batch is None:
            self.drain_in_flight()
        elif self.future_map is None:
            self.process_batch_result(batch, self.run_batch(batch))
        else:
            result = launch_step(self.worker, batch.get_model_worker_batch(), self.future_map)
            previous, self.in_flight = self.in_flight, InFlightStep(batch, batch.copy(), result)
            if previous is not None:
                self._process_step(previous)

    def new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        """A ``ScheduleBatch`` of ``reqs`` over the worker's pools, vocabulary and device."""
        batch = ScheduleBatch.init_new(reqs, self.worker)
        batch.future_tokens = self.future_map is not None
        return batch

    def run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult:
        """Run the prepared ``batch`` on the worker (which sees only its ``ModelWorkerBatch``)
        and wait for the sampled tokens on the host (the loop without overlap)."""
        result = self.worker.forward_batch_generation(batch.get_model_worker_batch())
        return result.copy_to_cpu().wait()

    def is_idle(self) -> bool:
        if self.pending_update is None and self.generation_blocked():
            return True  # nothing can run until a control message arrives: poll at the idle pace
        busy = bool(self.running_batches()) or self.prefill_manager.has_work()
        return not busy and self.pending_update is None and self.in_flight is None

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """EXTEND of admitted requests (the running ones joining it with ``--enable-mixed-chunk``),
        else a DECODE step of the running batch, else None."""
        if self.generation_blocked():  # paused, or memory released: no forward at all
            return None
        # A pending weight update pauses admission, but a started chunked prefill must finish,
        # and so must requests retracted after they began generating on the old weights (else
        # they would end on the new ones: one response, two revisions).
        # The KV reserve covers every running request (all pipeline micro-batch slots and the
        # batches in flight). --max-running-requests caps them all together, and each slot takes
        # at most max(cap // slots, 1), as SGLang's pp_max_micro_batch_size, so one slot cannot
        # take every request and leave the stages idle. The adder admits while
        # num_running + admitted < cap, so num_running is set to make both caps hold.
        batches = self.running_batches()
        running = [r for batch in batches for r in batch.reqs if not r.finished()]
        total = len({id(r) for batch in batches for r in batch.reqs if r is not self.chunked_req})
        in_slot = 0 if self.running_batch is None else self.running_batch.batch_size
        cap = self.max_running_requests
        per_slot = max(cap // len(self.running_mbs or [None]), 1)
        batch = self.prefill_manager.schedule(
            running,
            started_only=self.pending_update is not None,
            num_running=max(total, in_slot + cap - per_slot),
        )
        if batch is not None:
            mixed = (
                self.decode_manager.take_for_mix() if self.server_args.enable_mixed_chunk else None
            )
            if mixed is not None:
                batch.mix_with_running(mixed)  # the mixed batch becomes the running batch after it
            return batch
        # overlap: the step in flight may finish requests, and retraction needs settled state
        step = self.decode_manager.schedule(settle=self.make_room_for_decode)
        for req in step.retracted:
            self.prefill_manager.requeue(req)
            logger.info(
                "[tp %d] retracted request %s (%d output tokens kept)",
                self.tp_rank,
                req.rid,
                len(req.output_ids),
            )
        if step.finished:
            self.stream_output(step.finished)
        return step.batch

    def make_room_for_decode(self) -> bool:
        """Called when a DECODE step cannot get one KV slot per running request; True when it
        freed or settled something (then the slots are checked again).

        First the overlap step in flight is settled (it may finish requests). Then a chunked
        prefill in progress gives its KV back: it was admitted after the running requests and has
        no output yet, so it is the most recently admitted request and is retracted first (its
        computed prefix stays in the prefix cache while unevicted). Without this, a lone running
        request was cut with a false ``length`` while another prompt's chunks held the pool. A
        chunk still in flight through the pipeline stages is left alone (its KV is being written).
        """
        if self.drain_in_flight():
            return True
        req = self.prefill_manager.chunked_req
        if req is None or req.req_pool_idx is None:
            return False
        inflight = [
            item[0] for item in getattr(self, "pp_inflight", None) or [] if item is not None
        ]
        if any(req in batch.reqs for batch in inflight):
            return False
        computed = req.kv_len
        self.prefill_manager.retract_chunked()
        self.decode_manager.num_retractions += 1
        self.new_token_ratio.on_retract()
        logger.info(
            "[tp %d] retracted chunked prefill %s (%d prompt tokens computed) for the running batch",
            self.tp_rank,
            req.rid,
            computed,
        )
        return True

    def running_batches(self) -> list:
        """Every non-empty batch holding running requests: the running batch, the micro-batch
        slots' and the batches still in flight through the pipeline stages."""
        candidates = [self.running_batch, *(self.running_mbs or [])]
        candidates += [
            item[0] for item in (getattr(self, "pp_inflight", None) or []) if item is not None
        ]
        seen: set[int] = set()
        out = []
        for batch in candidates:
            if batch is not None and not batch.is_empty() and id(batch) not in seen:
                seen.add(id(batch))
                out.append(batch)
        return out

    def recv_requests(self) -> list[Any]:
        """Rank 0: every message waiting on ZMQ (blocking up to the heartbeat when idle);
        then the list is broadcast so every rank processes the same messages. A later pipeline
        stage receives the list from the stage before it."""
        if getattr(self.worker, "pp_rank", 0) > 0:
            return self.pp_recv_requests()
        messages: list[Any] = []
        if self.tp_rank == 0 and self.recv_socket is not None:
            timeout = _IDLE_POLL_MS if self.is_idle() else 0
            if self.poller.poll(timeout):
                while True:
                    try:
                        messages.append(self.recv_socket.recv_pyobj(zmq.NOBLOCK))
                    except zmq.Again:
                        break
        if self.tp_size > 1:
            messages = broadcast_pyobj(messages)
        return messages

    def process_input_requests(self, messages: list[Any]) -> None:
        for msg in messages:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg.rid, msg.finish_reason)
            elif isinstance(msg, FlushCacheReqInput):
                self.send(self.flush_cache())
            elif isinstance(msg, UPDATE_REQUESTS):
                self.start_weight_update(msg)
            elif (
                isinstance(msg, (LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput))
                and self.lora_control is not None
            ):
                self.lora_control.handle(msg)
            elif isinstance(msg, (ExpertDistributionReqInput, RebalanceExpertsReqInput)):
                self.send(handle_expert_control(self.worker.model_runner, msg))
            elif not self.handle_control(msg):
                logger.warning(
                    "[tp %d] ignoring unknown message %s", self.tp_rank, type(msg).__name__
                )
        if self.pending_update is not None:
            self.maybe_run_weight_update()
        if self.lora_control is not None:
            self.lora_control.poll()

    def handle_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        n = len(msg.input_ids)
        params = msg.sampling_params
        if n == 0 or n > self.max_req_input_len:
            self.finish_unscheduled(
                msg,
                n,
                f"the prompt has {n} tokens; this server accepts 1 to {self.max_req_input_len}",
            )
            return
        if msg.lora_name is not None and (
            self.lora_control is None or not self.lora_control.is_loaded(msg.lora_name)
        ):
            # unloaded (or evicted) between the HTTP check and now: never let it reach a forward
            self.finish_unscheduled(msg, n, f"LoRA adapter {msg.lora_name!r} is not loaded")
            return
        # The KV pool (not the context) may clip max_new_tokens: the request ends with "length".
        room = self.max_req_len - n
        if params.max_new_tokens is None or params.max_new_tokens > room:
            params = replace(params, max_new_tokens=room)
        embeds = None
        if msg.input_embeds_positions is not None:
            embeds = torch.tensor(msg.input_embeds_values, dtype=torch.float32)
        req = Req(
            msg.rid,
            msg.input_ids,
            params,
            self.eos_token_ids,
            msg.return_logprob,
            msg.top_logprobs_num,
            msg.logprob_start_len,
            lora_name=msg.lora_name,
            input_embeds_positions=msg.input_embeds_positions,
            input_embeds_values=embeds,
        )
        self.prefill_manager.add(req)

    def abort_request(self, rid: str | None, reason: dict) -> None:
        """Abort ``rid`` (None: all) wherever it is; its KV is freed now, before the next step."""
        finish = FinishReason(
            reason.get("type", "abort"), reason.get("matched"), reason.get("message")
        )
        hit = self.prefill_manager.abort(rid, finish)
        inflight = self.inflight_batch_ids()
        for batch in self.running_batches():
            mine = [r for r in batch.reqs if (rid is None or r.rid == rid) and not r.finished()]
            for req in mine:
                req.finished_reason = finish
                self.cache.release(req)
            if (
                mine and id(batch) not in inflight
            ):  # an in-flight micro-batch keeps its rows until its result
                batch.filter_batch()
            hit += mine
        if hit:
            self.stream_output(hit)

    # ------------------------------------------------------------------ control

    def flush_cache(self) -> FlushCacheReqOutput:
        # Requests waiting while generation is paused hold no KV (SGLang: flushable after a retract).
        if (
            self.holds_kv()
            or self.pending_update is not None
            or (self.waiting_queue and self.paused_mode is None)
        ):
            return FlushCacheReqOutput(False, "requests are running or queued; flush when idle")
        self.tree_cache.reset()
        return FlushCacheReqOutput(True, "prefix cache flushed")

    # ------------------------------------------------------------------ rank 0 -> HTTP

    def send_weights_phase(self, phase: str) -> None:
        """Report the serving weights to the HTTP process as a whole :class:`WeightsState`
        (``phase`` now, the worker's path, revision and version) when any field changed."""
        worker = self.worker
        state = WeightsState(
            model_path=worker.model_path,
            revision=worker.weights_revision,
            weight_version=worker.weight_version,
            phase=WeightsPhase(phase),
            digest=self.weights_digest,
            last_update=self.last_update,
        )
        if state != self.weights_state_sent:
            self.weights_state_sent = state
            self.send(state)

    def send(self, msg: Any) -> None:
        if self.send_socket is not None:
            self.send_socket.send_pyobj(msg)

    def start_watchdog(self) -> None:
        """Exit the process when one loop iteration (broadcast of the step's messages, forward,
        results) runs longer than ``--watchdog-timeout`` seconds: a stuck collective or a dead
        peer becomes an error, never a hang. Weight loading is not timed."""
        limit = self.server_args.watchdog_timeout

        def watch() -> None:
            while True:
                time.sleep(min(5.0, limit / 4))
                started = self.step_started
                if started is not None and time.monotonic() - started > limit:
                    message = f"[tp {self.tp_rank}] watchdog: a forward step ran over {limit}s (a peer rank may be dead)"
                    logger.error(message)
                    write_termination_log(message)
                    os._exit(1)

        threading.Thread(target=watch, name="scheduler-watchdog", daemon=True).start()
