"""DecodeManager: the running batch; prepares each DECODE step, retracting when KV runs short.

Collaborators are explicit (after mini-sglang's ``DecodeManager``): the :class:`CacheManager`
and the :class:`NewTokenRatio`. Retracted requests are returned to the caller, which requeues
them (``PrefillManager.requeue``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shardline_runtime.managers.cache_manager import CacheManager
from shardline_runtime.managers.req import FinishReason, Req
from shardline_runtime.managers.schedule_batch import ScheduleBatch
from shardline_runtime.managers.schedule_policy import NewTokenRatio, choose_retraction_victim
from shardline_runtime.managers.speculative_step import SpeculativeDecoding


@dataclass
class DecodeStep:
    """What :meth:`DecodeManager.schedule` decided.

    Attributes:
        batch: the prepared DECODE batch, or None when nothing runs.
        retracted: requests taken out (KV freed), in retraction order; requeue each in turn.
        finished: requests ended without running (KV freed); stream their finish.
    """

    batch: ScheduleBatch | None
    retracted: list[Req] = field(default_factory=list)
    finished: list[Req] = field(default_factory=list)


class DecodeManager:
    """Requests decoding one token per step (continuous batching).

    Args:
        cache: the rank's :class:`CacheManager`.
        ratio: the shared :class:`NewTokenRatio`.
        max_req_len: the worker's limit on prompt + output tokens.
        speculative: with ``--speculative-algorithm``, what turns a DECODE step into a
            TARGET_VERIFY step when drafts exist.

    Attributes:
        running_batch: the ``ScheduleBatch`` of decoding requests, or None.
        num_retractions: retractions so far (a statistic).
    """

    def __init__(
        self,
        cache: CacheManager,
        ratio: NewTokenRatio,
        max_req_len: int,
        speculative: SpeculativeDecoding | None = None,
    ):
        self.cache = cache
        self.speculative = speculative
        self.ratio = ratio
        self.max_req_len = max_req_len
        self.running_batch: ScheduleBatch | None = None
        self.num_retractions = 0

    @property
    def running_reqs(self) -> list[Req]:
        return [] if self.running_batch is None else self.running_batch.reqs

    def is_running(self) -> bool:
        return self.running_batch is not None and not self.running_batch.is_empty()

    def add(self, batch: ScheduleBatch) -> None:
        """Requests of a finished EXTEND step (already filtered) join the running batch."""
        if self.running_batch is None or self.running_batch.is_empty():
            self.running_batch = batch
        else:
            self.running_batch.merge_batch(batch)

    def take_for_mix(self) -> ScheduleBatch | None:
        """The running batch, handed over to decode inside an EXTEND step (mixed chunk), when
        one KV slot per request can be had; None leaves it decoding on its own."""
        batch = self.running_batch
        if batch is None or batch.is_empty() or not self.cache.ensure_free(batch.batch_size):
            return None
        self.running_batch = None
        return batch

    def schedule(self, settle: Callable[[], bool] | None = None) -> DecodeStep:
        """Prepare a DECODE step: one new KV slot per request, retracting requests (most
        recently admitted first) until the slots fit; with speculation, a TARGET_VERIFY step
        instead when drafts exist and their slots can be had.

        Args:
            settle: called before each retraction; True when it changed the state, then the
                slots are checked again. The scheduler's ``make_room_for_decode``: the overlap
                step in flight may finish requests (and a retraction needs settled state), and a
                chunked prefill in progress, admitted after the running requests, is retracted
                before any of them.
        """
        batch = self.running_batch
        if batch is None or batch.is_empty():
            return DecodeStep(None)
        self.ratio.on_decode_step()
        step = DecodeStep(batch)
        while True:
            batch = self.running_batch  # settling may have merged into or emptied it
            if batch is None or batch.is_empty():
                step.batch = None
                return step
            step.batch = batch
            if self.cache.ensure_free(batch.batch_size):
                break
            if settle is not None and settle():
                continue
            if batch.batch_size == 1 and self.cache.used_tokens() <= batch.reqs[0].kv_len:
                # One request holding every used slot cannot grow: it is at the pool size
                # (max_req_len clips it before that, so this is defensive). When others hold KV
                # (another pipeline micro-batch slot's requests), it is retracted instead.
                req = batch.reqs[0]
                req.finished_reason = FinishReason("length", self.max_req_len)
                self.cache.release(req)
                batch.filter_batch()
                step.batch = None
                step.finished.append(req)
                return step
            step.retracted.append(self.retract_one())
        if self.speculative is None or not self.speculative.prepare(batch):
            batch.prepare_for_decode()
        return step

    def retract_one(self) -> Req:
        """Preempt one running request (:func:`choose_retraction_victim`): free its KV and return
        it, keeping its output tokens (it is prefilled again later: exact continuation).

        Raises:
            ValueError: nothing is running.
        """
        batch = self.running_batch
        reqs = [] if batch is None else batch.reqs
        victim = choose_retraction_victim(reqs)
        assert batch is not None
        req = reqs[victim]
        self.cache.release(req)
        batch.filter_batch([i for i in range(batch.batch_size) if i != victim])
        self.num_retractions += 1
        self.ratio.on_retract()
        return req

    def abort(self, rid: str | None, finish: FinishReason) -> list[Req]:
        """Finish ``rid`` (None: every request) with ``finish``, free its KV and drop it from the
        running batch; returns the requests aborted."""
        if self.running_batch is None:
            return []
        hit = [r for r in self.running_batch.reqs if rid is None or r.rid == rid]
        for req in hit:
            req.finished_reason = finish
            self.cache.release(req)
        if hit:
            self.running_batch.filter_batch()
        return hit
