"""Shared parts of the speculative-decoding scheduler tests: prompts, the run with and without a
proposer, the settled-pool checks (target and draft), the greedy-equality checks alone and in the
mixed workload, the sampled-output chi-square test of homogeneity. The targets they run on are
the ``spec_target`` / ``cycle_target`` fixtures of ``conftest.py``."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from scheduler_harness import greedy, make_scheduler, run_loop

from shardline_runtime.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from shardline_runtime.sampling.sampling_params import SamplingParams

CYCLE = [11, 12, 13, 14, 15, 16]


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 500) for _ in range(n)]


def assert_settled(scheduler) -> None:
    assert scheduler.cache.used_tokens() == 0, "every KV slot is free or in the prefix cache"
    rows = scheduler.cache.req_to_token_pool
    assert rows.available_size() == rows.size, "every request row is free"


def spec_flags(algorithm: str, draft_path=None, tokens: int = 4) -> dict:
    """Scheduler flags of ``--speculative-algorithm algorithm`` with ``tokens`` draft tokens
    (the last accepted one included) and, when given, the draft checkpoint."""
    flags = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": tokens}
    if draft_path is not None:
        flags["speculative_draft_model_path"] = str(draft_path)
    return flags


def assert_draft_settled(scheduler) -> None:
    """Every KV slot and request row of the draft's own pools is free."""
    draft = scheduler.worker.draft_worker
    assert draft.used_tokens == 0, "every draft KV slot is free"
    rows = draft.runner.req_to_token_pool
    assert rows.available_size() == rows.size, "every draft request row is free"


def update_replies(scheduler) -> list:
    """The ``UpdateWeightsFromDiskReqOutput`` replies the scheduler sent."""
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqOutput

    return [m for m in scheduler.sender.socket.messages if isinstance(m, UpdateWeightsFromDiskReqOutput)]


def check_greedy_single(
    ckpt, flags: dict, ids: list[int] | None = None, some_rejected: bool = True, new_tokens: int = 60
):
    """One greedy request (``ids``, default 30 random tokens; ``new_tokens`` new) with ``flags`` gives the
    tokens it gives without speculation; some drafts were kept (and, with ``some_rejected``,
    some rejected); both pools settle. Returns the speculative scheduler."""
    arrivals = {0: [greedy("one", ids or prompt(random.Random(1), 30), new_tokens)]}
    plain, _ = run(ckpt, arrivals, None)
    spec, scheduler = run(ckpt, arrivals, flags)
    stats = scheduler.speculative.stats
    assert spec["one"]["ids"] == plain["one"]["ids"]
    assert stats.accepted_tokens > 0, "some drafts were kept"
    if some_rejected:
        assert stats.accepted_tokens < stats.draft_tokens, "some drafts were rejected"
    assert_settled(scheduler)
    if scheduler.worker.draft_worker is not None:
        assert_draft_settled(scheduler)
    return scheduler


def check_greedy_mixed(ckpt, flags: dict, some_accepted: bool = True):
    """:func:`mixed_workload` with ``flags`` matches it without speculation; verify steps ran
    (and, with ``some_accepted``, drafts were kept); both pools settle. Returns the scheduler."""
    arrivals = mixed_workload()
    plain, _ = run(ckpt, arrivals, None, **MIXED_LIMITS)
    spec, scheduler = run(ckpt, arrivals, flags, **MIXED_LIMITS)
    assert_mixed_workload_matches(spec, plain)
    assert scheduler.speculative.stats.verify_steps > 0
    if some_accepted:
        assert scheduler.speculative.stats.accepted_tokens > 0
    assert_settled(scheduler)
    if scheduler.worker.draft_worker is not None:
        assert_draft_settled(scheduler)
    return scheduler


def check_sampled_distribution(ckpt, flags: dict, n: int = 600) -> None:
    """``n`` sampled requests with ``flags`` follow the distribution without speculation
    (chi-square p > 1e-3), with drafts both kept and rejected."""
    a, _ = sampled_triples(ckpt, None, n, 4321)
    b, scheduler = sampled_triples(ckpt, flags, n, 1234)
    stats = scheduler.speculative.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, "drafts were both kept and rejected"
    p_value, stat, dof = homogeneity_p_value(a, b)
    assert p_value > 1e-3, f"chi-square {stat:.1f} on {dof} degrees of freedom"


def run(ckpt, arrivals, flags: dict | None, **overrides):
    """Results and scheduler of ``arrivals`` without speculation (``flags`` None) or with the
    speculative ``flags``."""
    scheduler = make_scheduler(ckpt, disable_overlap_schedule=True, **(flags or {}), **overrides)
    return run_loop(scheduler, arrivals), scheduler


def sampled_triples(ckpt, flags: dict | None, n: int, seed: int) -> tuple[Counter, object]:
    """Output ids of ``n`` sampled requests (3 tokens each) on a cyclic prompt, ids outside the
    cycle binned as -1."""
    params = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True)
    reqs = [TokenizedGenerateReqInput(rid=f"s{i}", input_ids=CYCLE * 4, sampling_params=params) for i in range(n)]
    torch.manual_seed(seed)
    out, scheduler = run(ckpt, {0: reqs}, flags, max_total_tokens=n * 40, max_running_requests=n)
    cells = Counter(tuple(t if t in CYCLE else -1 for t in v["ids"]) for v in out.values())
    return cells, scheduler


def homogeneity_p_value(a: Counter, b: Counter) -> tuple[float, float, int]:
    """Pearson's chi-square test that two samples come from one distribution:
    (p-value, statistic, degrees of freedom)."""
    cells = sorted(set(a) | set(b))
    table = torch.tensor([[a[c] for c in cells], [b[c] for c in cells]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = len(cells) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))
    return p_value, stat, dof


MIXED_LIMITS = {"chunked_prefill_size": 64, "max_prefill_tokens": 256}


def mixed_workload() -> dict[int, list]:
    """Arrivals by step: short and long prompts (chunked at ``MIXED_LIMITS``), a prefill-only
    request, prompt and token logprobs, a shared prefix arriving again later (prefix cache), stop
    tokens, a frequency penalty, and a long request aborted at step 30."""
    rng = random.Random(0)
    shared = prompt(rng, 90)
    first = [greedy(f"a{i}", prompt(rng, rng.randint(3, 150)), rng.randint(1, 24)) for i in range(6)]
    first.append(greedy("prefill_only", prompt(rng, 20), 0))
    first.append(greedy("logprobs", prompt(rng, 150), 24, return_logprob=True, top_logprobs_num=2, logprob_start_len=5))
    first.append(greedy("shared0", shared + [7, 8], 30))
    stop_params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=tuple(range(5, 500, 3)))
    penalty = SamplingParams(max_new_tokens=20, temperature=0.0, frequency_penalty=1.5)
    return {
        0: first,
        2: [
            greedy("late", prompt(rng, 200), 30),
            TokenizedGenerateReqInput(rid="stops", input_ids=prompt(rng, 12), sampling_params=stop_params),
            TokenizedGenerateReqInput(rid="penalty", input_ids=prompt(rng, 12) * 2, sampling_params=penalty),
        ],
        4: [greedy("long", prompt(rng, 40), 300)],
        30: [AbortReq("long")],
        50: [greedy("shared1", shared + [9, 10, 11], 30)],
    }


def assert_mixed_workload_matches(spec: dict, plain: dict) -> None:
    """The speculative run of :func:`mixed_workload` gave the plain run's tokens, finishes and
    logprobs; the prefix cache served; the abort cut a prefix of the plain output."""
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
