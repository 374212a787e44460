"""Repetition, frequency and presence penalties for a batch, kept up to date incrementally.

Semantics and order follow vLLM's ``apply_penalties`` (vllm/model_executor/layers/utils.py):
the repetition penalty first, then frequency and presence (the OpenAI API's definitions):

1. repetition (CTRL, Keskar et al. 2019): for every token seen in the prompt *or* the output,
   ``logit / penalty`` when the logit is positive, ``logit * penalty`` otherwise.
2. frequency: ``logit -= frequency_penalty * count(token in output)``
3. presence: ``logit -= presence_penalty * (count(token in output) > 0)``

The state is two (bs, vocab) tensors built once when the batch is formed, then updated with
each sampled token (:meth:`BatchedPenalties.cumulate_output_tokens`), filtered and merged with the
batch, so no step rebuilds them from Python lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardline_runtime.device_copy import to_device


class BatchedPenalties:
    """Penalty parameters and token statistics of the rows of one batch.

    Attributes:
        frequency, presence, repetition: (bs,) float32 per-row penalties.
        output_counts: (bs, vocab) float32, how often each token was generated so far.
        seen_mask: (bs, vocab) bool, token appeared in the prompt or the output.
    """

    def __init__(
        self,
        frequency: torch.Tensor,
        presence: torch.Tensor,
        repetition: torch.Tensor,
        output_counts: torch.Tensor,
        seen_mask: torch.Tensor,
    ):
        self.frequency = frequency
        self.presence = presence
        self.repetition = repetition
        self.output_counts = output_counts
        self.seen_mask = seen_mask

    @classmethod
    def build(
        cls,
        params: Sequence,
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> BatchedPenalties:
        """Build the state for ``len(params)`` rows.

        Args:
            params: one ``SamplingParams`` per row.
            prompt_ids / output_ids: token ids of each row's prompt and of what it generated so
                far (non-empty when a retracted or chunked request rejoins a batch).
            vocab_size: number of real (unpadded) vocabulary entries.
        """
        bs = len(params)
        counts = torch.zeros(bs, vocab_size, dtype=torch.float32)
        seen = torch.zeros(bs, vocab_size, dtype=torch.bool)
        for row, (prompt, output) in enumerate(zip(prompt_ids, output_ids)):
            if params[row].repetition_penalty != 1.0 and len(prompt) > 0:
                seen[row, torch.as_tensor(list(prompt), dtype=torch.int64)] = True
            if len(output) > 0:
                out = torch.as_tensor(list(output), dtype=torch.int64)
                counts[row].index_add_(0, out, torch.ones(len(out)))
                seen[row, out] = True

        def column(name: str) -> torch.Tensor:
            return to_device([getattr(p, name) for p in params], device, torch.float32)

        return cls(
            column("frequency_penalty"),
            column("presence_penalty"),
            column("repetition_penalty"),
            to_device(counts, device),
            to_device(seen, device),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Return penalised logits (bs, vocab) float32; ``logits`` is not modified."""
        rep = self.repetition[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(self.seen_mask, penalised, logits)
        counts = self.output_counts
        logits = logits - self.frequency[:, None] * counts - self.presence[:, None] * (counts > 0)
        return finite_logits(logits)

    def cumulate_output_tokens(
        self, next_token_ids: torch.Tensor, rows: torch.Tensor | None = None
    ) -> None:
        """Count freshly sampled tokens.

        Args:
            next_token_ids: (bs,) int64, one token per row (or per entry of ``rows``).
            rows: optional (n,) int64 row indices that sampled (rows of intermediate prefill
                chunks sample nothing); default all rows.
        """
        if rows is None:
            rows = torch.arange(len(next_token_ids), device=next_token_ids.device)
        self.output_counts.index_put_(
            (rows, next_token_ids),
            torch.ones_like(next_token_ids, dtype=torch.float32),
            accumulate=True,
        )
        self.seen_mask[rows, next_token_ids] = True

    def filter(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep`` ((n,) int64), in that order."""
        for name in ("frequency", "presence", "repetition", "output_counts", "seen_mask"):
            setattr(self, name, getattr(self, name)[keep])

    @classmethod
    def neutral(cls, bs: int, vocab_size: int, device) -> BatchedPenalties:
        """State for ``bs`` rows with no penalties (used when merging with a penalised batch)."""
        return cls(
            torch.zeros(bs, device=device),
            torch.zeros(bs, device=device),
            torch.ones(bs, device=device),
            torch.zeros(bs, vocab_size, device=device),
            torch.zeros(bs, vocab_size, dtype=torch.bool, device=device),
        )

    def merge(self, other: BatchedPenalties) -> None:
        """Append ``other``'s rows after this batch's rows."""
        for name in ("frequency", "presence", "repetition", "output_counts", "seen_mask"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """Map NaN to -inf and +inf to the largest float32, so softmax and argmax stay defined.

    An extreme penalty (``repetition_penalty`` 1e-300 is 0 in float32) or temperature can push
    logits to +-inf or NaN; a row holding +inf would softmax to NaN and every draw would pick
    token 0. Args: logits (bs, vocab) float32. Returns a new tensor of the same shape.
    """
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
