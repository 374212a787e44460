"""Shared parts of the speculative-decoding scheduler tests: prompts, the run with and without a
proposer, the settled-pool check, the sampled-output chi-square test of homogeneity."""

from __future__ import annotations

import random
from collections import Counter

import torch
from scheduler_harness import make_scheduler, run_loop

from shardline_runtime.managers.io_struct import TokenizedGenerateReqInput
from shardline_runtime.sampling.sampling_params import SamplingParams

CYCLE = [11, 12, 13, 14, 15, 16]


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 500) for _ in range(n)]


def assert_settled(scheduler) -> None:
    assert scheduler.cache.used_tokens() == 0, "every KV slot is free or in the prefix cache"
    rows = scheduler.cache.req_to_token_pool
    assert rows.available_size() == rows.size, "every request row is free"


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
