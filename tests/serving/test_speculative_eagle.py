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
from shardline_runtime.speculative.eagle_checkpoint import (
    make_cycle_eagle_checkpoint,
    make_eagle_checkpoint,
)
from shardline_runtime.tiny_checkpoint import make_cycle_checkpoint


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama", 0, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def cycle_ckpt(ckpt, tmp_path_factory):
    """The tiny model continuing ``CYCLE`` (greedy: always; temperature 1: about half)."""
    return make_cycle_checkpoint(ckpt, tmp_path_factory.mktemp("cycle"), CYCLE, 6.2)


@pytest.fixture(scope="module")
def head(cycle_ckpt, tmp_path_factory):
    """Reads the target's features; wrong after ``CYCLE[2]`` (some drafts are rejected)."""
    return make_cycle_eagle_checkpoint(cycle_ckpt, tmp_path_factory.mktemp("head"), CYCLE, wrong_after=2)


def _flags(head_path, tokens: int = 4) -> dict:
    return {
        "speculative_algorithm": "EAGLE",
        "speculative_draft_model_path": str(head_path),
        "speculative_num_draft_tokens": tokens,
    }


def _assert_head_settled(scheduler) -> None:
    head = scheduler.worker.draft_worker
    assert head.used_tokens == 0, "every head KV slot is free"
    rows = head.runner.req_to_token_pool
    assert rows.available_size() == rows.size, "every head request row is free"


def test_greedy_single_request_equals_no_speculation(cycle_ckpt, head):
    rng = random.Random(1)
    arrivals = {0: [greedy("one", prompt(rng, 30), 60)]}
    plain, _ = run(cycle_ckpt, arrivals, None)
    spec, scheduler = run(cycle_ckpt, arrivals, _flags(head))
    stats = scheduler.speculative.stats
    assert spec["one"]["ids"] == plain["one"]["ids"]
    assert stats.accepted_tokens > 0, "some drafts were kept"
    assert stats.accepted_tokens < stats.draft_tokens, "some drafts were rejected"
    _assert_head_settled(scheduler)


def test_greedy_mixed_workload_equals_no_speculation(cycle_ckpt, head):
    arrivals = mixed_workload()
    plain, _ = run(cycle_ckpt, arrivals, None, **MIXED_LIMITS)
    spec, scheduler = run(cycle_ckpt, arrivals, _flags(head), **MIXED_LIMITS)
    assert_mixed_workload_matches(spec, plain)
    assert scheduler.speculative.stats.accepted_tokens > 0
    assert_settled(scheduler)
    _assert_head_settled(scheduler)


def test_greedy_with_a_random_head_on_a_random_target_equals_no_speculation(ckpt, tmp_path):
    arrivals = mixed_workload()
    random_head = make_eagle_checkpoint(ckpt, tmp_path / "random_head", seed=3)
    plain, _ = run(ckpt, arrivals, None, **MIXED_LIMITS)
    spec, scheduler = run(ckpt, arrivals, _flags(random_head), **MIXED_LIMITS)
    assert_mixed_workload_matches(spec, plain)
    assert scheduler.speculative.stats.verify_steps > 0
    _assert_head_settled(scheduler)


@pytest.mark.parametrize("read", ["features", "embedding"])
def test_a_head_that_predicts_the_next_feature_has_its_chains_accepted(cycle_ckpt, tmp_path, read):
    perfect = make_cycle_eagle_checkpoint(cycle_ckpt, tmp_path / read, CYCLE, read=read)
    arrivals = {0: [greedy("one", CYCLE * 3, 80)]}
    _, scheduler = run(cycle_ckpt, arrivals, _flags(perfect, tokens=5))
    stats = scheduler.speculative.stats
    assert stats.accepted_tokens == stats.draft_tokens, "every draft of the chain was kept"
    assert stats.mean_accepted_length > 4.5


def test_head_kv_from_predicted_features_is_dropped_after_each_step(cycle_ckpt, head):
    scheduler = make_scheduler(cycle_ckpt, disable_overlap_schedule=True, **_flags(head, tokens=5))
    scheduler.run_step([greedy("r", CYCLE * 3, 40)])
    worker = scheduler.worker.draft_worker
    for _ in range(6):
        scheduler.run_step([])
        req = scheduler.decode_manager.running_reqs[0]
        history = req.origin_input_ids + req.output_ids
        entry = worker.entries["r"]
        assert entry.tokens == history[1 : 1 + len(entry.tokens)], "the head holds kept tokens only"
        assert len(entry.tokens) == worker.used_tokens, "no head slot held past them"


def test_a_causal_lm_is_refused_as_an_eagle_head(ckpt):
    with pytest.raises(DraftModelError, match="--speculative-algorithm EAGLE needs 'LlamaForCausalLMEagle'"):
        make_scheduler(ckpt, **_flags(ckpt))


def test_an_eagle_head_is_refused_as_a_standalone_draft(ckpt, head):
    flags = {**_flags(head), "speculative_algorithm": "STANDALONE"}
    with pytest.raises(DraftModelError, match="is an EAGLE head"):
        make_scheduler(ckpt, **flags)


def test_a_head_of_another_hidden_size_is_refused(ckpt, tiny_checkpoint, tmp_path):
    wide = tiny_checkpoint("llama", 2, hidden_size=96, tokenizer=False)
    with pytest.raises(DraftModelError, match="hidden_size 96 differs from the target's 64"):
        make_scheduler(ckpt, **_flags(make_eagle_checkpoint(wide, tmp_path / "wide")))


@pytest.mark.slow
def test_sampled_output_follows_the_targets_distribution(cycle_ckpt, tmp_path):
    perfect = make_cycle_eagle_checkpoint(cycle_ckpt, tmp_path / "perfect", CYCLE)
    n = 600
    a, _ = sampled_triples(cycle_ckpt, None, n, 4321)
    b, scheduler = sampled_triples(cycle_ckpt, _flags(perfect), n, 1234)
    stats = scheduler.speculative.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, "drafts were both kept and rejected"
    p_value, stat, dof = homogeneity_p_value(a, b)
    assert p_value > 1e-3, f"chi-square {stat:.1f} on {dof} degrees of freedom"


def _update_replies(scheduler) -> list:
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqOutput

    return [m for m in scheduler.sender.socket.messages if isinstance(m, UpdateWeightsFromDiskReqOutput)]


def test_weight_update_changes_target_and_head_together(ckpt, cycle_ckpt, tmp_path):
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput

    random_head = make_eagle_checkpoint(ckpt, tmp_path / "random_head")
    perfect = make_cycle_eagle_checkpoint(cycle_ckpt, tmp_path / "perfect", CYCLE)
    new = greedy("new", CYCLE * 3, 24)
    update = UpdateWeightsFromDiskReqInput(model_path=str(cycle_ckpt), revision="b", draft_model_path=str(perfect))
    expected, _ = run(cycle_ckpt, {0: [new]}, None)
    spec, scheduler = run(ckpt, {0: [update], 1: [new]}, _flags(random_head))
    assert _update_replies(scheduler)[0].success is True
    assert spec["new"]["ids"] == expected["new"]["ids"]
    assert scheduler.worker.draft_worker.runner.model_config.model_path == str(perfect)
    stats = scheduler.speculative.stats
    assert stats.accepted_tokens == stats.draft_tokens, "the new head agrees with the new target"


def test_a_head_that_fails_to_load_aborts_the_targets_update(ckpt, cycle_ckpt, tmp_path, tiny_checkpoint):
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput

    random_head = make_eagle_checkpoint(ckpt, tmp_path / "random_head")
    wide = tiny_checkpoint("llama", 2, hidden_size=96, tokenizer=False)
    broken = make_eagle_checkpoint(wide, tmp_path / "broken")  # other shapes
    new = greedy("new", prompt(random.Random(3), 20), 24)
    update = UpdateWeightsFromDiskReqInput(model_path=str(cycle_ckpt), revision="b", draft_model_path=str(broken))
    expected, _ = run(ckpt, {0: [new]}, None)
    spec, scheduler = run(ckpt, {0: [update], 1: [new]}, _flags(random_head))
    reply = _update_replies(scheduler)[0]
    assert reply.success is False
    assert f"draft model {broken}" in reply.message
    assert spec["new"]["ids"] == expected["new"]["ids"], "the old target still serves"
    assert scheduler.worker.model_runner.model_config.model_path == str(ckpt)
