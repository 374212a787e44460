"""Speculative decoding through the graph runners' static-buffer path (what a CUDA graph replays,
run eagerly on the CPU): TARGET_VERIFY graphs (``verify_graph_runner.py``), the target's decode
graphs returning EAGLE's features, and the draft runner's decode graphs (STANDALONE decode steps,
EAGLE chain steps with static feature buffers). Every replay is checked against the eager forward
of the same batch (logits and hidden states), and greedy output with speculation through the
graphs equals the output without speculation token for token, alone and in the mixed batch."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from scheduler_harness import greedy, make_scheduler, run_loop
from speculative_harness import CYCLE, prompt, run

from shardline_runtime.model_executor.cuda_graph_runner import CudaGraphRunner
from shardline_runtime.model_executor.device_graphs import DeviceGraphs
from shardline_runtime.model_executor.model_forward import forward_eager
from shardline_runtime.speculative.eagle_checkpoint import make_cycle_eagle3_checkpoint, make_cycle_eagle_checkpoint
from shardline_runtime.tiny_checkpoint import make_cycle_checkpoint, make_draft_checkpoint

SIZES = [1, 2, 4]
_PLAIN: dict = {}  # target -> its output without speculation


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama", 0, max_position_embeddings=512)


@pytest.fixture(scope="module")
def cycle_ckpt(ckpt, tmp_path_factory):
    return make_cycle_checkpoint(ckpt, tmp_path_factory.mktemp("cycle"), CYCLE, 6.2)


def _checked(runner, graphs, kind: str, replays: Counter):
    """``graphs.replay``, compared with the eager forward of the same batch first (the static
    path runs last, so the KV it writes is what later steps read)."""
    original = graphs.replay

    def replay(forward_batch, *proxy):
        eager = forward_eager(runner, forward_batch)
        out = original(forward_batch, *proxy)
        torch.testing.assert_close(out.next_token_logits, eager.next_token_logits, atol=1e-4, rtol=1e-4)
        assert (out.hidden_states is None) == (eager.hidden_states is None), kind
        if eager.hidden_states is not None:
            torch.testing.assert_close(out.hidden_states, eager.hidden_states, atol=1e-4, rtol=1e-4)
        replays[kind] += 1
        return out

    graphs.replay = replay


def attach_static_graphs(worker) -> Counter:
    """The target's decode + verify graphs and the draft's decode graphs on the static-buffer
    path (``capture=False``), each replay checked against eager; returns replays per kind."""
    replays: Counter = Counter()
    runner = worker.model_runner
    decode = CudaGraphRunner(runner, capture=False, batch_sizes=SIZES)
    graphs = DeviceGraphs(runner, decode=decode)
    graphs.verify = graphs.verify_runner(decode, capture=False)
    assert graphs.verify is not None
    runner.graphs = graphs
    _checked(runner, decode, "decode", replays)
    _checked(runner, graphs.verify, "verify", replays)
    if worker.draft_worker is not None:
        draft = worker.draft_worker.runner
        draft_decode = CudaGraphRunner(draft, capture=False, batch_sizes=SIZES)
        draft.graphs = DeviceGraphs(draft, decode=draft_decode)
        _checked(draft, draft_decode, "draft", replays)
    return replays


def run_graphs(ckpt, arrivals, flags: dict, **overrides):
    scheduler = make_scheduler(ckpt, disable_overlap_schedule=True, **flags, **overrides)
    replays = attach_static_graphs(scheduler.worker)
    return run_loop(scheduler, arrivals), scheduler, replays


def _flags(algo: str, draft=None, tokens: int = 4) -> dict:
    flags = {"speculative_algorithm": algo, "speculative_num_draft_tokens": tokens}
    return flags if draft is None else {**flags, "speculative_draft_model_path": str(draft)}


@pytest.fixture(scope="module")
def proposers(ckpt, cycle_ckpt, tmp_path_factory):
    """(target, flags) per algorithm: drafts that are sometimes kept, sometimes rejected."""
    standalone = make_draft_checkpoint(ckpt, tmp_path_factory.mktemp("draft"), noise=0.6)
    head = make_cycle_eagle_checkpoint(cycle_ckpt, tmp_path_factory.mktemp("head"), CYCLE, wrong_after=2)
    head3 = make_cycle_eagle3_checkpoint(cycle_ckpt, tmp_path_factory.mktemp("head3"), CYCLE, [0, 1, 1], wrong_after=2)
    return {
        "NGRAM": (ckpt, _flags("NGRAM")),
        "STANDALONE": (ckpt, _flags("STANDALONE", standalone)),
        "EAGLE": (cycle_ckpt, _flags("EAGLE", head)),
        "EAGLE3": (cycle_ckpt, _flags("EAGLE3", head3)),
    }


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE", "EAGLE", "EAGLE3"])
def test_greedy_batch_through_graphs_equals_no_speculation(proposers, algo):
    target, flags = proposers[algo]
    rng = random.Random(3)
    # three requests (bs 3 pads to 4), repetitive prompts, different lengths
    arrivals = {0: [greedy(f"r{i}", prompt(rng, 5 + i) * 3, 10 + 3 * i) for i in range(3)]}
    if target not in _PLAIN:  # NGRAM and STANDALONE share the target
        _PLAIN[target] = run(target, arrivals, None)[0]
    plain = _PLAIN[target]
    spec, scheduler, replays = run_graphs(target, arrivals, flags)
    assert {rid: v["ids"] for rid, v in spec.items()} == {rid: v["ids"] for rid, v in plain.items()}
    stats = scheduler.speculative.stats
    assert stats.verify_steps > 0 and stats.accepted_tokens > 0
    if algo == "EAGLE3":  # its aux-layer hooks run only in eager forwards (try_replay)
        assert replays["verify"] == 0 and replays["decode"] == 0, "target steps that feed the head run eagerly"
    else:
        assert replays["verify"] == stats.verify_steps, "every verify step replayed its graph"
    if algo != "NGRAM":
        assert replays["draft"] > 0, "draft decode steps replayed the draft's graphs"
    assert_settled(scheduler)


def assert_settled(scheduler) -> None:
    """Every KV slot of both pools is free (or in the target's prefix cache) and every request
    row but the graphs' padding row."""
    worker = scheduler.worker
    assert scheduler.cache.used_tokens() == 0, "every KV slot is free or in the prefix cache"
    for runner in filter(None, (worker.model_runner, getattr(worker.draft_worker, "runner", None))):
        rows, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
        assert rows.available_size() == rows.size - 1, "one row pads the graphs, the rest are free"
        if runner is not worker.model_runner:  # the target's may sit in the prefix cache
            assert alloc.available_size() == alloc.size


@pytest.mark.parametrize(
    "algo, reason",
    [
        ("NGRAM", "verify: cpu: no CUDA graphs"),
        ("STANDALONE", "verify: cpu: no CUDA graphs; draft: cpu: no CUDA graphs"),
    ],
)
def test_the_report_says_why_no_verify_or_draft_graph_was_captured(proposers, algo, reason):
    target, flags = proposers[algo]
    worker = make_scheduler(target, disable_overlap_schedule=True, **flags).worker
    report = worker.captured_graphs()
    assert (report.verify_batch_sizes, report.draft_batch_sizes, report.verify_tokens_per_request) == ((), (), 0)
    assert report.reason == "cpu: no CUDA graphs"
    assert report.speculative_reason == reason


def test_the_report_of_a_server_without_speculation_names_no_speculative_graphs(ckpt):
    report = make_scheduler(ckpt, disable_overlap_schedule=True).worker.captured_graphs()
    assert report.speculative_reason is None and report.verify_batch_sizes == ()


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE", "EAGLE"])
def test_captured_verify_and_draft_graphs_on_cuda(proposers, algo):
    """Real capture: greedy output through the verify and draft graphs equals the output
    without speculation; the report lists them; a weight update of target and draft (the same
    checkpoints) captures them again and the output stays the same."""
    target, flags = proposers[algo]
    rng = random.Random(3)
    arrivals = {0: [greedy(f"r{i}", prompt(rng, 6 + i) * 3, 24) for i in range(3)]}
    cuda = {"device": "cuda", "disable_cuda_graph": False, "cuda_graph_max_bs": 4}
    plain = run_loop(make_scheduler(target, disable_overlap_schedule=True, device="cuda"), arrivals)
    scheduler = make_scheduler(target, disable_overlap_schedule=True, **cuda, **flags)
    worker = scheduler.worker
    report = worker.captured_graphs()
    assert report.verify_batch_sizes == (1, 2, 4) and report.verify_tokens_per_request == 4
    assert report.draft_batch_sizes == (() if algo == "NGRAM" else (1, 2, 4))
    assert report.speculative_reason is None
    spec = run_loop(scheduler, arrivals)
    assert {rid: v["ids"] for rid, v in spec.items()} == {rid: v["ids"] for rid, v in plain.items()}
    before = dict(worker.model_runner.graphs.verify.graphs)
    draft_path = flags.get("speculative_draft_model_path")
    ok, message = worker.update_weights_from_disk(str(target), draft_model_path=draft_path)
    assert ok, message
    assert all(worker.model_runner.graphs.verify.graphs[bs] is not g for bs, g in before.items())
    if draft_path is not None:
        assert worker.draft_worker.runner.graphs.decode.graphs
    rerun = {0: [greedy(f"again{i}", r.input_ids, 24) for i, r in enumerate(arrivals[0])]}
    again = run_loop(scheduler, rerun)
    assert [again[f"again{i}"]["ids"] for i in range(3)] == [plain[f"r{i}"]["ids"] for i in range(3)]
