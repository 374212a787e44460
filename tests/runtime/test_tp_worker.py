"""TpModelWorker: limits, delayed sampling, weight phases; TP=2: same tokens on every rank and
all-or-nothing weight updates."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from shardline_runtime.managers.schedule_batch import Req
from shardline_runtime.sampling import SamplingParams

from tests.runtime.engine_driver import hf_greedy, make_worker, run_engine, tp_rank_main

PROMPTS = [[5, 17, 33, 80, 9], [7, 8, 9], [300, 12, 55, 66, 77, 88]]


def test_limits(tiny_checkpoint):
    path = tiny_checkpoint("llama", seed=0)  # context 512
    small_pool = make_worker(path, max_total_tokens=100, max_running_requests=4)
    assert small_pool.max_total_num_tokens == 100
    assert small_pool.max_req_len == 99 and small_pool.max_req_input_len == 98
    assert small_pool.max_running_requests == 4
    big_pool = make_worker(path, max_total_tokens=4096)
    assert big_pool.max_req_len == 511  # context_len - 1
    info = big_pool.get_worker_info()
    assert info["weights_phase"] == "serving" and info["vocab_size"] == 512 and info["random_seed"] == 0


def test_delayed_sampling_hook(tiny_checkpoint):
    worker = make_worker(tiny_checkpoint("llama", seed=0))
    req = Req("a", PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=1))
    batch = worker.new_batch([req])
    batch.prepare_for_extend()
    result = worker.forward_batch_generation(batch, skip_sample=True)
    assert result.next_token_ids is None
    worker.sample(result, batch)
    assert result.next_token_ids.tolist() == [int(result.logits_output.next_token_logits.argmax())]
    batch.release_kv(req)


def test_logprobs_of_sampled_tokens(tiny_checkpoint):
    path = tiny_checkpoint("llama", seed=0)
    worker = make_worker(path)
    req = Req("a", PROMPTS[2], SamplingParams(temperature=0.0, max_new_tokens=1), return_logprob=True, top_logprobs_num=2)
    batch = worker.new_batch([req])
    batch.prepare_for_extend()
    result = worker.forward_batch_generation(batch)
    raw = result.logits_output.next_token_logits[0].log_softmax(-1)
    assert result.next_token_logprobs[0] == pytest.approx(float(raw.max()))
    values, ids = result.next_token_top_logprobs[0]
    assert ids == raw.topk(2).indices.tolist()
    batch.release_kv(req)


def test_update_phases_are_reported(tiny_checkpoint):
    worker = make_worker(tiny_checkpoint("llama", seed=0))
    seen = []
    from shardline_runtime.model_executor import weight_update

    ok, _ = weight_update.update_weights_from_disk(
        worker.model_runner, str(tiny_checkpoint("llama", seed=1, tokenizer=False)), on_phase=seen.append
    )
    assert ok and [p.value for p in seen] == ["loading", "serving"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tp2_same_tokens_on_every_rank_and_all_or_nothing_updates(tiny_checkpoint, tmp_path):
    import torch.multiprocessing as mp

    path_a = str(tiny_checkpoint("llama", seed=0))
    path_b = str(tiny_checkpoint("llama", seed=1, tokenizer=False))
    ctx = mp.spawn(tp_rank_main, args=(2, _free_port(), path_a, path_b, PROMPTS, str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 300
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("TP=2 workers did not finish in 300 s")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["seed"] == r1["seed"] == 7
    assert r0["sampled"] == r1["sampled"]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    assert r0["greedy_a"] == r1["greedy_a"] == hf_greedy(path_a, PROMPTS, 8)
    assert r0["failed_update"][0] is False and r1["failed_update"][0] is False
    assert "another tensor-parallel rank" in r0["failed_update"][1]
    assert "disk error injected on rank 1" in r1["failed_update"][1]
    assert r0["phase_after_failure"] == r1["phase_after_failure"] == "failed"
    assert r0["greedy_after_failure"] == r0["greedy_a"] == r1["greedy_after_failure"]
    assert r0["update"][0] and r1["update"][0]
    cold_b = run_engine(make_worker(path_b), PROMPTS, greedy)
    assert r0["greedy_b"] == r1["greedy_b"] == cold_b
