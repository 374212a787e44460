"""Sampling parameters of a whole batch as tensors, prepared once per batch.

Built when a ``ScheduleBatch`` is formed, then filtered / merged together with it; the sampler
reads it every step without touching Python lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardline_runtime.sampling.penalties import BatchedPenalties
from shardline_runtime.sampling.sampling_params import SamplingParams


@dataclass
class SamplingBatchInfo:
    """Per-row sampling parameters of a batch of ``bs`` requests.

    Attributes:
        temperatures: (bs, 1) float32; greedy rows hold 1.0 (they are never divided).
        top_ps: (bs,) float32.  top_ks: (bs,) int64, already clamped to ``vocab_size``.
        min_ps: (bs,) float32.  is_greedy: (bs,) bool.
        generators: per row, the request's own ``torch.Generator`` when seeded, else ``None``.
        penalties: penalty state, or ``None`` when no row has a penalty.
        vocab_size: real (unpadded) vocabulary size; logits beyond it are never sampled.
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    is_greedy: torch.Tensor
    generators: list[torch.Generator | None]
    penalties: BatchedPenalties | None
    vocab_size: int
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool

    @classmethod
    def from_reqs(
        cls, reqs: Sequence, vocab_size: int, device: torch.device | str
    ) -> SamplingBatchInfo:
        """Build from requests that have ``sampling_params``, ``origin_input_ids``,
        ``output_ids`` and a ``sampling_generator(device)`` method (see ``managers.schedule_batch.Req``).
        """
        params: list[SamplingParams] = [r.sampling_params for r in reqs]
        greedy = [p.is_greedy for p in params]
        temperatures = torch.tensor(
            [[1.0 if g else p.temperature] for p, g in zip(params, greedy)],
            dtype=torch.float32,
            device=device,
        )
        top_ks = torch.tensor(
            [p.effective_top_k(vocab_size) for p in params], dtype=torch.int64, device=device
        )
        top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        min_ps = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        penalties = None
        if any(p.has_penalties for p in params):
            penalties = BatchedPenalties.build(
                params,
                [r.origin_input_ids for r in reqs],
                [r.output_ids for r in reqs],
                vocab_size,
                device,
            )
        return cls(
            temperatures=temperatures,
            top_ps=top_ps,
            top_ks=top_ks,
            min_ps=min_ps,
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            generators=[r.sampling_generator(device) for r in reqs],
            penalties=penalties,
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            need_top_k=any(
                not g and p.effective_top_k(vocab_size) < vocab_size for p, g in zip(params, greedy)
            ),
            need_top_p=any(not g and p.top_p < 1.0 for p, g in zip(params, greedy)),
            need_min_p=any(not g and p.min_p > 0.0 for p, g in zip(params, greedy)),
        )

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    def _refresh_flags(self) -> None:
        sampled = ~self.is_greedy
        self.all_greedy = not bool(sampled.any())
        self.need_top_k = bool((sampled & (self.top_ks < self.vocab_size)).any())
        self.need_top_p = bool((sampled & (self.top_ps < 1.0)).any())
        self.need_min_p = bool((sampled & (self.min_ps > 0.0)).any())

    def filter_batch(self, keep_indices: Sequence[int]) -> None:
        """Keep rows ``keep_indices`` in that order (finished requests leave the batch)."""
        keep = torch.tensor(list(keep_indices), dtype=torch.int64, device=self.temperatures.device)
        for name in ("temperatures", "top_ps", "top_ks", "min_ps", "is_greedy"):
            setattr(self, name, getattr(self, name)[keep])
        self.generators = [self.generators[i] for i in keep_indices]
        if self.penalties is not None:
            self.penalties.filter(keep)
        self._refresh_flags()

    def merge_batch(self, other: SamplingBatchInfo) -> None:
        """Append ``other``'s rows (same vocabulary) after this batch's rows."""
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"cannot merge vocab_size {other.vocab_size} into {self.vocab_size}")
        for name in ("temperatures", "top_ps", "top_ks", "min_ps", "is_greedy"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        device = self.temperatures.device
        if self.penalties is not None or other.penalties is not None:
            mine = self.penalties or BatchedPenalties.neutral(
                self.batch_size, self.vocab_size, device
            )
            theirs = other.penalties or BatchedPenalties.neutral(
                other.batch_size, self.vocab_size, device
            )
            mine.merge(theirs)
            self.penalties = mine
        self.generators = self.generators + other.generators
        self._refresh_flags()

    def copy_rows(self, rows: Sequence[int]) -> SamplingBatchInfo:
        """A new info holding only ``rows`` (this one is unchanged; penalty tensors are copied,
        generators shared). Used when only some rows of a step sample (chunked prefill)."""
        keep = torch.tensor(list(rows), dtype=torch.int64, device=self.temperatures.device)
        penalties = None
        if self.penalties is not None:
            p = self.penalties
            penalties = BatchedPenalties(
                p.frequency[keep],
                p.presence[keep],
                p.repetition[keep],
                p.output_counts[keep],
                p.seen_mask[keep],
            )
        out = SamplingBatchInfo(
            temperatures=self.temperatures[keep],
            top_ps=self.top_ps[keep],
            top_ks=self.top_ks[keep],
            min_ps=self.min_ps[keep],
            is_greedy=self.is_greedy[keep],
            generators=[self.generators[i] for i in rows],
            penalties=penalties,
            vocab_size=self.vocab_size,
            all_greedy=True,
            need_top_k=False,
            need_top_p=False,
            need_min_p=False,
        )
        out._refresh_flags()
        return out
