"""The scheduler loop of pipeline parallelism: micro-batches keep every stage busy.

After SGLang's ``event_loop_pp``. Every stage runs its own scheduler over the same messages, so
all stages (and all TP ranks of each) take the same decisions from the same state. The loop has
``loop_size`` micro-batch slots (``pp_size`` by default), each with its own
:class:`DecodeManager` (its running batch); a request lives in one slot. Iteration ``i`` (slot
``i % K``), on every stage::

    messages = receive()              # stage 0: ZMQ + TP broadcast; others: from the stage before
    send messages to the next stage   # before acting on them, so a collective inside one
                                      # (a weight update's agreement) finds every stage
    handle(messages)
    batch_i = schedule(slot i % K)    # its previous batch was processed at iteration i - 1
    forward batch_i                   # recv proxies, run the stage's layers, send proxies on;
                                      # the last stage samples and sends the ids to every stage
    process the result of batch_{i-K+1} (slot (i + 1) % K): its ids came from the last stage

While stage 0 runs batch ``i``, stage 1 runs ``i - 1``, ..., the last stage ``i - K + 1``. Each stage
runs the batches in schedule order, so KV written by an earlier batch (a previous chunk, a prefix
in the cache, slots freed by an abort) is always in place before a later batch reads it. With
``loop_size == 1`` the same loop runs one batch at a time through all stages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardline_runtime.distributed import send_pyobj
from shardline_runtime.managers.decode_manager import DecodeManager
from shardline_runtime.managers.schedule_batch import ScheduleBatch


class PipelineLoop:
    """Micro-batch slots and the batches in flight through the stages.

    Args:
        worker: the rank's ``TpModelWorker`` (``pp_rank``, ``is_last_stage``,
            ``forward_batch_generation``, ``resolve_stage_outputs``).
        slots: one :class:`DecodeManager` per micro-batch slot.
        receive: this iteration's messages.
        handle: acts on the messages (every stage, after forwarding them).
        schedule: the next batch of a slot (its decode manager), or None.
        process: processes a slot's batch result (batch, result, the slot's decode manager).

    Attributes:
        in_flight: per slot, ``(batch, result)`` scheduled and not processed yet, or None.
    """

    def __init__(
        self,
        worker: Any,
        slots: list[DecodeManager],
        receive: Callable[[], list],
        handle: Callable[[list], None],
        schedule: Callable[[DecodeManager], ScheduleBatch | None],
        process: Callable[[ScheduleBatch, Any, DecodeManager], None],
    ):
        self.worker = worker
        self.slots = slots
        self.receive = receive
        self.handle = handle
        self.schedule = schedule
        self.process = process
        self.in_flight: list[tuple[ScheduleBatch, Any] | None] = [None] * len(slots)
        self.iteration = 0

    def step(self) -> None:
        """One micro-batch iteration (see the module docstring)."""
        slot = self.iteration % len(self.slots)
        self.iteration += 1
        messages = self.receive()
        if not self.worker.is_last_stage:
            send_pyobj(messages, self.worker.pp_rank + 1, self.worker.pending_sends)
        self.handle(messages)
        batch = self.schedule(self.slots[slot])
        if batch is not None:
            result = self.worker.forward_batch_generation(batch.get_model_worker_batch())
            self.in_flight[slot] = (batch, result)
        self.process_result((slot + 1) % len(self.slots))

    def process_result(self, slot: int) -> None:
        """Process the in-flight batch of ``slot`` (its sampled ids from the last stage) into
        that slot's running batch."""
        item = self.in_flight[slot]
        if item is None:
            return
        self.in_flight[slot] = None
        batch, result = item
        self.worker.resolve_stage_outputs(result)
        self.process(batch, result, self.slots[slot])

    def batches_in_flight(self) -> list[ScheduleBatch]:
        """Every batch whose result is not processed yet (never filtered meanwhile)."""
        return [item[0] for item in self.in_flight if item is not None]

    def busy_slots(self) -> int:
        """Slots with running requests."""
        return sum(dm.is_running() for dm in self.slots)
