"""Sampling parameters of a whole batch as tensors, prepared once per batch.

Built when a ``ScheduleBatch`` is formed, then filtered / merged together with it; the sampler
reads it every step without touching Python lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shardline_runtime.device_copy import to_device
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
        all_greedy / need_top_k / need_top_p / need_min_p: batch flags the sampler branches on.
        row_needs: per row, on the host, ``(sampled, top_k, top_p, min_p)``: whether the row
            samples and which filters it needs; the batch flags are computed from these when
            rows leave or join (reading the device tensors would wait for the step in flight).
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
    row_needs: list[tuple[bool, bool, bool, bool]] = field(default_factory=list)

    @classmethod
    def from_reqs(
        cls, reqs: Sequence, vocab_size: int, device: torch.device | str
    ) -> SamplingBatchInfo:
        """Build from requests that have ``sampling_params``, ``origin_input_ids``,
        ``output_ids`` and a ``sampling_generator(device)`` method (see ``managers.schedule_batch.Req``).
        """
        params: list[SamplingParams] = [r.sampling_params for r in reqs]
        greedy = [p.is_greedy for p in params]
        temperatures = to_device(
            [[1.0 if g else p.temperature] for p, g in zip(params, greedy)], device, torch.float32
        )
        top_k_values = [p.effective_top_k(vocab_size) for p in params]
        top_ks = to_device(top_k_values, device, torch.int64)
        top_ps = to_device([p.top_p for p in params], device, torch.float32)
        min_ps = to_device([p.min_p for p in params], device, torch.float32)
        row_needs = [
            (not g, not g and k < vocab_size, not g and p.top_p < 1.0, not g and p.min_p > 0.0)
            for p, g, k in zip(params, greedy, top_k_values)
        ]
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
            is_greedy=to_device(greedy, device, torch.bool),
            generators=[r.sampling_generator(device) for r in reqs],
            penalties=penalties,
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            need_top_k=any(n[1] for n in row_needs),
            need_top_p=any(n[2] for n in row_needs),
            need_min_p=any(n[3] for n in row_needs),
            row_needs=row_needs,
        )

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    def _refresh_flags(self) -> None:
        needs = self.row_needs
        self.all_greedy = not any(n[0] for n in needs)
        self.need_top_k = any(n[1] for n in needs)
        self.need_top_p = any(n[2] for n in needs)
        self.need_min_p = any(n[3] for n in needs)

    def filter_batch(self, keep_indices: Sequence[int]) -> None:
        """Keep rows ``keep_indices`` in that order (finished requests leave the batch)."""
        keep_list = list(keep_indices)
        keep = to_device(keep_list, self.temperatures.device, torch.int64)
        for name in ("temperatures", "top_ps", "top_ks", "min_ps", "is_greedy"):
            setattr(self, name, getattr(self, name)[keep])
        self.generators = [self.generators[i] for i in keep_list]
        self.row_needs = [self.row_needs[i] for i in keep_list]
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
        self.row_needs = self.row_needs + other.row_needs
        self._refresh_flags()

    def copy_rows(self, rows: Sequence[int]) -> SamplingBatchInfo:
        """A new info holding only ``rows`` (this one is unchanged; penalty tensors are copied,
        generators shared). Used when only some rows of a step sample (chunked prefill)."""
        rows = list(rows)
        keep = to_device(rows, self.temperatures.device, torch.int64)
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
            row_needs=[self.row_needs[i] for i in rows],
        )
        out._refresh_flags()
        return out
