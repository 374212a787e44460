"""The proposer interface: what every speculative algorithm gives the verify step.

A proposer sees each request's tokens so far (prompt + output) and the most draft tokens it may
propose for it, and returns draft token ids per request (possibly none). Draft probabilities
are optional: a deterministic proposer (n-gram lookup, a greedy draft model) returns None, which
the acceptance rule reads as a point mass on each draft token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from shardline_runtime.speculative.spec_args import SpeculativeArgs


@dataclass
class Proposal:
    """Drafts of one step.

    Attributes:
        draft_ids: per request, its draft token ids (``len <= max_drafts[i]``; may be empty).
        draft_probs: per request, a (len(draft_ids[i]), vocab) float32 tensor of the
            distribution each draft was drawn from, or None (point masses).
    """

    draft_ids: list[list[int]]
    draft_probs: list | None = None


class Proposer(Protocol):
    """Guesses the next tokens of each request."""

    def propose(self, histories: Sequence[Sequence[int]], max_drafts: Sequence[int]) -> Proposal:
        """Drafts for each request.

        Args:
            histories: per request, its prompt + output token ids.
            max_drafts: per request, the most draft tokens to return (>= 0).
        """
        ...


def build_proposer(spec: SpeculativeArgs) -> Proposer:
    """The proposer of ``spec.speculative_algorithm``.

    Raises:
        ValueError: an algorithm without an implementation (``ServerArgs`` refuses it first).
    """
    from shardline_runtime.speculative.ngram import NgramProposer

    if spec.speculative_algorithm == "NGRAM":
        return NgramProposer(
            spec.speculative_ngram_min_match_window_size,
            spec.speculative_ngram_max_match_window_size,
        )
    raise ValueError(
        f"--speculative-algorithm {spec.speculative_algorithm} has no proposer; implemented: NGRAM"
    )
