"""The scheduler loop of pipeline parallelism: micro-batches keep every stage busy.

After SGLang's ``event_loop_pp``. Every stage runs its own scheduler over the same messages, so
all stages (and all TP ranks of each) take the same decisions from the same state. The loop has
``pp_loop_size`` micro-batch slots (``pp_size`` by default), each with its own running batch; a
request lives in one slot. Iteration ``i`` (slot ``i % K``), on every stage::

    messages = recv_requests()        # stage 0: ZMQ + TP broadcast; others: from the stage before
    send messages to the next stage   # before acting on them, so a collective inside one
                                      # (a weight update's agreement) finds every stage
    process_input_requests(messages)
    batch_i = schedule slot i % K     # its previous batch was processed at iteration i - 1
    forward batch_i                   # recv proxies, run the stage's layers, send proxies on;
                                      # the last stage samples and sends the ids to every stage
    process the result of batch_{i-K+1} (slot (i + 1) % K): its ids came from the last stage

While stage 0 runs batch ``i``, stage 1 runs ``i - 1``, ..., the last stage ``i - K + 1``. Each stage
runs the batches in schedule order, so KV written by an earlier batch (a previous chunk, a prefix
in the cache, slots freed by an abort) is always in place before a later batch reads it. With
``pp_loop_size == 1`` the same loop runs one batch at a time through all stages.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shardline_runtime.distributed import recv_pyobj, send_pyobj

if TYPE_CHECKING:
    from shardline_runtime.managers.decode_manager import DecodeManager
    from shardline_runtime.managers.prefill_manager import PrefillManager
    from shardline_runtime.managers.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)


class SchedulerPPMixin:
    """Pipeline-parallel loop for :class:`~shardline_runtime.managers.scheduler.Scheduler`."""

    # Set by Scheduler.__init__ / init_pp_loop (declared here for the type checker).
    pp_size: int
    worker: Any
    prefill_manager: PrefillManager
    decode_manager: DecodeManager
    running_mbs: list[ScheduleBatch | None] | None
    pp_inflight: list[tuple[ScheduleBatch, Any] | None]
    step_started: float | None
    paused_mode: str | None
    start_watchdog: Callable[[], None]
    send_stats: Callable[[], None]
    recv_requests: Callable[[], list]
    process_input_requests: Callable[[list], None]
    get_next_batch_to_run: Callable[[], ScheduleBatch | None]
    process_batch_result: Callable[..., None]

    def init_pp_loop(self, loop_size: int | None = None) -> None:
        """Micro-batch slots: ``loop_size`` of them (default ``pp_size``)."""
        self.pp_loop_size = loop_size or self.pp_size
        self.running_mbs = [None] * self.pp_loop_size
        self.pp_inflight = [
            None
        ] * self.pp_loop_size  # (batch, result) scheduled, result not processed
        self.pp_iteration = 0

    def event_loop_pp(self, should_stop=lambda: False) -> None:
        """Run :meth:`pp_step` until ``should_stop()`` (checked once per micro-batch)."""
        self.start_watchdog()
        while not should_stop():
            self.step_started = time.monotonic()
            self.pp_step()
            self.send_stats()
            self.step_started = None

    def pp_step(self) -> None:
        """One micro-batch iteration (see the module docstring)."""
        slot = self.pp_iteration % self.pp_loop_size
        self.pp_iteration += 1
        messages = self.recv_requests()
        if not self.worker.is_last_stage:
            send_pyobj(messages, self.worker.pp_rank + 1, self.worker.pending_sends)
        self.process_input_requests(messages)
        mbs = self.running_mbs
        assert mbs is not None, "init_pp_loop() first"
        self.decode_manager.running_batch = mbs[slot]  # this slot's running batch, for the policy
        batch = self.get_next_batch_to_run()
        mbs[slot], self.decode_manager.running_batch = self.decode_manager.running_batch, None
        if batch is not None:
            self.pp_inflight[slot] = (
                batch,
                self.worker.forward_batch_generation(batch.get_model_worker_batch()),
            )
        self.process_pp_result((slot + 1) % self.pp_loop_size)

    def process_pp_result(self, slot: int) -> None:
        """Process the in-flight batch of ``slot`` (its sampled ids from the last stage) into that
        slot's running batch."""
        item = self.pp_inflight[slot]
        if item is None:
            return
        self.pp_inflight[slot] = None
        batch, result = item
        self.worker.resolve_stage_outputs(result)
        mbs = self.running_mbs
        assert mbs is not None, "init_pp_loop() first"
        self.decode_manager.running_batch = mbs[slot]
        self.process_batch_result(batch, result)
        mbs[slot], self.decode_manager.running_batch = self.decode_manager.running_batch, None
        if self.paused_mode == "retract":  # paused while this batch was in flight
            self.retract_idle_slots()

    def retract_idle_slots(self) -> None:
        """Retract every request of the slots with no batch in flight (``/pause_generation``
        mode ``retract``); the in-flight ones follow as their results arrive."""
        inflight = self.inflight_batch_ids()
        current = self.decode_manager.running_batch
        for batch in self.running_mbs or []:
            if batch is None or id(batch) in inflight:
                continue
            self.decode_manager.running_batch = batch  # the decode manager retracts from its batch
            while self.decode_manager.is_running():
                self.prefill_manager.requeue(self.decode_manager.retract_one())
        self.decode_manager.running_batch = current

    def pp_recv_requests(self) -> list:
        """Stage > 0: this iteration's messages, as the previous stage forwarded them."""
        return recv_pyobj(self.worker.pp_rank - 1)

    def inflight_batch_ids(self) -> set[int]:
        """``id`` of every batch whose result is not processed yet (never filtered meanwhile)."""
        return {
            id(item[0]) for item in (getattr(self, "pp_inflight", None) or []) if item is not None
        }
