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
    check_greedy_mixed,
    check_greedy_single,
    check_sampled_distribution,
    prompt,
    run,
    spec_flags,
    update_replies,
)

from shardline_runtime.speculative.draft_worker import DraftModelError
from shardline_runtime.tiny_checkpoint import make_draft_checkpoint


@pytest.fixture(scope="module")
def draft(spec_target, tmp_path_factory):
    """The target with a noisy LM head: its argmax agrees with the target's often, not always."""
    return make_draft_checkpoint(spec_target, tmp_path_factory.mktemp("draft"), noise=0.6)


def _flags(draft_path, tokens: int = 4) -> dict:
    return spec_flags("STANDALONE", draft_path, tokens)


def test_greedy_single_request_equals_no_speculation(spec_target, draft):
    check_greedy_single(spec_target, _flags(draft))


def test_greedy_mixed_workload_equals_no_speculation(spec_target, draft):
    check_greedy_mixed(spec_target, _flags(draft))


def test_draft_keeps_the_kv_of_accepted_tokens_and_frees_the_rejected(spec_target, draft):
    rng = random.Random(5)
    scheduler = make_scheduler(spec_target, disable_overlap_schedule=True, **_flags(draft, tokens=5))
    scheduler.run_step([greedy("r", prompt(rng, 20), 40)])
    for _ in range(6):
        scheduler.run_step([])
        req = scheduler.decode_manager.running_reqs[0]
        entry = scheduler.worker.draft_worker.entries["r"]
        history = req.origin_input_ids + req.output_ids
        assert entry.tokens == history[: len(entry.tokens)], "the draft caches only tokens the target kept"
        assert len(entry.tokens) == scheduler.worker.draft_worker.used_tokens, "no draft slot held past them"


def test_a_draft_with_another_vocabulary_is_refused(spec_target, tiny_checkpoint):
    other = tiny_checkpoint("llama", 2, vocab_size=640, tokenizer=False)
    with pytest.raises(DraftModelError, match="vocab_size 640 differs from the target's 512"):
        make_scheduler(spec_target, **_flags(other))


@pytest.mark.slow
def test_sampled_output_follows_the_targets_distribution(cycle_target):
    # the draft is the target itself: its argmax (the cycle) is kept about half the time
    check_sampled_distribution(cycle_target, _flags(cycle_target))


def test_weight_update_changes_target_and_draft_together(spec_target, draft, tiny_checkpoint, tmp_path):
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput

    ckpt_b = tiny_checkpoint("llama", 1, max_position_embeddings=2048, tokenizer=False)
    draft_b = make_draft_checkpoint(ckpt_b, tmp_path / "draft_b", noise=0.6)
    rng = random.Random(3)
    new = greedy("new", prompt(rng, 20), 24)
    update = UpdateWeightsFromDiskReqInput(model_path=str(ckpt_b), revision="b", draft_model_path=str(draft_b))
    expected, _ = run(ckpt_b, {0: [new]}, None)
    spec, scheduler = run(spec_target, {0: [update], 1: [new]}, _flags(draft))
    assert update_replies(scheduler)[0].success is True
    assert spec["new"]["ids"] == expected["new"]["ids"]
    assert scheduler.worker.draft_worker.runner.model_config.model_path == str(draft_b)
    assert scheduler.speculative.stats.accepted_tokens > 0, "the new draft agrees with the new target"


def test_a_draft_that_fails_to_load_aborts_the_targets_update(spec_target, draft, tiny_checkpoint, tmp_path):
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput

    ckpt_b = tiny_checkpoint("llama", 1, max_position_embeddings=2048, tokenizer=False)
    broken = make_draft_checkpoint(ckpt_b, tmp_path / "broken", num_layers=1)  # other shapes
    rng = random.Random(3)
    new = greedy("new", prompt(rng, 20), 24)
    update = UpdateWeightsFromDiskReqInput(model_path=str(ckpt_b), revision="b", draft_model_path=str(broken))
    expected, _ = run(spec_target, {0: [new]}, None)
    spec, scheduler = run(spec_target, {0: [update], 1: [new]}, _flags(draft))
    reply = update_replies(scheduler)[0]
    assert reply.success is False
    assert f"draft model {broken}" in reply.message
    assert spec["new"]["ids"] == expected["new"]["ids"], "the old target still serves"
    assert scheduler.worker.model_runner.model_config.model_path == str(spec_target)
