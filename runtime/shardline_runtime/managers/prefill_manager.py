"""PrefillManager: the waiting queue and the chunked request; forms each EXTEND batch.

Collaborators are explicit (after mini-sglang's ``PrefillManager``): the :class:`CacheManager`
it matches, locks and frees through, the :class:`NewTokenRatio` and :class:`BatchLimits` the
:class:`PrefillAdder` budgets with, and ``new_batch`` (the worker's ``ScheduleBatch`` factory).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from shardline_runtime.managers.cache_manager import CacheManager
from shardline_runtime.managers.req import FinishReason, Req
from shardline_runtime.managers.schedule_batch import ScheduleBatch
from shardline_runtime.managers.schedule_policy import (
    AddReqResult,
    BatchLimits,
    NewTokenRatio,
    PrefillAdder,
)


class PrefillManager:
    """Requests not yet (or no longer) decoding, first come first served.

    Args:
        cache: the rank's :class:`CacheManager`.
        ratio: the shared :class:`NewTokenRatio`.
        limits: the scheduler's :class:`BatchLimits`.
        new_batch: builds a ``ScheduleBatch`` over the worker's pools from a list of requests.

    Attributes:
        waiting_queue: requests waiting for their (next) prefill; retracted ones go first.
        chunked_req: the request whose chunked prefill continues next step (holds a row), or None.
    """

    def __init__(
        self,
        cache: CacheManager,
        ratio: NewTokenRatio,
        limits: BatchLimits,
        new_batch: Callable[[list[Req]], ScheduleBatch],
    ):
        self.cache = cache
        self.ratio = ratio
        self.limits = limits
        self.new_batch = new_batch
        self.waiting_queue: deque[Req] = deque()
        self.chunked_req: Req | None = None

    def add(self, req: Req) -> None:
        self.waiting_queue.append(req)

    def requeue(self, req: Req) -> None:
        """Put a retracted request (its KV already released) at the front of the queue."""
        self.waiting_queue.appendleft(req)

    def has_work(self) -> bool:
        return bool(self.waiting_queue) or self.chunked_req is not None

    def schedule(
        self,
        running_reqs: Sequence[Req],
        admits: Callable[[Req], bool] | None = None,
        num_running: int | None = None,
    ) -> ScheduleBatch | None:
        """Form and prepare an EXTEND batch: the chunked request's next chunk first, then waiting
        requests in order while the :class:`PrefillAdder` admits them; with ``admits`` (a weight
        update is pending) the queue stops at the first request it refuses. None when nothing can run
        (KV slots are allocated only when every admitted request's new tokens fit).
        ``num_running`` is passed to the :class:`PrefillAdder` (``max_running_requests`` count).

        Raises:
            KVCacheFullError: from ``prepare_for_extend`` (not expected: slots were ensured).
        """
        if not self.has_work():
            return None
        adder = PrefillAdder(self.limits, self.ratio, self.cache, running_reqs, num_running)
        if self.chunked_req is not None:
            req, self.chunked_req = self.chunked_req, None
            adder.add_chunked_req(req)
        while self.waiting_queue:
            req = self.waiting_queue[0]
            if admits is not None and not admits(req):
                break
            if adder.add_one_req(req) is not AddReqResult.CONTINUE:
                break
            self.waiting_queue.popleft()
        admitted = adder.can_run_list
        self.chunked_req = adder.new_chunked_req
        if not admitted:
            return None
        if not self.cache.ensure_free(sum(r.extend_input_len for r in admitted)):
            self._undo(admitted)  # let decode free memory first
            return None
        for req in admitted:
            if not req.admitted:  # a retracted request keeps its first count
                req.cached_tokens, req.admitted = req.tree_prefix_len, True
        batch = self.new_batch(admitted)
        # the batch remembers its own chunked request: with pipeline micro-batches or overlap the
        # next chunk may be formed before this batch's result is processed
        batch.chunked_req = self.chunked_req
        batch.prepare_for_extend()
        return batch

    def _undo(self, admitted: list[Req]) -> None:
        """Put admitted requests back untouched (prefix locks released); a request that holds a
        row (a continuing chunk) stays the chunked request."""
        self.chunked_req = None
        for req in reversed(admitted):
            if req.req_pool_idx is None:
                self.cache.release(req)
                self.waiting_queue.appendleft(req)
            else:
                self.chunked_req = req

    def abort(self, rid: str | None, finish: FinishReason) -> list[Req]:
        """Finish ``rid`` (None: every request) here with ``finish`` and free its KV; returns
        the requests aborted."""
        hit = [r for r in self.waiting_queue if rid is None or r.rid == rid]
        for req in hit:
            self.waiting_queue.remove(req)
        if self.chunked_req is not None and (rid is None or self.chunked_req.rid == rid):
            hit.append(self.chunked_req)
            self.chunked_req = None
        for req in hit:
            req.finished_reason = finish
            self.cache.release(req)
        return hit

    def retract_chunked(self) -> Req | None:
        """Free the chunked request's KV and requeue it first (it is prefilled again later,
        reusing what the prefix cache kept of its computed tokens); returns it, or None when
        there was none."""
        req, self.chunked_req = self.chunked_req, None
        if req is not None:
            self.cache.release(req)
            self.requeue(req)
        return req
