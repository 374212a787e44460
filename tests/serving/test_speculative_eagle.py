"""Speculative decoding with an EAGLE head (``--speculative-algorithm EAGLE``) through the
scheduler on a real tiny target and tiny EAGLE checkpoints written in the public format: greedy
output equals greedy output without speculation token for token (alone and in the mixed
batch); a head that reads only the target's features drafts the cycle the target continues
(the features reach the head at the right positions, and the chain feeds its own back); the
head's KV from predicted features is dropped after each step; sampled output follows the
target's distribution; target and head update together or not at all; bad heads are refused."""

from __future__ import annotations

import random

import pytest
from scheduler_harness import greedy, make_scheduler
from speculative_harness import (
    CYCLE,
    check_greedy_mixed,
    check_greedy_single,
    check_sampled_distribution,
    prompt,
    run,
    spec_flags,
    update_replies,
)

from shardline_runtime.speculative.draft_worker import DraftModelError
from shardline_runtime.speculative.eagle_checkpoint import (
    make_cycle_eagle_checkpoint,
    make_eagle_checkpoint,
)


@pytest.fixture(scope="module")
def head(cycle_target, tmp_path_factory):
    """Reads the target's features; wrong after ``CYCLE[2]`` (some drafts are rejected)."""
    return make_cycle_eagle_checkpoint(cycle_target, tmp_path_factory.mktemp("head"), CYCLE, wrong_after=2)


def _flags(head_path, tokens: int = 4) -> dict:
    return spec_flags("EAGLE", head_path, tokens)


def test_greedy_single_request_equals_no_speculation(cycle_target, head):
    check_greedy_single(cycle_target, _flags(head))


def test_greedy_mixed_workload_equals_no_speculation(cycle_target, head):
    check_greedy_mixed(cycle_target, _flags(head))


def test_greedy_with_a_random_head_on_a_random_target_equals_no_speculation(spec_target, tmp_path):
    random_head = make_eagle_checkpoint(spec_target, tmp_path / "random_head", seed=3)
    check_greedy_mixed(spec_target, _flags(random_head), some_accepted=False)


@pytest.mark.parametrize("read", ["features", "embedding"])
def test_a_head_that_predicts_the_next_feature_has_its_chains_accepted(cycle_target, tmp_path, read):
    perfect = make_cycle_eagle_checkpoint(cycle_target, tmp_path / read, CYCLE, read=read)
    arrivals = {0: [greedy("one", CYCLE * 3, 80)]}
    _, scheduler = run(cycle_target, arrivals, _flags(perfect, tokens=5))
    stats = scheduler.speculative.stats
    assert stats.accepted_tokens == stats.draft_tokens, "every draft of the chain was kept"
    assert stats.mean_accepted_length > 4.5


def test_head_kv_from_predicted_features_is_dropped_after_each_step(cycle_target, head):
    scheduler = make_scheduler(cycle_target, disable_overlap_schedule=True, **_flags(head, tokens=5))
    scheduler.run_step([greedy("r", CYCLE * 3, 40)])
    worker = scheduler.worker.draft_worker
    for _ in range(6):
        scheduler.run_step([])
        req = scheduler.decode_manager.running_reqs[0]
        history = req.origin_input_ids + req.output_ids
        entry = worker.entries["r"]
        assert entry.tokens == history[1 : 1 + len(entry.tokens)], "the head holds kept tokens only"
        assert len(entry.tokens) == worker.used_tokens, "no head slot held past them"


def test_a_causal_lm_is_refused_as_an_eagle_head(spec_target):
    with pytest.raises(DraftModelError, match="--speculative-algorithm EAGLE needs 'LlamaForCausalLMEagle'"):
        make_scheduler(spec_target, **_flags(spec_target))


def test_an_eagle_head_is_refused_as_a_standalone_draft(spec_target, head):
    flags = {**_flags(head), "speculative_algorithm": "STANDALONE"}
    with pytest.raises(DraftModelError, match="is an EAGLE head"):
        make_scheduler(spec_target, **flags)


def test_a_head_of_another_hidden_size_is_refused(spec_target, tiny_checkpoint, tmp_path):
    wide = tiny_checkpoint("llama", 2, hidden_size=96, tokenizer=False)
    with pytest.raises(DraftModelError, match="hidden_size 96 differs from the target's 64"):
        make_scheduler(spec_target, **_flags(make_eagle_checkpoint(wide, tmp_path / "wide")))


@pytest.mark.slow
def test_sampled_output_follows_the_targets_distribution(cycle_target, tmp_path):
    perfect = make_cycle_eagle_checkpoint(cycle_target, tmp_path / "perfect", CYCLE)
    check_sampled_distribution(cycle_target, _flags(perfect))


def test_weight_update_changes_target_and_head_together(spec_target, cycle_target, tmp_path):
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput

    random_head = make_eagle_checkpoint(spec_target, tmp_path / "random_head")
    perfect = make_cycle_eagle_checkpoint(cycle_target, tmp_path / "perfect", CYCLE)
    new = greedy("new", CYCLE * 3, 24)
    update = UpdateWeightsFromDiskReqInput(model_path=str(cycle_target), revision="b", draft_model_path=str(perfect))
    expected, _ = run(cycle_target, {0: [new]}, None)
    spec, scheduler = run(spec_target, {0: [update], 1: [new]}, _flags(random_head))
    assert update_replies(scheduler)[0].success is True
    assert spec["new"]["ids"] == expected["new"]["ids"]
    assert scheduler.worker.draft_worker.runner.model_config.model_path == str(perfect)
    stats = scheduler.speculative.stats
    assert stats.accepted_tokens == stats.draft_tokens, "the new head agrees with the new target"


def test_a_head_that_fails_to_load_aborts_the_targets_update(spec_target, cycle_target, tmp_path, tiny_checkpoint):
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput

    random_head = make_eagle_checkpoint(spec_target, tmp_path / "random_head")
    wide = tiny_checkpoint("llama", 2, hidden_size=96, tokenizer=False)
    broken = make_eagle_checkpoint(wide, tmp_path / "broken")  # other shapes
    new = greedy("new", prompt(random.Random(3), 20), 24)
    update = UpdateWeightsFromDiskReqInput(model_path=str(cycle_target), revision="b", draft_model_path=str(broken))
    expected, _ = run(spec_target, {0: [new]}, None)
    spec, scheduler = run(spec_target, {0: [update], 1: [new]}, _flags(random_head))
    reply = update_replies(scheduler)[0]
    assert reply.success is False
    assert f"draft model {broken}" in reply.message
    assert spec["new"]["ids"] == expected["new"]["ids"], "the old target still serves"
    assert scheduler.worker.model_runner.model_config.model_path == str(spec_target)
