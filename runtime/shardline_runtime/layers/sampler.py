"""Sampler: next-token ids (and logprobs) from the last-position logits of a batch.

Order of operations per step (as vLLM / SGLang):
  1. drop padded vocabulary columns (TP pads the LM head; padded ids are never sampled);
  2. logprobs, when asked, of the *unprocessed* distribution ``log_softmax(logits)``: before
     penalties, temperature and truncation (vLLM's default ``logprobs_mode=raw_logprobs``);
  3. penalties (repetition / frequency / presence);
  4. greedy rows take the argmax; other rows: ``softmax(logits / temperature)``, then top-k,
     top-p and min-p truncation (the most likely token always survives, so no row is ever empty
     and no NaN can appear), then one draw.

The draw is the exponential race ``argmax(p / q)`` with ``q ~ Exp(1)``, which samples exactly from
``p``. A seeded request fills its ``q`` row from its own ``torch.Generator``, so its tokens do not
depend on which other requests share the batch; unseeded rows use the global generator (seeded
identically on every TP rank by ``TpModelWorker``). Token ids are additionally broadcast from TP
rank 0 when a ``broadcast`` function is given, so ranks can never diverge.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from shardline_runtime.sampling.penalties import finite_logits
from shardline_runtime.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class SamplerOutput:
    """Result of one sampling step for ``bs`` rows.

    Attributes:
        next_token_ids: (bs,) int64.
        next_token_logprobs: (bs,) float32 logprob of the chosen token, or ``None``.
        top_logprobs_val / top_logprobs_idx: per row, the ``top_logprobs_nums[i]`` best
            (logprob, token id) pairs as Python lists, or ``None``.
    """

    next_token_ids: torch.Tensor
    next_token_logprobs: torch.Tensor | None = None
    top_logprobs_val: list[list[float]] | None = None
    top_logprobs_idx: list[list[int]] | None = None


def top_k_top_p_min_p_renorm(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    need_top_k: bool = True,
    need_top_p: bool = True,
    need_min_p: bool = True,
) -> torch.Tensor:
    """Zero the probabilities outside top-k / top-p / min-p; rows are not renormalised (the
    exponential race does not need it).

    Args:
        probs: (bs, vocab) float32, rows summing to 1.
        top_ks: (bs,) int64 in [1, vocab]. top_ps: (bs,) float32 in (0, 1]. min_ps: (bs,) in [0, 1].

    Returns:
        (bs, vocab) float32; the most likely token of each row is always kept.
    """
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if need_top_k:
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        drop |= ranks[None, :] >= top_ks[:, None]
    if need_top_p:
        # keep a token when the mass strictly before it is below top_p (the first is always kept)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_ps[:, None]
    if need_min_p:
        drop |= sorted_probs < min_ps[:, None] * sorted_probs[:, :1]
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """(bs,) int64 index of each row's largest value of ``logits`` (bs, n), the first one on
    ties (as ``argmax``; NaN counts as the largest, as in both torch and NumPy).

    On the CPU a float32 input goes through NumPy's vectorised ``argmax`` (zero-copy views both
    ways): over a 32k vocabulary, one thread, about 5 us at batch 1 and 0.6 ms at batch 64,
    against 35 us and 3.7 ms for torch's ``max(dim).indices`` (itself about half of
    ``torch.argmax``); on a greedy decode step that was most of the sampling. Elsewhere (CUDA,
    other dtypes) ``max(dim).indices``, which gives the same indices.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        ids = logits.numpy().argmax(axis=-1)
        return torch.from_numpy(ids if ids.dtype == np.int64 else ids.astype(np.int64))
    return logits.max(dim=-1).indices


HOST_ID_RING = 4  # a greedy step's ids stay unchanged for the next HOST_ID_RING - 1 steps


class HostIdRing:
    """Preallocated (bs,) int64 CPU tensors that :func:`greedy_on_host` writes each step's argmax
    into through NumPy views (``ndarray.argmax(out=)``), used in turn: no ``from_numpy`` and no
    new array per step.

    A step's ids stay as they were for the next ``HOST_ID_RING - 1`` steps. Nothing holds them
    longer: the overlap loop reads them as the next step's input ids (``FutureMap``) and when it
    processes the step, one step later, as ``host_decode_inputs.py``'s ring argues for its own
    buffers. The pipeline loop processes a step ``loop_size - 1`` steps later (``loop_size``
    micro-batch slots, ``pp_size`` by default, any number with ``Scheduler(pp_loop_size=)``), so
    a runner with ``pp_size > 1`` (``ModelRunner``) and a scheduler with more than one slot
    (``Scheduler``) use no ring.
    """

    def __init__(self, capacity: int = 64):
        self._alloc(capacity)
        self._next = 0

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self._buffer = torch.zeros((HOST_ID_RING, capacity), dtype=torch.int64)
        self._host = self._buffer.numpy()
        self._views: dict[tuple[int, int], tuple[torch.Tensor, np.ndarray]] = {}

    def next(self, bs: int) -> tuple[torch.Tensor, np.ndarray]:
        """The next slot's (bs,) int64 tensor and its NumPy view (the same memory)."""
        if bs > self.capacity:
            self._alloc(max(bs, 2 * self.capacity))
        slot = self._next
        self._next = (slot + 1) % HOST_ID_RING
        views = self._views.get((slot, bs))
        if views is None:
            views = self._views[(slot, bs)] = (self._buffer[slot, :bs], self._host[slot, :bs])
        return views


def greedy_on_host(
    logits: torch.Tensor, rows: int, vocab_size: int, ring: HostIdRing | None = None
) -> tuple[torch.Tensor, np.ndarray] | None:
    """:func:`greedy_argmax` of a CPU float32 (rows, vocab_size) ``logits`` exactly as the
    sampler's greedy path computes it, with the shape checks done on the NumPy view (cheaper
    than torch's); None when ``logits`` is anything else (then the sampler's own path runs).
    The hot path of a greedy CPU decode step (``sample_step.sample_batch``).

    Returns:
        the (rows,) int64 ids as a CPU tensor and as a NumPy view of the same memory (written
        into ``ring``'s next slot when given, else new).
    """
    if not logits.is_cpu or logits.dtype is not torch.float32:  # is_cpu: no device object
        return None
    host = logits.numpy()
    if host.ndim != 2 or host.shape[0] != rows or host.shape[1] != vocab_size or not rows:
        return None
    if ring is not None:
        ids, out = ring.next(rows)
        host.argmax(axis=-1, out=out)
        return ids, out
    out = host.argmax(axis=-1)
    if out.dtype != np.int64:
        out = out.astype(np.int64)
    return torch.from_numpy(out), out


class Sampler(nn.Module):
    """Turns last-position logits into next-token ids.

    Args:
        broadcast: optional ``fn(tensor)`` that overwrites the tensor in place with TP rank 0's
            copy (e.g. a ``torch.distributed.broadcast`` over the TP group); ``None`` at tp_size 1.
    """

    def __init__(self, broadcast: Callable[[torch.Tensor], object] | None = None):
        super().__init__()
        self.broadcast = broadcast
        # greedy CPU steps' ids (sample_step.sample_batch); None: a new array per step
        self.host_ids: HostIdRing | None = HostIdRing()

    def forward(
        self,
        logits: torch.Tensor,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: Sequence[int] | None = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: (bs, vocab_padded) float32 logits of each row's last position.
            sampling_info: the batch's parameters; ``sampling_info.batch_size == bs``.
            return_logprob: also return the chosen token's logprob.
            top_logprobs_nums: per row, how many top logprobs to return (0 for none).

        Returns:
            :class:`SamplerOutput`.

        Raises:
            ValueError: ``logits`` rows do not match the batch, or the vocabulary is too small.
        """
        bs = logits.shape[0]
        if bs != sampling_info.batch_size:
            raise ValueError(
                f"logits have {bs} rows but the batch has {sampling_info.batch_size} requests"
            )
        if logits.shape[-1] < sampling_info.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[-1]} columns < vocab_size {sampling_info.vocab_size}"
            )
        if logits.shape[-1] != sampling_info.vocab_size:
            logits = logits[:, : sampling_info.vocab_size]
        if logits.dtype != torch.float32:
            logits = logits.float()
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if return_logprob or top_logprobs_nums else None
        )
        if sampling_info.penalties is not None:
            logits = sampling_info.penalties.apply(logits)

        if sampling_info.all_greedy:
            next_ids = greedy_argmax(logits)
        else:
            next_ids = self._sample(logits, sampling_info)
        if self.broadcast is not None:
            self.broadcast(next_ids)

        out = SamplerOutput(next_token_ids=next_ids)
        if raw_logprobs is not None:
            out.next_token_logprobs = raw_logprobs.gather(-1, next_ids[:, None]).squeeze(-1)
            if top_logprobs_nums and max(top_logprobs_nums) > 0:
                out.top_logprobs_val, out.top_logprobs_idx = top_logprobs(
                    raw_logprobs, top_logprobs_nums
                )
        return out

    @staticmethod
    def _sample(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        greedy_ids = greedy_argmax(logits)
        probs = torch.softmax(finite_logits(logits / info.temperatures), dim=-1)
        if info.need_top_k or info.need_top_p or info.need_min_p:
            probs = top_k_top_p_min_p_renorm(
                probs,
                info.top_ks,
                info.top_ps,
                info.min_ps,
                info.need_top_k,
                info.need_top_p,
                info.need_min_p,
            )
        race = torch.empty_like(probs)
        seeded = [i for i, g in enumerate(info.generators) if g is not None]
        if len(seeded) < len(info.generators):
            race.exponential_()
        for row in seeded:
            race[row].exponential_(generator=info.generators[row])
        # a draw of exactly 0 would turn a zeroed (truncated) token into 0/0 = NaN and win argmax
        race.clamp_(min=torch.finfo(race.dtype).tiny)
        sampled_ids = greedy_argmax(probs / race)
        return torch.where(info.is_greedy, greedy_ids, sampled_ids)


def top_logprobs(
    logprobs: torch.Tensor, nums: Sequence[int]
) -> tuple[list[list[float]], list[list[int]]]:
    """Per row ``i`` the ``nums[i]`` largest (logprob, token id) pairs, best first.

    Args:
        logprobs: (n, vocab) float32.  nums: n non-negative ints (clamped to the vocabulary).
    """
    k = min(max(nums), logprobs.shape[-1])
    top_values, top_indices = logprobs.topk(k, dim=-1)
    values, indices = top_values.tolist(), top_indices.tolist()
    return (
        [v[: min(n, k)] for v, n in zip(values, nums)],
        [i[: min(n, k)] for i, n in zip(indices, nums)],
    )
