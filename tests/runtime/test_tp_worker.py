"""TpModelWorker: limits, delayed sampling, weight phases; TP=2: same tokens on every rank and
all-or-nothing weight updates."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from shardline_runtime.managers.schedule_batch import Req, ScheduleBatch
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
    assert "weights_phase" not in info  # which weights serve is the scheduler's ControlPlane's
    assert info["vocab_size"] == 512
    assert info["random_seed"] == 0


def test_one_step_runs_forward_then_the_runners_sampler(tiny_checkpoint):
    worker = make_worker(tiny_checkpoint("llama", seed=0))
    runner = worker.model_runner
    req = Req("a", PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=1))
    batch = ScheduleBatch.init_new([req], worker)
    batch.prepare_for_extend()
    passes_before = runner.forward_pass_id
    result = worker.forward_batch_generation(batch.get_model_worker_batch())
    assert runner.forward_pass_id == passes_before + 1, "each step counts one forward pass"
    assert result.copy_to_cpu().wait().next_token_ids.tolist() == [int(result.logits_output.next_token_logits.argmax())]
    batch.release_kv(req)


def test_worker_is_a_base_tp_worker_exposing_runner_and_window(tiny_checkpoint):
    from shardline_runtime.managers.tp_worker import BaseTpWorker

    worker = make_worker(tiny_checkpoint("mistral", seed=0, sliding_window=64))
    assert isinstance(worker, BaseTpWorker)
    assert worker.model_runner.is_generation is True
    assert worker.sliding_window_size == 64


def test_logprobs_of_sampled_tokens(tiny_checkpoint):
    path = tiny_checkpoint("llama", seed=0)
    worker = make_worker(path)
    req = Req("a", PROMPTS[2], SamplingParams(temperature=0.0, max_new_tokens=1), return_logprob=True, top_logprobs_num=2)
    batch = ScheduleBatch.init_new([req], worker)
    batch.prepare_for_extend()
    result = worker.forward_batch_generation(batch.get_model_worker_batch()).copy_to_cpu().wait()
    raw = result.logits_output.next_token_logits[0].log_softmax(-1)
    assert result.next_token_logprobs[0] == pytest.approx(float(raw.max()))
    values, ids = result.next_token_top_logprobs[0]
    assert ids == raw.topk(2).indices.tolist()
    batch.release_kv(req)


def test_update_phases_are_reported(tiny_checkpoint):
    worker = make_worker(tiny_checkpoint("llama", seed=0))
    seen = []
    ok, _ = worker.model_runner.update_weights_from_disk(
        str(tiny_checkpoint("llama", seed=1, tokenizer=False)), recapture_cuda_graph=False, on_phase=seen.append
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
