"""Where every request is, and which batch runs next.

A request is waiting (``PrefillManager.waiting_queue``), chunked (``PrefillManager.chunked_req``),
running in a micro-batch slot (one ``DecodeManager`` per slot; one slot without pipeline
parallelism) or in flight (a pipeline micro-batch, or the overlap step). :class:`BatchPlanner`
answers questions across all of them (running batches, requests holding KV, the requests of an
adapter) and acts across them (abort, retract, the next batch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from shardline_runtime.managers.decode_manager import DecodeManager
from shardline_runtime.managers.prefill_manager import PrefillManager
from shardline_runtime.managers.req import FinishReason, Req
from shardline_runtime.managers.schedule_batch import ScheduleBatch
from shardline_runtime.managers.schedule_policy import NewTokenRatio
from shardline_runtime.managers.scheduler_output import OutputSender

logger = logging.getLogger(__name__)


class BatchPlanner:
    """The scheduling policy over the prefill and decode managers.

    Args:
        prefill: the :class:`PrefillManager`.
        slots: one :class:`DecodeManager` per micro-batch slot (the first is the default slot).
        ratio: the shared :class:`NewTokenRatio`.
        sender: rank 0's :class:`OutputSender` (finished and aborted requests are streamed).
        max_running_requests: the cap on running requests of all slots together.
        enable_mixed_chunk: running requests decode inside an EXTEND step.
        in_flight: the batches whose result is not processed yet (pipeline micro-batches).
        settle: (overlap) waits for the step in flight and processes it; False when none was.
        tp_rank: for the logs.
    """

    def __init__(
        self,
        prefill: PrefillManager,
        slots: list[DecodeManager],
        ratio: NewTokenRatio,
        sender: OutputSender,
        max_running_requests: int,
        enable_mixed_chunk: bool = False,
        in_flight: Callable[[], list[ScheduleBatch]] = list,
        settle: Callable[[], bool] = lambda: False,
        tp_rank: int = 0,
    ):
        self.prefill = prefill
        self.slots = slots
        self.ratio = ratio
        self.sender = sender
        self.max_running_requests = max_running_requests
        self.enable_mixed_chunk = enable_mixed_chunk
        self.in_flight = in_flight
        self.settle = settle
        self.tp_rank = tp_rank
        self._decode_owed: set[int] = set()  # slots (by id) whose requests sat out an EXTEND

    # ------------------------------------------------------------------ views

    def running_batches(self) -> list[ScheduleBatch]:
        """Every non-empty batch holding running requests: the slots' running batches and the
        batches still in flight through the pipeline stages."""
        candidates = [dm.running_batch for dm in self.slots] + self.in_flight()
        seen: set[int] = set()
        out = []
        for batch in candidates:
            if batch is not None and not batch.is_empty() and id(batch) not in seen:
                seen.add(id(batch))
                out.append(batch)
        return out

    def holds_kv(self) -> bool:
        """A running or chunked request holds KV."""
        return bool(self.running_batches()) or self.prefill.chunked_req is not None

    def load(self) -> tuple[int, int]:
        """``(running, queued)`` request counts (the chunked request counts as queued)."""
        running, queued, _, _ = self.load_report()
        return running, queued

    def lora_load(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(running, waiting)`` adapter names, each sorted without repeats: the adapters of
        running requests, and of queued ones (the chunked request counts as queued)."""
        _, _, running, waiting = self.load_report()
        return running, waiting

    def load_report(self) -> tuple[int, int, tuple[str, ...], tuple[str, ...]]:
        """:meth:`load` and :meth:`lora_load` in one pass over the requests (the loop reports
        them after every step)."""
        running_reqs = [r for b in self.running_batches() for r in b.reqs if not r.finished()]
        waiting = list(self.prefill.waiting_queue)
        if self.prefill.chunked_req is not None:
            waiting.append(self.prefill.chunked_req)
        running_lora = {r.lora_name for r in running_reqs if r.lora_name}
        waiting_lora = {r.lora_name for r in waiting if r.lora_name}
        return (
            len(running_reqs),
            len(waiting),
            tuple(sorted(running_lora)) if running_lora else (),
            tuple(sorted(waiting_lora)) if waiting_lora else (),
        )

    def all_requests(self) -> list[Req]:
        """Queued, chunked and running requests."""
        reqs = list(self.prefill.waiting_queue)
        if self.prefill.chunked_req is not None:
            reqs.append(self.prefill.chunked_req)
        return reqs + [r for batch in self.running_batches() for r in batch.reqs]

    # ------------------------------------------------------------------ the next batch

    def next_batch(
        self, decode: DecodeManager | None = None, admits: Callable[[Req], bool] | None = None
    ) -> ScheduleBatch | None:
        """EXTEND of admitted requests (the running ones of ``decode``'s slot joining it with
        ``--enable-mixed-chunk``), else a DECODE step of that slot, else None.

        No EXTEND follows an EXTEND that the slot's running requests sat out: a DECODE step of
        them comes between. Prefill first alone starves decoding whenever a request arrives
        during every step (a forward slower than the gap between arrivals, as under a burst of
        requests held by a weight update on a busy machine): the running requests then never
        advance and nothing finishes until arrivals stop (issue 23). Sarathi-Serve's
        "stall-free" batching (Agrawal et al., OSDI 2024) makes the same point for decodes.

        ``admits``: while a weight update is pending, the waiting requests it may still start
        (``ControlPlane.admits``: the ones that arrived before the update, and requests retracted
        after they began generating on the old weights, else they would end on the new ones: one
        response, two revisions); a started chunked prefill always finishes.
        """
        decode = decode or self.slots[0]
        if id(decode) in self._decode_owed:
            self._decode_owed.discard(id(decode))
            owed = self._decode_step(decode)
            if owed is not None:
                return owed
        if not self.prefill.has_work():  # nothing to admit (steady decode): no EXTEND to form
            return self._decode_step(decode)
        # The KV reserve covers every running request (all micro-batch slots and the batches in
        # flight). --max-running-requests caps them all together, and each slot takes at most
        # max(cap // slots, 1), as SGLang's pp_max_micro_batch_size, so one slot cannot take
        # every request and leave the stages idle. The adder admits while
        # num_running + admitted < cap, so num_running is set to make both caps hold.
        batches = self.running_batches()
        chunked = self.prefill.chunked_req
        running = [r for batch in batches for r in batch.reqs if not r.finished()]
        total = len({id(r) for batch in batches for r in batch.reqs if r is not chunked})
        in_slot = 0 if decode.running_batch is None else decode.running_batch.batch_size
        cap = self.max_running_requests
        per_slot = max(cap // len(self.slots), 1)
        batch = self.prefill.schedule(
            running, admits=admits, num_running=max(total, in_slot + cap - per_slot)
        )
        if batch is not None:
            mixed = decode.take_for_mix() if self.enable_mixed_chunk else None
            if mixed is not None:
                batch.mix_with_running(mixed)  # the mixed batch becomes the running batch after it
            elif decode.is_running():
                self._decode_owed.add(id(decode))
            return batch
        return self._decode_step(decode)

    def _decode_step(self, decode: DecodeManager) -> ScheduleBatch | None:
        """A DECODE step of ``decode``'s slot (requeueing what it retracts, streaming what it
        finished), or None when nothing decodes."""
        step = decode.schedule(settle=self.make_room_for_decode)
        for req in step.retracted:
            self.prefill.requeue(req)
            logger.info(
                "[tp %d] retracted request %s (%d output tokens kept)",
                self.tp_rank,
                req.rid,
                len(req.output_ids),
            )
        if step.finished:
            self.sender.stream(step.finished)
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
        if self.settle():
            return True
        req = self.prefill.chunked_req
        if req is None or req.req_pool_idx is None:
            return False
        if any(req in batch.reqs for batch in self.in_flight()):
            return False
        computed = req.kv_len
        self.prefill.retract_chunked()
        self.slots[0].num_retractions += 1
        self.ratio.on_retract()
        logger.info(
            "[tp %d] retracted chunked prefill %s (%d prompt tokens computed) for the running batch",
            self.tp_rank,
            req.rid,
            computed,
        )
        return True

    # ------------------------------------------------------------------ acting on every request

    def abort(self, rid: str | None, reason: dict) -> None:
        """Abort ``rid`` (None: all) wherever it is; its KV is freed now, before the next step."""
        finish = FinishReason.from_dict(reason)
        hit = self.prefill.abort(rid, finish)
        in_flight = {id(batch) for batch in self.in_flight()}
        for batch in self.running_batches():
            mine = [r for r in batch.reqs if (rid is None or r.rid == rid) and not r.finished()]
            for req in mine:
                req.finished_reason = finish
                self.prefill.cache.release(req)
            if mine and id(batch) not in in_flight:  # in flight: keeps its rows until its result
                batch.filter_batch()
            hit += mine
        if hit:
            self.sender.stream(hit)

    def retract_idle_slots(self) -> None:
        """Retract every running request of the slots with no batch in flight back to the
        queue (``/pause_generation`` mode ``retract``); the in-flight ones follow as their
        results arrive."""
        in_flight = {id(batch) for batch in self.in_flight()}
        for decode in self.slots:
            if decode.running_batch is None or id(decode.running_batch) in in_flight:
                continue
            while decode.is_running():
                self.prefill.requeue(decode.retract_one())

    def retract_all(self) -> None:
        """Retract the idle slots' requests and the chunked prefill (pause mode ``retract``)."""
        self.retract_idle_slots()
        self.prefill.retract_chunked()
