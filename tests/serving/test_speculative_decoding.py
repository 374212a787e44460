"""Speculative decoding with n-gram lookup (``--speculative-algorithm NGRAM``) through the
scheduler on a real tiny model: greedy output equals greedy output without speculation token
for token (alone and in a mixed batch with chunked prefill, prefix-cache hits, stop tokens,
logprobs, penalties, ``max_new_tokens`` 0 and 1, and an abort); sampled output follows the same
distribution (a chi-square test of homogeneity); every KV slot comes back."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from scheduler_harness import greedy, make_scheduler, run_loop

from shardline_runtime.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from shardline_runtime.sampling.sampling_params import SamplingParams
from shardline_runtime.server_args import ServerArgs, ServerArgsError


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama", 0, max_position_embeddings=2048)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 500) for _ in range(n)]


def _assert_settled(scheduler) -> None:
    assert scheduler.cache.used_tokens() == 0, "every KV slot is free or in the prefix cache"
    rows = scheduler.cache.req_to_token_pool
    assert rows.available_size() == rows.size, "every request row is free"


def _run(ckpt, arrivals, spec: bool, **overrides):
    extra = {"speculative_algorithm": "NGRAM"} if spec else {}
    scheduler = make_scheduler(ckpt, disable_overlap_schedule=True, **extra, **overrides)
    return run_loop(scheduler, arrivals), scheduler


def test_greedy_single_request_equals_no_speculation(ckpt):
    rng = random.Random(1)
    arrivals = {0: [greedy("one", _prompt(rng, 12) * 3, 60)]}
    plain, _ = _run(ckpt, arrivals, spec=False)
    spec, scheduler = _run(ckpt, arrivals, spec=True)
    assert spec["one"]["ids"] == plain["one"]["ids"]
    assert scheduler.speculative.stats.accepted_tokens > 0, "some drafts were kept"
    _assert_settled(scheduler)


def test_greedy_mixed_workload_equals_no_speculation(ckpt):
    rng = random.Random(0)
    shared = _prompt(rng, 90)
    first = [greedy(f"a{i}", _prompt(rng, rng.randint(3, 150)), rng.randint(1, 24)) for i in range(6)]
    first.append(greedy("prefill_only", _prompt(rng, 20), 0))
    first.append(greedy("logprobs", _prompt(rng, 150), 24, return_logprob=True, top_logprobs_num=2, logprob_start_len=5))
    first.append(greedy("shared0", shared + [7, 8], 30))
    stop_params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=tuple(range(5, 500, 3)))
    penalty = SamplingParams(max_new_tokens=20, temperature=0.0, frequency_penalty=1.5)
    arrivals = {
        0: first,
        2: [
            greedy("late", _prompt(rng, 200), 30),
            TokenizedGenerateReqInput(rid="stops", input_ids=_prompt(rng, 12), sampling_params=stop_params),
            TokenizedGenerateReqInput(rid="penalty", input_ids=_prompt(rng, 12) * 2, sampling_params=penalty),
        ],
        4: [greedy("long", _prompt(rng, 40), 300)],
        30: [AbortReq("long")],
        50: [greedy("shared1", shared + [9, 10, 11], 30)],
    }
    plain, _ = _run(ckpt, arrivals, spec=False, chunked_prefill_size=64, max_prefill_tokens=256)
    spec, scheduler = _run(ckpt, arrivals, spec=True, chunked_prefill_size=64, max_prefill_tokens=256)
    assert spec.keys() == plain.keys()
    for rid in plain:
        if rid == "long":
            continue
        assert spec[rid]["ids"] == plain[rid]["ids"], f"{rid}: greedy tokens differ with speculation"
        assert spec[rid]["finish"] == plain[rid]["finish"], rid
    assert spec["logprobs"]["logprobs"] == pytest.approx(plain["logprobs"]["logprobs"], abs=1e-4)
    assert spec["shared1"]["cached"] > 0, "the prefix cache still serves prefixes"
    assert spec["long"]["finish"]["type"] == "abort"
    assert plain["long"]["ids"][: len(spec["long"]["ids"])] == spec["long"]["ids"]
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


CYCLE = [11, 12, 13, 14, 15, 16]


@pytest.fixture(scope="module")
def cycle_ckpt(ckpt, tmp_path_factory):
    """The tiny model made to continue the cycle ``CYCLE`` with probability about 1/2 at
    temperature 1 (logit 6.2 against 0 for the other 511 ids), so
    n-gram drafts from a cyclic prompt are kept about half the time and rejected otherwise."""
    from shardline_runtime.tiny_checkpoint import make_cycle_checkpoint

    return make_cycle_checkpoint(ckpt, tmp_path_factory.mktemp("cycle"), CYCLE, 6.2)


def _sampled_triples(ckpt, spec: bool, n: int) -> tuple[Counter, object]:
    """Output ids of ``n`` sampled requests (3 tokens each) on a cyclic prompt, ids outside the
    cycle binned as -1."""
    params = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True)
    reqs = [TokenizedGenerateReqInput(rid=f"s{i}", input_ids=CYCLE * 4, sampling_params=params) for i in range(n)]
    torch.manual_seed(1234 if spec else 4321)
    out, scheduler = _run(ckpt, {0: reqs}, spec=spec, max_total_tokens=n * 40, max_running_requests=n)
    cells = Counter(tuple(t if t in CYCLE else -1 for t in v["ids"]) for v in out.values())
    return cells, scheduler


@pytest.mark.slow
def test_sampled_output_follows_the_distribution_without_speculation(cycle_ckpt):
    n = 600
    a, _ = _sampled_triples(cycle_ckpt, False, n)
    b, scheduler = _sampled_triples(cycle_ckpt, True, n)
    stats = scheduler.speculative.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, "drafts were both kept and rejected"
    cells = sorted(set(a) | set(b))
    table = torch.tensor([[a[c] for c in cells], [b[c] for c in cells]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = len(cells) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))
    assert p_value > 1e-3, f"chi-square {stat:.1f} on {dof} degrees of freedom"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm EAGLE is not implemented"),
        ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 2}, "--speculative-eagle-topk 2"),
        ({"speculative_algorithm": "NGRAM", "pp_size": 2}, "not supported with --pp-size > 1"),
        ({"speculative_algorithm": "NGRAM", "enable_lora": True}, "not supported with --enable-lora"),
        ({"speculative_draft_model_path": "/d"}, "--speculative-draft-model-path needs"),
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
