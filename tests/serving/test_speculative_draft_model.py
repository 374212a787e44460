"""Speculative decoding with a draft model (``--speculative-algorithm STANDALONE``) through the
scheduler on a real tiny target: greedy output equals greedy output without speculation token
for token (alone and in a mixed batch with chunked prefill, prefix-cache hits, stop tokens,
logprobs, penalties, ``max_new_tokens`` 0 and 1, and an abort); sampled output follows the
target's distribution (chi-square test of homogeneity); the draft's KV of rejected drafts is
freed, of accepted ones kept, and every slot of both pools comes back."""

from __future__ import annotations

import random

import pytest
from scheduler_harness import greedy, make_scheduler
from speculative_harness import (
    CYCLE,
    MIXED_LIMITS,
    assert_mixed_workload_matches,
    assert_settled,
    homogeneity_p_value,
    mixed_workload,
    prompt,
    run,
    sampled_triples,
)

from shardline_runtime.speculative.draft_worker import DraftModelError
from shardline_runtime.tiny_checkpoint import make_cycle_checkpoint, make_draft_checkpoint


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama", 0, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def draft(ckpt, tmp_path_factory):
    """The target with a noisy LM head: its argmax agrees with the target's often, not always."""
    return make_draft_checkpoint(ckpt, tmp_path_factory.mktemp("draft"), noise=0.6)


def _flags(draft_path, tokens: int = 4) -> dict:
    return {
        "speculative_algorithm": "STANDALONE",
        "speculative_draft_model_path": str(draft_path),
        "speculative_num_draft_tokens": tokens,
    }


def _assert_draft_settled(scheduler) -> None:
    draft = scheduler.worker.draft_worker
    assert draft.used_tokens == 0, "every draft KV slot is free"
    rows = draft.runner.req_to_token_pool
    assert rows.available_size() == rows.size, "every draft request row is free"


def test_greedy_single_request_equals_no_speculation(ckpt, draft):
    rng = random.Random(1)
    arrivals = {0: [greedy("one", prompt(rng, 30), 60)]}
    plain, _ = run(ckpt, arrivals, None)
    spec, scheduler = run(ckpt, arrivals, _flags(draft))
    stats = scheduler.speculative.stats
    assert spec["one"]["ids"] == plain["one"]["ids"]
    assert stats.accepted_tokens > 0, "some drafts were kept"
    assert stats.accepted_tokens < stats.draft_tokens, "some drafts were rejected"
    _assert_draft_settled(scheduler)


def test_greedy_mixed_workload_equals_no_speculation(ckpt, draft):
    arrivals = mixed_workload()
    plain, _ = run(ckpt, arrivals, None, **MIXED_LIMITS)
    spec, scheduler = run(ckpt, arrivals, _flags(draft), **MIXED_LIMITS)
    assert_mixed_workload_matches(spec, plain)
    assert scheduler.speculative.stats.accepted_tokens > 0
    assert_settled(scheduler)
    _assert_draft_settled(scheduler)


def test_draft_keeps_the_kv_of_accepted_tokens_and_frees_the_rejected(ckpt, draft):
    rng = random.Random(5)
    scheduler = make_scheduler(ckpt, disable_overlap_schedule=True, **_flags(draft, tokens=5))
    scheduler.run_step([greedy("r", prompt(rng, 20), 40)])
    for _ in range(6):
        scheduler.run_step([])
        req = scheduler.decode_manager.running_reqs[0]
        entry = scheduler.worker.draft_worker.entries["r"]
        history = req.origin_input_ids + req.output_ids
        assert entry.tokens == history[: len(entry.tokens)], "the draft caches only tokens the target kept"
        assert len(entry.tokens) == scheduler.worker.draft_worker.used_tokens, "no draft slot held past them"


def test_a_draft_with_another_vocabulary_is_refused(ckpt, tiny_checkpoint):
    other = tiny_checkpoint("llama", 2, vocab_size=640, tokenizer=False)
    with pytest.raises(DraftModelError, match="vocab_size 640 differs from the target's 512"):
        make_scheduler(ckpt, **_flags(other))


@pytest.fixture(scope="module")
def cycle_ckpt(ckpt, tmp_path_factory):
    """The tiny model continuing ``CYCLE`` with probability about 1/2 at temperature 1."""
    return make_cycle_checkpoint(ckpt, tmp_path_factory.mktemp("cycle"), CYCLE, 6.2)


@pytest.mark.slow
def test_sampled_output_follows_the_targets_distribution(cycle_ckpt):
    # the draft is the target itself: its argmax (the cycle) is kept about half the time
    n = 600
    a, _ = sampled_triples(cycle_ckpt, None, n, 4321)
    b, scheduler = sampled_triples(cycle_ckpt, _flags(cycle_ckpt), n, 1234)
    stats = scheduler.speculative.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, "drafts were both kept and rejected"
    p_value, stat, dof = homogeneity_p_value(a, b)
    assert p_value > 1e-3, f"chi-square {stat:.1f} on {dof} degrees of freedom"


def _update_replies(scheduler) -> list:
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqOutput

    return [m for m in scheduler.sender.socket.messages if isinstance(m, UpdateWeightsFromDiskReqOutput)]


def test_weight_update_changes_target_and_draft_together(ckpt, draft, tiny_checkpoint, tmp_path):
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput

    ckpt_b = tiny_checkpoint("llama", 1, max_position_embeddings=2048, tokenizer=False)
    draft_b = make_draft_checkpoint(ckpt_b, tmp_path / "draft_b", noise=0.6)
    rng = random.Random(3)
    new = greedy("new", prompt(rng, 20), 24)
    update = UpdateWeightsFromDiskReqInput(model_path=str(ckpt_b), revision="b", draft_model_path=str(draft_b))
    expected, _ = run(ckpt_b, {0: [new]}, None)
    spec, scheduler = run(ckpt, {0: [update], 1: [new]}, _flags(draft))
    assert _update_replies(scheduler)[0].success is True
    assert spec["new"]["ids"] == expected["new"]["ids"]
    assert scheduler.worker.draft_worker.runner.model_config.model_path == str(draft_b)
    assert scheduler.speculative.stats.accepted_tokens > 0, "the new draft agrees with the new target"


def test_a_draft_that_fails_to_load_aborts_the_targets_update(ckpt, draft, tiny_checkpoint, tmp_path):
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput

    ckpt_b = tiny_checkpoint("llama", 1, max_position_embeddings=2048, tokenizer=False)
    broken = make_draft_checkpoint(ckpt_b, tmp_path / "broken", num_layers=1)  # other shapes
    rng = random.Random(3)
    new = greedy("new", prompt(rng, 20), 24)
    update = UpdateWeightsFromDiskReqInput(model_path=str(ckpt_b), revision="b", draft_model_path=str(broken))
    expected, _ = run(ckpt, {0: [new]}, None)
    spec, scheduler = run(ckpt, {0: [update], 1: [new]}, _flags(draft))
    reply = _update_replies(scheduler)[0]
    assert reply.success is False
    assert f"draft model {broken}" in reply.message
    assert spec["new"]["ids"] == expected["new"]["ids"], "the old target still serves"
    assert scheduler.worker.model_runner.model_config.model_path == str(ckpt)
