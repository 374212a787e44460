"""N-gram lookup (prompt lookup decoding): drafts copied from the request's own tokens.

The last ``n`` tokens of a request (``n`` from ``max_window`` down to ``min_window``) are looked
up earlier in its prompt + output; at the most recent earlier occurrence, the tokens that
followed it are the draft. Code edits, summaries and repeated structures quote their input, so
the guess is often right and costs no model (Saxena 2023, "Prompt Lookup Decoding"; SGLang's and
vLLM's ``ngram`` proposer).
"""

from __future__ import annotations

from collections.abc import Sequence

from shardline_runtime.speculative.proposer import Proposal


def ngram_lookup(
    tokens: Sequence[int], max_drafts: int, min_window: int, max_window: int
) -> list[int]:
    """The draft after the longest suffix of ``tokens`` that occurs earlier.

    Args:
        tokens: the request's prompt + output ids.
        max_drafts: the most draft tokens to return.
        min_window / max_window: suffix lengths (tokens) tried, longest first.

    Returns:
        up to ``max_drafts`` ids following the most recent earlier occurrence of the longest
        matching suffix; empty when no suffix of ``min_window`` tokens or more recurs.
    """
    seq, n_tokens = list(tokens), len(tokens)
    if max_drafts <= 0 or n_tokens < 2:
        return []
    last = seq[-1]
    best_len, best_end = 0, -1
    # candidate match ends: earlier positions holding the last token, most recent first
    for end in range(n_tokens - 2, -1, -1):
        if seq[end] != last:
            continue
        length = 1
        while (
            length < max_window
            and end - length >= 0
            and seq[end - length] == seq[n_tokens - 1 - length]
        ):
            length += 1
        if length > best_len:
            best_len, best_end = length, end
            if length == max_window:
                break
    if best_len < min_window:
        return []
    return seq[best_end + 1 : best_end + 1 + max_drafts]


class NgramProposer:
    """Prompt-lookup proposer (no model, runs on the host).

    Args:
        min_window / max_window: the n-gram lengths looked up, in tokens.
    """

    def __init__(self, min_window: int = 1, max_window: int = 12):
        self.min_window = min_window
        self.max_window = max_window

    def propose(
        self,
        histories: Sequence[Sequence[int]],
        max_drafts: Sequence[int],
        rids: Sequence[str] = (),
        rows: Sequence[int] = (),
    ) -> Proposal:
        """Drafts per request (:func:`ngram_lookup`); no draft probabilities (point masses)."""
        return Proposal(
            [
                ngram_lookup(tokens, k, self.min_window, self.max_window)
                for tokens, k in zip(histories, max_drafts)
            ]
        )

    def keep(self, rid: str, tokens: Sequence[int]) -> None:
        """Nothing to drop: the lookup keeps no state between steps."""

    def release(self, rid: str, row: int | None = None) -> None:
        """Nothing to drop: the lookup keeps no state between steps."""
