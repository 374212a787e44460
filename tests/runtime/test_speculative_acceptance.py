"""The acceptance rule of speculative decoding, on tensors: greedy chains give the target's own
argmax tokens; speculative sampling (Leviathan et al. 2023 / Chen et al. 2023) gives tokens
distributed as the target's, whatever the drafts (chi-square goodness of fit); n-gram lookup."""

from __future__ import annotations

import pytest
import torch

from shardline_runtime.speculative.acceptance import accept_greedy, accept_sampled
from shardline_runtime.speculative.ngram import NgramProposer, ngram_lookup


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value of ``counts`` against ``probs`` (cells with p > 0)."""
    support = probs > 0
    assert int(counts[~support].sum()) == 0, "a token outside the target's support was drawn"
    n = counts.sum()
    expected = probs[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def test_greedy_keeps_drafts_while_they_match_the_argmax():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]


def test_greedy_adds_the_bonus_token_after_a_fully_accepted_chain():
    assert accept_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]


def test_greedy_without_drafts_is_the_argmax():
    assert accept_greedy([3], []) == [3]


P0 = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])  # the target after the last token
P1 = torch.tensor([0.1, 0.1, 0.3, 0.3, 0.2])  # the target after draft token 0


@pytest.mark.parametrize("draft", [0, 1, 3, 4])
def test_first_token_follows_the_target_whatever_the_point_mass_draft(draft):
    torch.manual_seed(1)
    probs = torch.stack([P0, P1])
    counts = torch.zeros(5)
    for _ in range(6000):
        counts[accept_sampled(probs, [draft])[0]] += 1
    assert chi_square_p_value(counts, P0) > 1e-3


def test_second_token_follows_the_target_after_an_accepted_draft():
    torch.manual_seed(2)
    probs = torch.stack([P0, P1])
    counts = torch.zeros(5)
    for _ in range(12000):
        kept = accept_sampled(probs, [0])
        if kept[0] == 0:
            counts[kept[1]] += 1
    assert chi_square_p_value(counts, P1) > 1e-3


def test_first_token_follows_the_target_with_a_draft_distribution():
    torch.manual_seed(3)
    q = torch.tensor([0.1, 0.6, 0.1, 0.1, 0.1])
    probs = torch.stack([P0, P1])
    draft_gen = torch.Generator().manual_seed(4)
    counts = torch.zeros(5)
    for _ in range(6000):
        draft = int(torch.multinomial(q, 1, generator=draft_gen))
        counts[accept_sampled(probs, [draft], q[None, :])[0]] += 1
    assert chi_square_p_value(counts, P0) > 1e-3


def test_a_draft_with_target_probability_zero_is_never_kept():
    probs = torch.stack([P0, P1])
    kept = {accept_sampled(probs, [4])[0] for _ in range(200)}
    assert 4 not in kept


def test_a_draft_the_target_is_sure_of_is_always_kept():
    sure = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])
    probs = torch.stack([sure, P1])
    assert all(len(accept_sampled(probs, [2])) == 2 for _ in range(100))


def test_a_seeded_generator_repeats_its_choices():
    probs = torch.stack([P0, P1])
    a = [accept_sampled(probs, [1], generator=torch.Generator().manual_seed(7)) for _ in range(5)]
    b = [accept_sampled(probs, [1], generator=torch.Generator().manual_seed(7)) for _ in range(5)]
    assert a == b


def test_ngram_proposes_what_followed_the_longest_earlier_suffix():
    assert ngram_lookup([1, 2, 3, 4, 9, 2, 3, 4, 1, 2, 3], 2, 1, 12) == [4, 9]


def test_ngram_prefers_the_most_recent_match_of_equal_length():
    assert ngram_lookup([7, 1, 8, 7, 1, 5, 7], 2, 1, 12) == [1, 5]


def test_ngram_proposes_nothing_below_the_minimum_window():
    assert ngram_lookup([1, 2, 3, 9, 3], 2, 2, 12) == []


def test_ngram_proposes_at_most_max_drafts():
    assert len(ngram_lookup([1, 2, 3, 4, 5, 6, 1], 3, 1, 12)) == 3


def test_ngram_proposer_respects_each_requests_budget():
    proposal = NgramProposer(1, 4).propose([[1, 2, 1], [1, 2, 3, 1]], [0, 2])
    assert proposal.draft_ids == [[], [2, 3]]
