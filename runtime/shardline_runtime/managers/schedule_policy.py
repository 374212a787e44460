"""Batching policy as small objects (after SGLang's ``schedule_policy.py`` and mini-sglang's
``PrefillAdder``): the KV reserve estimate, the budget of one EXTEND batch, the retraction choice.

Policy (first come, first served, as SGLang's default ``fcfs``):

- Admission stops at ``max_running_requests`` (all pipeline micro-batch slots together, and
  ``max(max_running_requests // slots, 1)`` per slot), at ``max_prefill_tokens`` prompt tokens per
  step, and when the KV pool (free + evictable prefix-cache slots) cannot hold the new tokens
  plus a reserve for the running requests' future tokens (``new_token_ratio`` x their remaining
  ``max_new_tokens``, as SGLang estimates it; the ratio rises after a retraction and decays).
- A prompt longer than ``chunked_prefill_size`` is prefilled one chunk per step; only the last
  chunk samples a token.
- When a DECODE step cannot get one slot per request even after evicting the cache, the most
  recently admitted request is retracted first: a chunked prefill still in progress (it holds
  KV but has no output yet), then the running requests, newest first. A lone running request
  is cut with ``length`` only when it holds every used KV slot itself.

Nothing here runs a model: every object takes its collaborators (``CacheManager``, the limits,
the ratio) explicitly, so the policy is tested on real pools alone (``tests/serving/test_schedule_policy.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from shardline_runtime.managers.cache_manager import CacheManager
from shardline_runtime.managers.req import Req


@dataclass(frozen=True)
class BatchLimits:
    """The scheduler's fixed limits on one batch.

    Attributes:
        max_running_requests: requests decoding at once (running + admitted).
        max_prefill_tokens: new prompt tokens per EXTEND step.
        chunked_prefill_size: tokens per chunk of a long prompt; None: no chunking beyond
            ``max_prefill_tokens``.
        max_req_len: prompt + output tokens one request may reach (caps the reserve estimate).
    """

    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int | None
    max_req_len: int


@dataclass
class NewTokenRatio:
    """SGLang's ``new_token_ratio``: the fraction of a request's remaining ``max_new_tokens``
    the KV budget reserves for it. It decays by ``decay`` every DECODE step towards ``minimum``
    (requests usually stop early) and rises by ``retract_step`` after a retraction (the estimate
    was too low), up to 1.0."""

    value: float = 0.4
    minimum: float = 0.1
    decay: float = 0.002
    retract_step: float = 0.1

    def reserve(self, req: Req, max_req_len: int) -> int:
        """KV slots reserved for ``req``'s future output tokens."""
        limit = req.sampling_params.max_new_tokens
        remaining = (max_req_len if limit is None else limit) - len(req.output_ids)
        return int(min(remaining, max_req_len) * self.value)

    def reserved(self, reqs: Sequence[Req], max_req_len: int) -> int:
        return sum(self.reserve(r, max_req_len) for r in reqs)

    def on_decode_step(self) -> None:
        self.value = max(self.minimum, self.value - self.decay)

    def on_retract(self) -> None:
        self.value = min(1.0, self.value + self.retract_step)


class AddReqResult(enum.Enum):
    """Why :meth:`PrefillAdder.add_one_req` stopped (or ``CONTINUE``: added, try the next)."""

    CONTINUE = "continue"
    BATCH_FULL = "batch_full"  # max_running_requests, prefill tokens or request rows spent
    NO_KV = "no_kv"  # the KV pool cannot hold the prompt (and its reserve) now


def is_partial(req: Req) -> bool:
    """Before ``prepare_for_extend``: this round computes only part of the sequence (a chunk)."""
    return len(req.fill_ids) < len(req.origin_input_ids) + len(req.output_ids)


class PrefillAdder:
    """The budget of one EXTEND batch being formed; admits requests one at a time.

    Args:
        limits: the scheduler's :class:`BatchLimits`.
        ratio: the shared :class:`NewTokenRatio`.
        cache: the rank's :class:`CacheManager` (matched, locked; nothing is allocated here).
        running_reqs: the requests decoding now (their reserve is held back).
        num_running: requests counted against ``max_running_requests`` (default: all of
            ``running_reqs``; the scheduler raises it with pipeline micro-batches so that the
            per-slot cap holds too).

    Attributes:
        can_run_list: admitted requests, in order.
        new_chunked_req: the admitted request whose prompt continues next step, or None.
    """

    def __init__(
        self,
        limits: BatchLimits,
        ratio: NewTokenRatio,
        cache: CacheManager,
        running_reqs: Sequence[Req],
        num_running: int | None = None,
    ):
        self.limits = limits
        self.ratio = ratio
        self.cache = cache
        self.num_running = len(running_reqs) if num_running is None else num_running
        self.reserved_tokens = ratio.reserved(running_reqs, limits.max_req_len)
        self.rem_input_tokens = limits.max_prefill_tokens
        self.rem_kv_tokens = cache.available_size() - self.reserved_tokens
        self.chunk_size = min(
            limits.chunked_prefill_size or self.rem_input_tokens, self.rem_input_tokens
        )
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None

    def add_chunked_req(self, req: Req) -> None:
        """Admit the next chunk of a request whose prefill began in an earlier step (always
        first, whatever the budget: it already holds a row and its KV so far)."""
        req.init_next_round_input(None, self.chunk_size)
        self.rem_input_tokens -= req.extend_input_len
        self.rem_kv_tokens -= req.extend_input_len
        self._admit(req)

    def add_one_req(self, req: Req) -> AddReqResult:
        """Try to admit a waiting request: match its prefix, cut it to the chunk and token
        budget, check the KV budget, lock the prefix. Nothing changes when it is refused
        except ``req.fill_ids`` / ``prefix_indices`` (recomputed at the next attempt)."""
        if self.new_chunked_req is not None or self.rem_input_tokens <= 0:
            return AddReqResult.BATCH_FULL
        if self.num_running + len(self.can_run_list) >= self.limits.max_running_requests:
            return AddReqResult.BATCH_FULL
        if len(self.can_run_list) >= self.cache.free_rows():
            return AddReqResult.BATCH_FULL
        prefix, node = self.cache.match_prefix(req)
        req.init_next_round_input(prefix, min(self.chunk_size, self.rem_input_tokens))
        need = req.extend_input_len + self.ratio.reserve(req, self.limits.max_req_len)
        if need > self.rem_kv_tokens and self.can_run_list:
            return AddReqResult.NO_KV
        # The first request may eat into the running requests' reserve (else a long prompt
        # would starve behind them); not even its prompt fitting means wait for them to finish.
        if req.extend_input_len > self.rem_kv_tokens + (
            0 if self.can_run_list else self.reserved_tokens
        ):
            return AddReqResult.NO_KV
        self.rem_kv_tokens -= need + self.cache.lock(req, node)
        self.rem_input_tokens -= req.extend_input_len
        self._admit(req)
        return AddReqResult.CONTINUE

    def _admit(self, req: Req) -> None:
        self.can_run_list.append(req)
        if is_partial(req):
            self.new_chunked_req = req


def choose_retraction_victim(reqs: Sequence[Req]) -> int:
    """Index of the request a DECODE step short of KV retracts first: the most recently
    admitted one (the last row; merges append), which has the least decoding invested.

    Raises:
        ValueError: ``reqs`` is empty.
    """
    if not reqs:
        raise ValueError("no request to retract")
    return len(reqs) - 1
