"""Speculative decoding with n-gram lookup (``--speculative-algorithm NGRAM``) through the
scheduler on a real tiny model: greedy output equals greedy output without speculation token
for token (alone and in a mixed batch with chunked prefill, prefix-cache hits, stop tokens,
logprobs, penalties, ``max_new_tokens`` 0 and 1, and an abort); sampled output follows the same
distribution (a chi-square test of homogeneity); every KV slot comes back."""

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

from shardline_runtime.server_args import ServerArgs, ServerArgsError


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama", 0, max_position_embeddings=2048)


NGRAM = {"speculative_algorithm": "NGRAM"}
_prompt, _assert_settled = prompt, assert_settled


def _run(ckpt, arrivals, spec: bool, **overrides):
    return run(ckpt, arrivals, NGRAM if spec else None, **overrides)


def test_greedy_single_request_equals_no_speculation(ckpt):
    rng = random.Random(1)
    arrivals = {0: [greedy("one", _prompt(rng, 12) * 3, 60)]}
    plain, _ = _run(ckpt, arrivals, spec=False)
    spec, scheduler = _run(ckpt, arrivals, spec=True)
    assert spec["one"]["ids"] == plain["one"]["ids"]
    assert scheduler.speculative.stats.accepted_tokens > 0, "some drafts were kept"
    _assert_settled(scheduler)


def test_greedy_mixed_workload_equals_no_speculation(ckpt):
    arrivals = mixed_workload()
    plain, _ = _run(ckpt, arrivals, spec=False, **MIXED_LIMITS)
    spec, scheduler = _run(ckpt, arrivals, spec=True, **MIXED_LIMITS)
    assert_mixed_workload_matches(spec, plain)
    assert scheduler.speculative.stats.verify_steps > 0
    assert scheduler.speculative.stats.accepted_tokens > 0
    _assert_settled(scheduler)


def test_verify_steps_take_fewer_target_forwards(ckpt):
    rng = random.Random(4)
    arrivals = {0: [greedy(f"r{i}", _prompt(rng, 10) * 4, 48) for i in range(3)]}
    plain, base = _run(ckpt, arrivals, spec=False)
    spec, scheduler = _run(ckpt, arrivals, spec=True)
    assert {k: v["ids"] for k, v in spec.items()} == {k: v["ids"] for k, v in plain.items()}
    runner, base_runner = scheduler.worker.model_runner, base.worker.model_runner
    assert runner.forward_pass_id < base_runner.forward_pass_id


@pytest.fixture(scope="module")
def cycle_ckpt(ckpt, tmp_path_factory):
    """The tiny model made to continue the cycle ``CYCLE`` with probability about 1/2 at
    temperature 1 (logit 6.2 against 0 for the other 511 ids), so
    n-gram drafts from a cyclic prompt are kept about half the time and rejected otherwise."""
    from shardline_runtime.tiny_checkpoint import make_cycle_checkpoint

    return make_cycle_checkpoint(ckpt, tmp_path_factory.mktemp("cycle"), CYCLE, 6.2)


@pytest.mark.slow
def test_sampled_output_follows_the_distribution_without_speculation(cycle_ckpt):
    n = 600
    a, _ = sampled_triples(cycle_ckpt, None, n, 4321)
    b, scheduler = sampled_triples(cycle_ckpt, NGRAM, n, 1234)
    stats = scheduler.speculative.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, "drafts were both kept and rejected"
    p_value, stat, dof = homogeneity_p_value(a, b)
    assert p_value > 1e-3, f"chi-square {stat:.1f} on {dof} degrees of freedom"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"speculative_algorithm": "EAGLE3"}, "--speculative-algorithm EAGLE3 is not implemented"),
        ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 2}, "--speculative-eagle-topk 2"),
        ({"speculative_algorithm": "NGRAM", "pp_size": 2}, "not supported with --pp-size > 1"),
        ({"speculative_algorithm": "NGRAM", "enable_lora": True}, "not supported with --enable-lora"),
        ({"speculative_draft_model_path": "/d"}, "--speculative-draft-model-path needs"),
        ({"speculative_algorithm": "STANDALONE"}, "STANDALONE needs --speculative-draft-model-path"),
        ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "/d"}, "is not used by"),
        (
            {"speculative_algorithm": "NGRAM", "speculative_num_steps": 2, "speculative_num_draft_tokens": 5},
            "num-draft-tokens must be num-steps \\+ 1",
        ),
    ],
)
def test_combinations_that_do_not_compose_are_refused(flags, message):
    with pytest.raises(ServerArgsError, match=message):
        ServerArgs(model_path="/m", **flags)


def test_speculation_turns_the_overlap_scheduler_off(ckpt):
    scheduler = make_scheduler(ckpt, speculative_algorithm="NGRAM")
    assert scheduler.overlap.enabled is False


def test_weight_update_with_speculation_equals_no_speculation(ckpt, tiny_checkpoint):
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput

    ckpt_b = tiny_checkpoint("llama", 1, max_position_embeddings=2048, tokenizer=False)
    rng = random.Random(3)
    old = [greedy(f"old{i}", _prompt(rng, 8) * 3, 16) for i in range(3)]
    new = greedy("new", _prompt(rng, 8) * 3, 16)
    arrivals = {0: old, 4: [UpdateWeightsFromDiskReqInput(model_path=str(ckpt_b), revision="b"), new]}
    plain, _ = _run(ckpt, arrivals, spec=False)
    spec, scheduler = _run(ckpt, arrivals, spec=True)
    assert {k: v["ids"] for k, v in spec.items()} == {k: v["ids"] for k, v in plain.items()}
    _assert_settled(scheduler)
