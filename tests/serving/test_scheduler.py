"""Scheduler in-process on a real TpModelWorker: batching equals alone, chunked prefill (S4),
retraction under a small KV pool (running requests and a chunked prefill), prefix cache reuse, aborts free KV at once."""

from __future__ import annotations

import random

import pytest

from scheduler_harness import greedy, make_scheduler, run_loop, run_to_completion

from shardline_runtime.managers.io_struct import (
    AbortReq,
    UpdateWeightsFromDiskReqInput,
    WeightUpdateCutoffReqInput,
)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama", 0, max_position_embeddings=2048)


def _prompts(seed: int, count: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(low, high))] for _ in range(count)]


def test_batched_equals_alone_and_kv_returns_to_baseline(ckpt):
    prompts = _prompts(0, 12, 3, 60)
    lengths = [random.Random(i).randint(1, 20) for i in range(len(prompts))]
    alone = {}
    scheduler = make_scheduler(ckpt)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        scheduler.process_input_requests([greedy(f"r{i}", p, n)])
        alone.update(run_to_completion(scheduler))
        scheduler.sender.socket.messages.clear()
    scheduler = make_scheduler(ckpt, disable_radix_cache=True)
    scheduler.process_input_requests([greedy(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, lengths))])
    together = run_to_completion(scheduler)
    for rid, r in alone.items():
        assert together[rid]["ids"] == r["ids"], rid
        assert len(r["ids"]) == lengths[int(rid[1:])] and r["finish"]["type"] == "length"
    assert scheduler.cache.used_tokens() == 0 and scheduler.cache.allocator.available_size() == scheduler.cache.max_total_num_tokens
    assert scheduler.cache.req_to_token_pool.available_size() == scheduler.cache.req_to_token_pool.size


def test_s4_chunked_prefill_equals_unchunked(ckpt):
    prompt = _prompts(1, 1, 300, 300)[0]
    kw = dict(return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
    plain = make_scheduler(ckpt, chunked_prefill_size=-1)
    plain.process_input_requests([greedy("a", prompt, 12, **kw)])
    expected = run_to_completion(plain)["a"]
    chunked = make_scheduler(ckpt, chunked_prefill_size=64, max_prefill_tokens=64)
    chunked.process_input_requests([greedy("a", prompt, 12, **kw)])
    steps_with_output = []
    for step in range(200):
        batch = chunked.get_next_batch_to_run()
        if batch is None:
            break
        before = len(chunked.sender.socket.messages)
        chunked.results.process(batch, chunked.run_batch(batch))
        steps_with_output.append(len(chunked.sender.socket.messages) > before)
    # 300 prompt tokens in chunks of 64: 4 intermediate chunks emit nothing, the 5th emits a token
    assert steps_with_output[:5] == [False, False, False, False, True]
    got = run_to_completion(chunked)["a"]
    assert got["ids"] == expected["ids"]
    assert [t for _, t in got["prompt_logprobs"]] == prompt
    for (a, _), (b, _) in zip(got["prompt_logprobs"][1:], expected["prompt_logprobs"][1:]):
        assert a == pytest.approx(b, abs=1e-4)


def test_retraction_under_small_pool_is_exact(ckpt):
    prompts = _prompts(2, 8, 20, 40)
    big = make_scheduler(ckpt, max_total_tokens=2048)
    big.process_input_requests([greedy(f"r{i}", p, 40) for i, p in enumerate(prompts)])
    expected = run_to_completion(big)
    small = make_scheduler(ckpt, max_total_tokens=256, disable_radix_cache=True)
    small.process_input_requests([greedy(f"r{i}", p, 40) for i, p in enumerate(prompts)])
    got = run_to_completion(small)
    assert small.decode_manager.num_retractions > 0
    assert {k: v["ids"] for k, v in got.items()} == {k: v["ids"] for k, v in expected.items()}
    assert small.cache.used_tokens() == 0


def test_prefix_cache_reuse_reported_and_exact(ckpt):
    prefix = _prompts(3, 1, 100, 100)[0]
    scheduler = make_scheduler(ckpt)
    scheduler.process_input_requests([greedy("first", prefix + [7, 8], 6)])
    first = run_to_completion(scheduler)["first"]
    scheduler.sender.socket.messages.clear()
    scheduler.process_input_requests([greedy("second", prefix + [9, 10, 11], 6)])
    second = run_to_completion(scheduler)["second"]
    assert first["cached"] == 0 and second["cached"] == 100
    cold = make_scheduler(ckpt, disable_radix_cache=True)
    cold.process_input_requests([greedy("second", prefix + [9, 10, 11], 6)])
    assert run_to_completion(cold)["second"]["ids"] == second["ids"]
    assert scheduler.cache.used_tokens() == 0 and scheduler.tree_cache.evictable_size() > 0


def test_abort_frees_kv_before_next_step(ckpt):
    scheduler = make_scheduler(ckpt)
    scheduler.process_input_requests([greedy("long", _prompts(4, 1, 50, 50)[0], 500), greedy("queued", [5, 6, 7], 5)])
    for _ in range(3):
        batch = scheduler.get_next_batch_to_run()
        scheduler.results.process(batch, scheduler.run_batch(batch))
    assert scheduler.cache.used_tokens() > 0
    scheduler.process_input_requests([AbortReq("long"), AbortReq("queued")])
    assert scheduler.cache.used_tokens() == 0 and scheduler.is_idle()
    reasons = {rid: r["finish"]["type"] for rid, r in run_to_completion(scheduler).items()}
    assert reasons == {"long": "abort", "queued": "abort"}


def test_pool_clips_max_new_tokens_with_length(ckpt):
    scheduler = make_scheduler(ckpt, max_total_tokens=300)
    scheduler.process_input_requests([greedy("big", _prompts(5, 1, 100, 100)[0], 1000), greedy("small", [5, 6], 4)])
    got = run_to_completion(scheduler)
    assert got["big"]["finish"]["type"] == "length" and len(got["big"]["ids"]) == scheduler.worker.max_req_len - 100
    assert len(got["small"]["ids"]) == 4
    assert scheduler.cache.used_tokens() == 0


def test_mixed_chunk_equals_separate_steps(ckpt):
    prompts = _prompts(6, 6, 5, 80)
    expected = {}
    for mixed in (False, True):
        scheduler = make_scheduler(ckpt, enable_mixed_chunk=mixed)
        scheduler.process_input_requests([greedy("r0", prompts[0], 30)])
        steps = 0
        for i, p in enumerate(prompts[1:], 1):  # arrivals while r0 decodes
            for _ in range(3):
                batch = scheduler.get_next_batch_to_run()
                scheduler.results.process(batch, scheduler.run_batch(batch))
                steps += 1
            scheduler.process_input_requests([greedy(f"r{i}", p, 10 + i)])
        got = {rid: r["ids"] for rid, r in run_to_completion(scheduler).items()}
        if mixed:
            assert got == expected
        expected = got
        assert scheduler.cache.used_tokens() == 0


def test_weight_update_waits_for_a_chunked_prefill(ckpt, tiny_checkpoint):
    """An update to another checkpoint that arrives between the chunks of a prefill waits for the
    request: it answers exactly as a cold run on the old weights, and the request sent after the
    update exactly as a cold run on the new ones."""
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput, UpdateWeightsFromDiskReqOutput

    long_prompt, later_prompt = _prompts(7, 1, 200, 200)[0], [5, 6, 7, 8]
    other = tiny_checkpoint("llama", 1, max_position_embeddings=2048)
    cold = {}
    for name, path in (("a", ckpt), ("b", other)):
        cold_scheduler = make_scheduler(path, chunked_prefill_size=32, max_prefill_tokens=32)
        cold_scheduler.process_input_requests([greedy("long", long_prompt, 4), greedy("later", later_prompt, 4)])
        cold[name] = run_to_completion(cold_scheduler)
    assert cold["a"]["later"]["ids"] != cold["b"]["later"]["ids"]  # the two checkpoints answer differently
    scheduler = make_scheduler(ckpt, chunked_prefill_size=32, max_prefill_tokens=32)
    scheduler.process_input_requests([greedy("long", long_prompt, 4)])
    batch = scheduler.get_next_batch_to_run()  # first chunk only
    scheduler.results.process(batch, scheduler.run_batch(batch))
    assert scheduler.prefill_manager.chunked_req is not None
    scheduler.process_input_requests([UpdateWeightsFromDiskReqInput(str(other), revision="b"),
                                      greedy("later", later_prompt, 4)])
    results = run_to_completion(scheduler)
    replies = [m for m in scheduler.sender.socket.messages if isinstance(m, UpdateWeightsFromDiskReqOutput)]
    assert len(replies) == 1
    assert replies[0].success, replies[0].message
    assert results["long"]["ids"] == cold["a"]["long"]["ids"], "the chunked prefill must finish on the old weights"
    assert results["later"]["ids"] == cold["b"]["later"]["ids"], "a request after the update runs on the new weights"
    assert scheduler.cache.used_tokens() == 0


def test_weight_update_reports_each_phase_while_it_runs(ckpt, tiny_checkpoint):
    """The HTTP process mirrors weights_phase (and the operator mirrors it in turn): rank 0 sends
    every phase the worker enters, before the final reply, not only the end state."""
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput, UpdateWeightsFromDiskReqOutput
    from shardline_runtime.weights_state import WeightsState

    scheduler = make_scheduler(ckpt)
    other = tiny_checkpoint("llama", 1, max_position_embeddings=2048)
    scheduler.process_input_requests([UpdateWeightsFromDiskReqInput(str(other), revision="b")])
    run_to_completion(scheduler)
    msgs = scheduler.sender.socket.messages
    phases = [m.phase.value for m in msgs if isinstance(m, WeightsState)]
    reply_at = next(i for i, m in enumerate(msgs) if isinstance(m, UpdateWeightsFromDiskReqOutput))
    assert phases == ["loading", "serving"], phases  # CPU: no graphs, so no "recapturing"
    assert all(isinstance(m, WeightsState) or m is msgs[reply_at] for m in msgs), msgs
    assert msgs[reply_at].success
    assert reply_at == len(msgs) - 1


def test_weight_update_lets_retracted_requests_finish_on_the_old_weights(ckpt, tiny_checkpoint):
    """A request retracted under KV pressure after it began generating goes back to the waiting
    queue; a weight update that arrives then must wait for it as for a running one, or its
    response would start on revision A and end on B (issue 16's W4, found flaky in CI)."""
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput, UpdateWeightsFromDiskReqOutput

    prompts = _prompts(2, 8, 20, 40)
    big = make_scheduler(ckpt, max_total_tokens=2048)
    big.process_input_requests([greedy(f"r{i}", p, 40) for i, p in enumerate(prompts)])
    expected = run_to_completion(big)
    small = make_scheduler(ckpt, max_total_tokens=256, disable_radix_cache=True)
    small.process_input_requests([greedy(f"r{i}", p, 40) for i, p in enumerate(prompts)])
    for _ in range(2000):  # step until a retracted request that already has output waits
        batch = small.get_next_batch_to_run()
        assert batch is not None, "the workload finished without a retraction"
        small.results.process(batch, small.run_batch(batch))
        if any(r.output_ids for r in small.prefill_manager.waiting_queue):
            break
    started = {r.rid for r in small.prefill_manager.waiting_queue if r.output_ids} | {r.rid for r in small.decode_manager.running_batch.reqs}
    assert any(r.output_ids for r in small.prefill_manager.waiting_queue)
    other = tiny_checkpoint("llama", 1, max_position_embeddings=2048)
    small.process_input_requests([UpdateWeightsFromDiskReqInput(str(other), revision="b")])
    got = run_to_completion(small)
    replies = [m for m in small.sender.socket.messages if isinstance(m, UpdateWeightsFromDiskReqOutput)]
    assert len(replies) == 1 and replies[0].success
    for rid in started:  # every response begun on A ends on A
        assert got[rid]["ids"] == expected[rid]["ids"], rid


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_chunked_prefill_gives_way_to_a_lone_running_request(ckpt, overlap):
    """A 200-token prompt arriving while a 59-token request decodes fills a 256-slot pool with
    its 8-token chunks. The decode step must retract the chunked prefill (admitted last, no
    output yet), not cut the running request with a false ``length``: both match a big-pool
    run, the second is clipped only at ``max_req_len``, and its re-cached chunks are no cache hit."""
    a, b = _prompts(11, 1, 59, 59)[0], _prompts(12, 1, 200, 200)[0]
    kw = dict(chunked_prefill_size=8, max_prefill_tokens=8, disable_overlap_schedule=not overlap)
    arrivals = {0: [greedy("a", a, 30)], 6: [greedy("b", b, 100)]}
    expected = run_loop(make_scheduler(ckpt, max_total_tokens=2048, **kw), arrivals)
    small = make_scheduler(ckpt, max_total_tokens=256, **kw)
    got = run_loop(small, arrivals)
    assert got["a"]["ids"] == expected["a"]["ids"] and got["a"]["finish"]["length"] == 30
    clipped = small.worker.max_req_len - len(b)
    assert 0 < clipped < 100 and got["b"]["ids"] == expected["b"]["ids"][:clipped]
    assert got["b"]["cached"] == 0 and small.decode_manager.num_retractions > 0
    assert small.cache.used_tokens() == 0


def test_an_update_in_its_admission_window_lets_the_loop_block_until_its_cutoff(ckpt):
    """Nothing runs while a disk update's admission window is open: the loop polls its socket
    at the idle pace (a message, the cutoff included, wakes it) instead of spinning beside the
    staging thread; once the cutoff came the update is due and the loop no longer idles."""
    scheduler = make_scheduler(ckpt)
    scheduler.process_input_requests([UpdateWeightsFromDiskReqInput(str(ckpt), admit_seconds=1.0)])
    assert scheduler.control.pending_update is not None and scheduler.is_idle()
    scheduler.control.handlers()[WeightUpdateCutoffReqInput](WeightUpdateCutoffReqInput(0.0))
    assert not scheduler.is_idle()
    scheduler.process_input_requests([])  # commits (nothing was admitted before the cutoff)
    assert scheduler.control.pending_update is None and scheduler.is_idle()
