"""The proposer interface: what every speculative algorithm gives the verify step.

A proposer sees each request's tokens so far (prompt + output), its id, and the most draft
tokens it may propose for it, and returns draft token ids per request (possibly none). Draft
probabilities are optional: a deterministic proposer (n-gram lookup, a greedy draft model)
returns None, which the acceptance rule reads as a point mass on each draft token. A proposer
that keeps per-request state (a draft model's KV) drops it in ``release``, called whenever the
scheduler gives a request's KV back (finish, abort, retraction).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from shardline_runtime.speculative.spec_args import SpeculativeArgs

if TYPE_CHECKING:
    from shardline_runtime.speculative.draft_worker import DraftWorker


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

    def propose(
        self,
        histories: Sequence[Sequence[int]],
        max_drafts: Sequence[int],
        rids: Sequence[str] = (),
        rows: Sequence[int] = (),
    ) -> Proposal:
        """Drafts for each request.

        Args:
            histories: per request, its prompt + output token ids.
            max_drafts: per request, the most draft tokens to return (>= 0).
            rids: per request, its id (what stateful proposers key their state by).
            rows: per request, its target request-pool row (where EAGLE's features were
                captured); empty when unknown.
        """
        ...

    def keep(self, rid: str, tokens: Sequence[int]) -> None:
        """After a verify step: ``tokens`` (prompt + output) is what request ``rid`` kept; state
        past their common prefix (rejected drafts) is dropped now."""
        ...

    def release(self, rid: str, row: int | None = None) -> None:
        """Drop request ``rid``'s state (no-op for an unknown id); ``row``: the target row it
        held (None: none)."""
        ...


class DraftModelProposer:
    """A draft model's proposer (STANDALONE, EAGLE, EAGLE3): the rank's :class:`DraftWorker`
    (EAGLE: its ``EagleWorker`` subclass; EAGLE3: ``Eagle3Worker``)."""

    def __init__(self, draft: DraftWorker):
        self.draft = draft

    def propose(
        self,
        histories: Sequence[Sequence[int]],
        max_drafts: Sequence[int],
        rids: Sequence[str] = (),
        rows: Sequence[int] = (),
    ) -> Proposal:
        return self.draft.propose(rids, histories, max_drafts, rows)

    def keep(self, rid: str, tokens: Sequence[int]) -> None:
        self.draft.keep(rid, tokens)

    def release(self, rid: str, row: int | None = None) -> None:
        self.draft.release(rid, row)


def build_proposer(spec: SpeculativeArgs, draft: DraftWorker | None = None) -> Proposer:
    """The proposer of ``spec.speculative_algorithm``.

    Args:
        draft: the worker's draft model (STANDALONE, EAGLE).

    Raises:
        ValueError: an algorithm without an implementation (``ServerArgs`` refuses it first),
            or STANDALONE / EAGLE without a draft worker.
    """
    from shardline_runtime.speculative.ngram import NgramProposer

    algo = spec.speculative_algorithm
    if algo == "NGRAM":
        return NgramProposer(
            spec.speculative_ngram_min_match_window_size,
            spec.speculative_ngram_max_match_window_size,
        )
    if algo in ("STANDALONE", "EAGLE", "EAGLE3") and draft is not None:
        return DraftModelProposer(draft)
    raise ValueError(
        f"--speculative-algorithm {algo} has no proposer here; implemented: NGRAM, STANDALONE, "
        "EAGLE and EAGLE3 (with the worker's draft model)"
    )
