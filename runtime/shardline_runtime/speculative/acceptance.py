"""The acceptance rule of chain verification: which draft tokens a request keeps, and the one
token the target adds after them.

For request ``i`` with drafts ``d_1..d_k`` the target scored ``k + 1`` positions: position ``j``
(0-based) holds the target's distribution ``p_j`` of the token after ``d_j`` (``d_0`` being the
last accepted token). Greedy rows keep drafts while ``d_{j+1} == argmax p_j`` and add
``argmax p_a`` at the first mismatch ``a`` (exactly the tokens plain greedy decoding gives).
Sampled rows follow speculative sampling (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling", Algorithm 2): keep ``d_{j+1}`` with
probability ``min(1, p_j(d) / q_j(d))``; at the first rejection draw from
``norm(max(p_j - q_j, 0))``; when every draft is kept draw the bonus token from ``p_k``. The
output is then distributed exactly as the target's own samples. ``q`` is the draft's
distribution; a deterministic proposer (n-gram) is a point mass, so ``d`` is kept with
probability ``p_j(d)`` and a rejection draws from ``p_j`` without ``d``.

``p`` is the distribution the sampler draws from (temperature, then top-k / top-p / min-p,
renormalised), so speculation changes no sampling parameter's meaning.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardline_runtime.layers.sampler import top_k_top_p_min_p_renorm
from shardline_runtime.sampling.penalties import finite_logits
from shardline_runtime.sampling.sampling_batch_info import SamplingBatchInfo


def target_probs(logits: torch.Tensor, info: SamplingBatchInfo, rows: torch.Tensor) -> torch.Tensor:
    """The distributions the sampler draws from, for tokens of the batch's rows ``rows``.

    Args:
        logits: (N, vocab) float32, one line per scored token.
        info: the batch's sampling parameters (``bs`` rows).
        rows: (N,) int64, the batch row of each token.

    Returns:
        (N, vocab) float32 rows summing to 1 (greedy rows hold the temperature-1 softmax; the
        caller takes their argmax instead).
    """
    logits = logits[:, : info.vocab_size]
    probs = torch.softmax(finite_logits(logits / info.temperatures[rows]), dim=-1)
    if info.need_top_k or info.need_top_p or info.need_min_p:
        probs = top_k_top_p_min_p_renorm(
            probs,
            info.top_ks[rows],
            info.top_ps[rows],
            info.min_ps[rows],
            info.need_top_k,
            info.need_top_p,
            info.need_min_p,
        )
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One id drawn from the unnormalised ``probs`` (vocab,) by the sampler's exponential race."""
    race = torch.empty_like(probs).exponential_(generator=generator)
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    return int((probs / race).argmax())


def accept_sampled(
    probs: torch.Tensor,
    draft_ids: Sequence[int],
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Speculative sampling of one request's chain (module docstring).

    Args:
        probs: (k + 1, vocab) float32, the target's distribution at each scored position.
        draft_ids: the ``k`` draft tokens.
        draft_probs: (k, vocab) float32, the distributions the drafts were drawn from, or None
            (point masses on ``draft_ids``).
        generator: the request's own generator when seeded, else the global one.

    Returns:
        the kept drafts followed by one target token (``1 <= len <= k + 1``).
    """
    k = len(draft_ids)
    device = probs.device
    drafts = torch.tensor(list(draft_ids), dtype=torch.int64, device=device)
    positions = torch.arange(k, device=device)
    p_of_draft = probs[positions, drafts]  # (k,)
    if draft_probs is None:
        keep_prob = p_of_draft
    else:
        q_of_draft = draft_probs[positions, drafts]
        keep_prob = torch.clamp(
            p_of_draft / q_of_draft.clamp(min=torch.finfo(torch.float32).tiny), max=1.0
        )
    uniform = torch.rand(k, generator=generator, device=device)
    rejected = (uniform >= keep_prob).nonzero()
    accepted = int(rejected[0]) if rejected.numel() else k
    if accepted == k:
        return list(draft_ids) + [_draw(probs[k], generator)]
    if draft_probs is None:
        residual = probs[accepted].clone()
        residual[draft_ids[accepted]] = 0.0
    else:
        residual = torch.clamp(probs[accepted] - draft_probs[accepted], min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q: a rejection has probability 0 (rounding)
        residual = probs[accepted]
    return list(draft_ids[:accepted]) + [_draw(residual, generator)]


def accept_greedy(target_ids: Sequence[int], draft_ids: Sequence[int]) -> list[int]:
    """Greedy chain acceptance: drafts kept while they equal the target's argmax, then the
    target's argmax at the first mismatch (or after the last draft).

    Args:
        target_ids: the ``k + 1`` argmax ids of the scored positions.
        draft_ids: the ``k`` draft tokens.
    """
    accepted = 0
    while accepted < len(draft_ids) and draft_ids[accepted] == target_ids[accepted]:
        accepted += 1
    return list(draft_ids[:accepted]) + [int(target_ids[accepted])]
