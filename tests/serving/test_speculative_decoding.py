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
    assert_settled,
    check_greedy_mixed,
    check_greedy_single,
    check_sampled_distribution,
    prompt,
    run,
    spec_flags,
)

from shardline_runtime.server_args import ServerArgs, ServerArgsError

NGRAM = spec_flags("NGRAM", tokens=5)


def _run(ckpt, arrivals, spec: bool, **overrides):
    return run(ckpt, arrivals, NGRAM if spec else None, **overrides)


def test_greedy_single_request_equals_no_speculation(spec_target):
    ids = prompt(random.Random(1), 12) * 3
    check_greedy_single(spec_target, NGRAM, ids, some_rejected=False)


def test_greedy_mixed_workload_equals_no_speculation(spec_target):
    check_greedy_mixed(spec_target, NGRAM)


def test_verify_steps_take_fewer_target_forwards(spec_target):
    rng = random.Random(4)
    arrivals = {0: [greedy(f"r{i}", prompt(rng, 10) * 4, 48) for i in range(3)]}
    plain, base = _run(spec_target, arrivals, spec=False)
    spec, scheduler = _run(spec_target, arrivals, spec=True)
    assert {k: v["ids"] for k, v in spec.items()} == {k: v["ids"] for k, v in plain.items()}
    runner, base_runner = scheduler.worker.model_runner, base.worker.model_runner
    assert runner.forward_pass_id < base_runner.forward_pass_id


@pytest.mark.slow
def test_sampled_output_follows_the_distribution_without_speculation(cycle_target):
    # n-gram drafts from the cyclic prompt are kept about half the time
    check_sampled_distribution(cycle_target, NGRAM)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"speculative_algorithm": "EAGLE3"}, "EAGLE3 needs --speculative-draft-model-path"),
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


def test_speculation_turns_the_overlap_scheduler_off(spec_target):
    scheduler = make_scheduler(spec_target, speculative_algorithm="NGRAM")
    assert scheduler.overlap.enabled is False


def test_weight_update_with_speculation_equals_no_speculation(spec_target, tiny_checkpoint):
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput

    ckpt_b = tiny_checkpoint("llama", 1, max_position_embeddings=2048, tokenizer=False)
    rng = random.Random(3)
    old = [greedy(f"old{i}", prompt(rng, 8) * 3, 16) for i in range(3)]
    new = greedy("new", prompt(rng, 8) * 3, 16)
    arrivals = {0: old, 4: [UpdateWeightsFromDiskReqInput(model_path=str(ckpt_b), revision="b"), new]}
    plain, _ = _run(spec_target, arrivals, spec=False)
    spec, scheduler = _run(spec_target, arrivals, spec=True)
    assert {k: v["ids"] for k, v in spec.items()} == {k: v["ids"] for k, v in plain.items()}
    assert_settled(scheduler)
