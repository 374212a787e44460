"""PiecewiseCudaGraphRunner: token buckets, the padded static-buffer path (eager on CPU) equals
plain EXTEND, padded rows never touch the KV cache, real capture + weight update (gpu)."""

from __future__ import annotations

import pytest
import torch

import harness
from shardline_runtime.model_executor.device_graphs import DeviceGraphs
from shardline_runtime.model_executor.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner, get_token_buckets
from shardline_runtime.sampling import SamplingParams

from tests.runtime.engine_driver import make_worker, run_engine

PROMPTS = [[5, 17, 33, 80, 9, 41, 77, 300, 12, 8, 101, 4, 4], [7, 8], [300, 12, 55, 66, 77, 88]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)


def test_token_buckets():
    assert get_token_buckets(16) == [16]
    assert get_token_buckets(100) == [16, 32, 64, 100]
    assert get_token_buckets(4096)[-3:] == [1024, 2048, 4096]
    with pytest.raises(ValueError, match="piecewise_cuda_graph_max_tokens"):
        get_token_buckets(0)


def test_static_path_equals_plain_extend(tiny_checkpoint):
    runner = harness.make_runner(tiny_checkpoint("llama"))
    seqs = harness.new_seqs(runner, 2)
    plain_first = harness.extend(runner, seqs, [PROMPTS[0][:9], PROMPTS[1]]).next_token_logits
    plain_prefix = harness.extend(runner, seqs, [PROMPTS[0][9:], [3]], return_logprob=True)
    harness.release(runner, seqs)
    pw = PiecewiseCudaGraphRunner(runner, capture=False, token_buckets=[8, 16])
    runner.graphs = DeviceGraphs(runner, piecewise=pw)
    calls = []
    original = pw.replay
    pw.replay = lambda fb: calls.append(fb.num_tokens) or original(fb)
    seqs = harness.new_seqs(runner, 2)
    first = harness.extend(runner, seqs, [PROMPTS[0][:9], PROMPTS[1]]).next_token_logits  # 11 tokens -> bucket 16
    prefix = harness.extend(runner, seqs, [PROMPTS[0][9:], [3]], return_logprob=True)  # after a cached prefix
    assert calls == [11, 5]
    assert (first - plain_first).abs().max() <= 1e-5
    assert (prefix.next_token_logits - plain_prefix.next_token_logits).abs().max() <= 1e-5
    assert prefix.input_token_logprobs[0].numel() == 3
    for a, b in zip(prefix.input_token_logprobs, plain_prefix.input_token_logprobs):
        assert torch.allclose(a, b, atol=1e-5)
    assert pw.input_ids[5:8].eq(0).all() and pw.positions[5:8].eq(0).all()  # padding rows
    with pytest.raises(ValueError, match=r"\[1, 16\]"):
        pw.bucket(17)


def test_engine_with_piecewise_runner_matches_eager(tiny_checkpoint):
    """Mixed EXTEND+DECODE steps and chunked prefill through the pieces; steps above the largest
    bucket run eagerly. Padded rows write no KV slot (the driver checks no slot leaks)."""
    worker = make_worker(tiny_checkpoint("llama"))
    expected = run_engine(worker, PROMPTS, GREEDY)
    expected_chunked = run_engine(worker, PROMPTS, GREEDY, chunk=4)
    runner = worker.model_runner
    runner.graphs = DeviceGraphs(runner, piecewise=PiecewiseCudaGraphRunner(runner, capture=False, token_buckets=[4, 8]))
    pool = runner.token_to_kv_pool
    # A value no forward writes, in the dummy slot of every layer: a write of anything (zeros
    # included) by a padded row changes it.
    for buffers in (pool.k_buffer, pool.v_buffer):
        for layer_buffer in buffers:
            layer_buffer[0].fill_(7.25)
    assert run_engine(worker, PROMPTS, GREEDY) == expected
    assert run_engine(worker, PROMPTS, GREEDY, chunk=4) == expected_chunked
    for buffers in (pool.k_buffer, pool.v_buffer):
        for layer, layer_buffer in enumerate(buffers):
            assert layer_buffer[0].eq(7.25).all(), f"layer {layer}: a padded row wrote the dummy slot"


def test_flags_parse():
    from shardline_runtime.server_args import ServerArgs

    args = ServerArgs.from_cli(["--model-path", "/m", "--enable-piecewise-cuda-graph",
                                "--piecewise-cuda-graph-max-tokens", "512", "--attention-backend", "triton"])
    assert args.enable_piecewise_cuda_graph and args.piecewise_cuda_graph_max_tokens == 512
    assert args.attention_backend == "triton"
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--model-path", "/m", "--piecewise-cuda-graph-max-tokens", "0"])
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--model-path", "/m", "--attention-backend", "flashinfer"])


@pytest.mark.gpu
def test_real_piecewise_capture_matches_eager_and_recaptures_on_update(tiny_checkpoint):
    path_a, path_b = tiny_checkpoint("llama", seed=0), tiny_checkpoint("llama", seed=1)
    eager_a = run_engine(make_worker(path_a, device_override="cuda", disable_cuda_graph=True), PROMPTS, GREEDY)
    eager_b = run_engine(make_worker(path_b, device_override="cuda", disable_cuda_graph=True), PROMPTS, GREEDY)
    worker = make_worker(path_a, device_override="cuda", enable_piecewise_cuda_graph=True,
                         piecewise_cuda_graph_max_tokens=32, cuda_graph_max_bs=4)
    pw = worker.model_runner.graphs.piecewise
    assert pw is not None and pw.graphs[32] and len(pw.graphs[32]) == 3  # 2 layers -> 3 pieces
    calls = []
    original = pw.replay
    pw.replay = lambda fb: calls.append(fb.num_tokens) or original(fb)
    assert run_engine(worker, PROMPTS, GREEDY) == eager_a and calls
    old = [g for gs in pw.graphs.values() for g in gs]  # kept alive: ids cannot be reused
    ok, message = worker.update_weights_from_disk(str(path_b), recapture_cuda_graph=True)
    assert ok, message
    new = [g for gs in pw.graphs.values() for g in gs]
    assert len(new) == len(old) and not any(a is b for a in old for b in new)  # captured again
    assert run_engine(worker, PROMPTS, GREEDY) == eager_b
