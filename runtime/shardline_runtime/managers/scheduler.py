"""Scheduler: one per TP rank; continuous batching over a TpModelWorker (SGLang's Scheduler).

The loop, every rank in lockstep (rank 0 alone sends outputs to the HTTP process)::

    while True:
        messages = recv_requests()          # rank 0 reads ZMQ, broadcast_pyobj to every rank
        process_input_requests(messages)    # one type -> handler table (TypeBasedDispatcher)
        batch = get_next_batch_to_run()     # EXTEND of admitted requests, else DECODE of running
        if batch: results.process(batch, run_batch(batch))  # the worker gets a ModelWorkerBatch

With overlap scheduling (the default) step N+1 is launched before step N's result is processed
(``OverlapSteps``, ``overlap.py``). With pipeline parallelism the loop is ``PipelineLoop.step``
(``pipeline_loop.py``): micro-batches in flight through the stages, one ``DecodeManager`` per slot.

The scheduler is a small loop over parts that take their collaborators explicitly:
``CacheManager``, ``PrefillManager``, ``DecodeManager`` and ``BatchPlanner`` (the policy);
``RequestReceiver``, ``RequestIntake``, ``ResultProcessor`` and ``OutputSender`` (the data path);
``ControlPlane`` (weight updates, pause, memory, the ``WeightsState``), ``LoRAControl``,
``ExpertControl`` and the ``Watchdog``.
"""

from __future__ import annotations

import logging
from typing import Any

from shardline_runtime.constrained.xgrammar_backend import LazyGrammars
from shardline_runtime.managers.batch_planner import BatchPlanner
from shardline_runtime.managers.cache_manager import CacheManager
from shardline_runtime.managers.control_plane import ControlPlane, PauseMode
from shardline_runtime.managers.decode_manager import DecodeManager
from shardline_runtime.managers.dispatcher import TypeBasedDispatcher
from shardline_runtime.managers.expert_control import ExpertControl
from shardline_runtime.managers.io_struct import (
    AbortReq,
    AbortWeightUpdateReqInput,
    SchedulerInfo,
    TokenizedGenerateReqInput,
)
from shardline_runtime.managers.lora_control import LoRAControl
from shardline_runtime.managers.overlap_steps import OverlapSteps
from shardline_runtime.managers.pipeline_loop import PipelineLoop
from shardline_runtime.managers.prefill_manager import PrefillManager
from shardline_runtime.managers.req import Req
from shardline_runtime.managers.request_intake import RequestIntake, eos_token_ids
from shardline_runtime.managers.request_receiver import RequestReceiver, open_sockets
from shardline_runtime.managers.result_processor import ResultProcessor
from shardline_runtime.managers.schedule_batch import ScheduleBatch
from shardline_runtime.managers.schedule_policy import BatchLimits, NewTokenRatio
from shardline_runtime.managers.scheduler_output import OutputSender
from shardline_runtime.managers.speculative_step import SpeculativeDecoding
from shardline_runtime.managers.stats_report import StatsReport
from shardline_runtime.managers.watchdog import Watchdog
from shardline_runtime.managers.weight_update_run import awaiting_cutoff, initial_weights_state
from shardline_runtime.mem_cache.radix_cache import RadixCache
from shardline_runtime.model_executor.generation_result import GenerationBatchResult
from shardline_runtime.model_loader.validate import scheme_name
from shardline_runtime.speculative.proposer import build_proposer

logger = logging.getLogger(__name__)
GRAMMAR_WAIT_S = 0.005  # how long an otherwise idle loop waits for a compile per iteration


def batch_limits(server_args: Any, worker: Any) -> BatchLimits:
    """The fixed per-batch limits from the flags and the worker's KV pool."""
    chunk = server_args.chunked_prefill_size
    return BatchLimits(
        max_running_requests=min(server_args.max_running_requests, worker.max_running_requests),
        max_prefill_tokens=server_args.max_prefill_tokens,
        chunked_prefill_size=chunk if chunk and chunk > 0 else None,
        max_req_len=worker.max_req_len,
    )


class Scheduler:
    """Request queue, batching, KV budget and finishing for one TP rank (of one pipeline stage).

    Args:
        server_args: the validated ``ServerArgs``.
        tp_rank: this process's TP rank (its stage is ``worker.pp_rank``).
        worker: the rank's ``TpModelWorker`` (built by the caller, after the process group).
        input_addr / output_addr: ZMQ addresses (rank 0 only): requests are PULLed from
            ``input_addr`` (bound here), outputs PUSHed to ``output_addr``.
        pp_loop_size: micro-batch slots of the pipeline loop (default ``pp_size``; given alone,
            that loop runs on one stage).
    """

    def __init__(
        self,
        server_args: Any,
        tp_rank: int,
        worker: Any,
        input_addr: str | None = None,
        output_addr: str | None = None,
        pp_loop_size: int | None = None,
    ):
        self.server_args, self.tp_rank, self.worker = server_args, tp_rank, worker
        args = server_args
        self.limits = batch_limits(args, worker)
        lora = args.enable_lora
        pipelined = worker.pp_size > 1 or pp_loop_size is not None
        spec = args.speculative
        # No overlap with LoRA (adapters change between steps), PP (micro-batches overlap) or
        # speculation (a verify step's kept length decides the next step's inputs).
        overlap = not (args.disable_overlap_schedule or lora or pipelined or spec.enabled)
        first = tp_rank == 0 and worker.pp_rank == 0  # rank 0 of stage 0 talks to HTTP
        pull, push = open_sockets(input_addr, output_addr) if first else (None, None)

        self.receiver = RequestReceiver(pull, args.tp_size, worker.pp_rank)
        self.sender = OutputSender(push)
        self.watchdog = Watchdog(args.watchdog_timeout, tp_rank)
        # KV computed under one LoRA adapter must not serve another: no shared prefixes with LoRA.
        # An embedding model pools over every token of an input: no cached prefixes either.
        embedding = not worker.model_runner.is_generation
        self.tree_cache = RadixCache(
            worker.token_to_kv_pool_allocator.free,
            disable=args.disable_radix_cache or lora or embedding,
        )
        self.cache = CacheManager(
            worker.token_to_kv_pool_allocator,
            worker.req_to_token_pool,
            self.tree_cache,
            worker.max_total_num_tokens,
        )
        self.speculative = (
            SpeculativeDecoding(
                build_proposer(spec, getattr(worker, "draft_worker", None)),
                spec.max_draft_tokens,
                worker.max_req_len,
                self.cache,
            )
            if spec.enabled
            else None
        )
        self.new_token_ratio = NewTokenRatio()
        self.prefill_manager = PrefillManager(
            self.cache, self.new_token_ratio, self.limits, self.new_batch
        )
        slots = (pp_loop_size or worker.pp_size) if pipelined else 1
        if slots > 1:  # a result is processed slots - 1 steps later: no HostIdRing (sampler.py)
            worker.model_runner.sampler.host_ids = None
        self.decode_managers = [
            DecodeManager(self.cache, self.new_token_ratio, worker.max_req_len, self.speculative)
            for _ in range(slots)
        ]
        self.decode_manager = self.decode_managers[0]
        self.results = ResultProcessor(
            self.cache,
            self.decode_manager,
            worker.max_req_len,
            self.sender,
            self.speculative,
            pooling=worker.model_config.pooling,
        )
        self.overlap = OverlapSteps(worker, overlap, self.results, self.decode_manager)
        self.pipeline = (
            PipelineLoop(
                worker,
                self.decode_managers,
                self.recv_requests,
                self.process_input_requests,
                self.get_next_batch_to_run,
                self._process_slot_result,
            )
            if pipelined
            else None
        )
        self.planner = BatchPlanner(
            self.prefill_manager,
            self.decode_managers,
            self.new_token_ratio,
            self.sender,
            self.limits.max_running_requests,
            args.enable_mixed_chunk,
            in_flight=self.pipeline.batches_in_flight if self.pipeline is not None else list,
            settle=self.overlap.drain,
            tp_rank=tp_rank,
        )
        lora_parts = (worker.model_runner.lora_manager, self.planner.all_requests, self.sender.send)
        self.lora = LoRAControl(*lora_parts) if lora else None
        eos = eos_token_ids(worker.model_config)
        tokenizer_path = args.tokenizer_path or worker.model_config.model_path
        self.intake = RequestIntake(
            worker.max_req_input_len,
            worker.max_req_len,
            eos,
            self.lora,
            self.sender,
            self.prefill_manager.add,
            LazyGrammars(tokenizer_path, worker.model_config.vocab_size, eos),
            is_generation=worker.model_runner.is_generation,
        )
        self.grammar_queue = self.intake.grammar_queue
        if first and self.grammar_queue is not None:  # the leader says when a grammar is ready
            self.receiver.local_source = self._grammars_ready
        path, version = worker.model_config.model_path, str(args.weight_version)
        draft_worker = getattr(worker, "draft_worker", None)
        draft = None
        if draft_worker is not None:  # reported with the target's weights (weights_state.py)
            draft = (str(args.speculative.speculative_draft_model_path), args.draft_model_source)
        weights = initial_weights_state(
            path,
            args.revision,
            version,
            with_digest=first,
            model_source=args.model_source,
            graphs=worker.captured_graphs(),
            quantization=scheme_name(worker.model_config),
            draft=draft,
        )
        self.control = ControlPlane(
            worker,
            self.tree_cache,
            worker.model_runner.memory_saver,
            self.sender,
            self.watchdog,
            weights,
            abort=self.planner.abort,
            holds_kv=self.planner.holds_kv,
            retract=self.planner.retract_all,
            waiting=lambda: self.prefill_manager.waiting_queue,
            tp_rank=tp_rank,
            abort_requested=lambda: self.receiver.take(AbortWeightUpdateReqInput),
        )
        self.stats_report = StatsReport(
            self.planner,
            self.prefill_manager,
            None if pipelined or lora else self.decode_manager,
            self.cache,
            self.sender,
            self.grammar_queue,
            self.speculative,
        )
        runner = worker.model_runner
        self.experts = ExpertControl(
            runner.eplb_manager, runner.memory_saver, tp_rank, self.sender.send, worker.pp_rank
        )
        self.dispatch = TypeBasedDispatcher.merge(
            {
                TokenizedGenerateReqInput: self.intake.handle,
                AbortReq: self._abort,
            },
            self.grammar_queue.handlers() if self.grammar_queue is not None else {},
            self.control.handlers(),
            self.lora.handlers() if self.lora is not None else {},
            self.experts.handlers(),
        )

    def scheduler_info(self) -> SchedulerInfo:
        info, worker = self.worker.get_worker_info(), self.worker
        return SchedulerInfo(
            tp_rank=self.tp_rank,
            max_total_num_tokens=worker.max_total_num_tokens,
            max_req_len=worker.max_req_len,
            max_req_input_len=worker.max_req_input_len,
            context_len=info["context_len"],
            vocab_size=info["vocab_size"],
            max_running_requests=self.limits.max_running_requests,
            weights=self.control.weights,
            eos_token_ids=self.intake.eos_token_ids,
            hidden_size=getattr(worker.model_config, "hidden_size", 0),
            overlap_schedule=self.overlap.enabled,
            pooling=worker.model_config.pooling,
        )

    # ------------------------------------------------------------------ loop

    def event_loop(self, should_stop=lambda: False) -> None:
        """Run until ``should_stop()`` (checked once per iteration) returns True."""
        self.watchdog.start()
        while not should_stop():
            self.watchdog.begin()  # the watchdog covers the broadcast and the forward
            if self.pipeline is not None:
                self.pipeline.step()
            else:
                self.run_step(self.recv_requests())
            self.send_stats()
            self.watchdog.end()
        self.overlap.drain()

    def run_step(self, messages: list[Any]) -> None:
        """One iteration: handle ``messages``, then run the next batch.

        Without overlap the batch runs and its result is processed at once. With overlap the
        batch is launched and then the *previous* step's result is processed, so the host
        prepares step N+1 while step N computes. A control message, an abort or a waiting weight
        update first drains the step in flight (they act on settled state); so does a retraction
        (``DecodeManager.schedule(settle=...)``), and a step in flight that samples for a
        constrained request (its next bitmask needs that token accepted first).
        """
        if self.control.pending_update is not None or (
            messages and any(not isinstance(m, TokenizedGenerateReqInput) for m in messages)
        ):
            self.overlap.drain()
        self.process_input_requests(messages)
        self.overlap.join_in_flight_extend()
        if self.overlap.holds_grammar():
            self.overlap.drain()  # the sync point of constrained decoding (OverlapSteps)
        batch = self.get_next_batch_to_run()
        if batch is None:
            self.overlap.drain()
        elif not self.overlap.enabled:
            self.results.process(batch, self.run_batch(batch))
        else:
            self.overlap.launch(batch)

    def recv_requests(self) -> list[Any]:
        return self.receiver.recv(idle=self.receiver.socket is not None and self.is_idle())

    def process_input_requests(self, messages: list[Any]) -> None:
        for msg in messages:
            if not self.dispatch(msg):
                logger.warning(
                    "[tp %d] ignoring unknown message %s", self.tp_rank, type(msg).__name__
                )
        self.control.maybe_run_weight_update()
        if self.lora is not None:
            self.lora.poll()

    def _abort(self, msg: AbortReq) -> None:
        self.planner.abort(msg.rid, msg.finish_reason)
        if self.grammar_queue is not None:  # a request still compiling its grammar
            self.grammar_queue.abort(msg.rid, msg.finish_reason)

    def _grammars_ready(self) -> list[Any]:
        """The leader's ``GrammarsReady`` for this iteration; waits a few ms for a compile
        when nothing else can run (the loop does not spin while only grammars are pending)."""
        assert self.grammar_queue is not None
        busy = bool(self.planner.running_batches()) or self.prefill_manager.has_work()
        return self.grammar_queue.ready_messages(0.0 if busy else GRAMMAR_WAIT_S)

    def get_next_batch_to_run(self, decode: DecodeManager | None = None) -> ScheduleBatch | None:
        """The next batch of ``decode``'s slot (default: the only one), or None while
        generation is blocked (paused, memory released) or nothing can run."""
        if self.control.generation_blocked():
            return None
        return self.planner.next_batch(decode, admits=self.control.admits())

    def _process_slot_result(
        self, batch: ScheduleBatch, result: GenerationBatchResult, decode: DecodeManager
    ) -> None:
        self.results.process(batch, result, decode)
        if self.control.paused is PauseMode.RETRACT:  # paused while this batch was in flight
            self.planner.retract_idle_slots()

    def new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        """A ``ScheduleBatch`` of ``reqs`` over the worker's pools, vocabulary and device."""
        batch = ScheduleBatch.init_new(reqs, self.worker)
        batch.future_tokens = self.overlap.enabled
        return batch

    def run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult:
        """Run the prepared ``batch`` on the worker (which sees only its ``ModelWorkerBatch``)
        and wait for the sampled tokens on the host (the loop without overlap)."""
        result = self.worker.forward_batch_generation(batch.get_model_worker_batch())
        return result.copy_to_cpu().wait()

    def is_idle(self) -> bool:
        # An update in its admission window commits on a message (the cutoff), not on a step:
        # the loop may block on the socket meanwhile instead of spinning beside the staging.
        pending = self.control.pending_update is not None and not awaiting_cutoff(
            self.control.pending_update
        )
        if not pending and self.control.generation_blocked():
            return True  # nothing can run until a control message arrives: poll at the idle pace
        busy = bool(self.planner.running_batches()) or self.prefill_manager.has_work()
        busy = busy or bool(self.grammar_queue)  # a grammar compiling: poll for its end
        return not busy and not pending and self.overlap.in_flight is None

    def send_stats(self) -> None:
        """Rank 0: push ``SchedulerStats`` to the HTTP process when they changed
        (:class:`StatsReport`)."""
        self.stats_report.send()
