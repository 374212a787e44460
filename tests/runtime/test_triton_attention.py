"""Triton attention backend == torch_native backend (and a whole model == transformers).

Runs where Triton kernels can run: under Triton's interpreter on CPU (``TRITON_INTERPRET=1``
set before ``triton`` is imported; ``test_triton_interpreter.py`` starts this module in a
subprocess with it), or on CUDA (``bench/gpu_check.sh``). Anywhere else it skips itself, so the
interpreter never leaks into the rest of the suite. Cases stay small: the interpreter runs each
program instance in Python.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(),
    reason="needs TRITON_INTERPRET=1 (see test_triton_interpreter.py) or a CUDA device",
)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")

from shardline_runtime.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from shardline_runtime.layers.radix_attention import RadixAttention  # noqa: E402
from shardline_runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool  # noqa: E402
from shardline_runtime.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

LENS = [1, 7, 64, 300]


def make_runner(hkv: int, d: int, dtype=torch.float32, kv_dtype=None, size: int = 800):
    runner = SimpleNamespace(device=DEVICE)
    runner.req_to_token_pool = ReqToTokenPool(8, 512, device=DEVICE)
    runner.token_to_kv_pool = TokenToKVPool(size, 1, hkv, d, kv_dtype or dtype, device=DEVICE)
    return runner


def backends(runner):
    from shardline_runtime.attention.triton_backend import TritonAttnBackend

    return TorchNativeAttnBackend(runner), TritonAttnBackend(runner, num_kv_splits=4)


def place(runner, lens, gen):
    """Give request i row i+1 and random distinct slots for ``lens[i]`` tokens."""
    slots = torch.randperm(runner.token_to_kv_pool.size, generator=gen)[: sum(lens)] + 1
    rows, start = [], 0
    for i, n in enumerate(lens):
        runner.req_to_token_pool.req_to_token[i + 1, :n] = slots[start:start + n].to(DEVICE)
        rows.append(i + 1)
        start += n
    return rows


def run_both(runner, fb_args, layer, q, k, v):
    """Run both backends on identical copies of the pool; returns (torch_native, triton) outputs."""
    pool = runner.token_to_kv_pool
    saved = [b.clone() for b in pool.k_buffer_head_major + pool.v_buffer_head_major]
    outs = []
    for backend in backends(runner):
        for b, s in zip(pool.k_buffer_head_major + pool.v_buffer_head_major, saved):
            b.copy_(s)
        fb = ForwardBatch.init_new(model_runner=runner, device=DEVICE, **fb_args)
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(q, k, v, layer, fb).float())
    return outs


def random_kv(runner, gen, scale=1.0):
    pool = runner.token_to_kv_pool
    for b in pool.k_buffer_head_major + pool.v_buffer_head_major:
        b.copy_((torch.randn(b.shape, generator=gen) * scale).to(b.dtype))


CASES = [  # (query heads, KV heads, head_dim, sliding window)
    (2, 2, 64, None),   # GQA ratio 1
    (4, 1, 128, None),  # ratio 4, head_dim 128
    (8, 1, 64, 37),     # ratio 8, sliding window
]


@pytest.mark.parametrize("hq, hkv, d, window", CASES)
def test_decode_kernel_matches_torch_native(hq, hkv, d, window):
    gen = torch.Generator().manual_seed(hq * 100 + d)
    runner = make_runner(hkv, d)
    random_kv(runner, gen)
    rows = place(runner, LENS, gen)
    layer = RadixAttention(hq, d, d ** -0.5, hkv, 0, sliding_window=window)
    bs = len(LENS)
    loc = [int(runner.req_to_token_pool.req_to_token[r, n - 1]) for r, n in zip(rows, LENS)]
    q = torch.randn(bs, hq * d, generator=gen).to(DEVICE)
    k = torch.randn(bs, hkv * d, generator=gen).to(DEVICE)
    v = torch.randn(bs, hkv * d, generator=gen).to(DEVICE)
    args = dict(forward_mode=ForwardMode.DECODE, input_ids=[1] * bs, req_pool_indices=rows, seq_lens=LENS,
                out_cache_loc=loc)
    ref, got = run_both(runner, args, layer, q, k, v)
    assert (got - ref).abs().max() <= 2e-5


@pytest.mark.parametrize("hq, hkv, d, window", CASES)
def test_extend_kernel_matches_torch_native(hq, hkv, d, window):
    gen = torch.Generator().manual_seed(hq * 10 + d)
    runner = make_runner(hkv, d)
    random_kv(runner, gen)  # the prefixes' cached K/V
    rows = place(runner, LENS, gen)
    prefix = [0, 3, 0, 260]  # prefix 0 and > 0; new parts 1, 4, 64, 40
    ext = [n - p for n, p in zip(LENS, prefix)]
    r2t = runner.req_to_token_pool.req_to_token
    loc = torch.cat([r2t[r, p:n] for r, p, n in zip(rows, prefix, LENS)]).tolist()
    t = sum(ext)
    q = torch.randn(t, hq * d, generator=gen).to(DEVICE)
    k = torch.randn(t, hkv * d, generator=gen).to(DEVICE)
    v = torch.randn(t, hkv * d, generator=gen).to(DEVICE)
    args = dict(forward_mode=ForwardMode.EXTEND, input_ids=[1] * t, req_pool_indices=rows, seq_lens=LENS,
                extend_prefix_lens=prefix, out_cache_loc=loc)
    ref, got = run_both(runner, args, RadixAttention(hq, d, d ** -0.5, hkv, 0, sliding_window=window), q, k, v)
    assert (got - ref).abs().max() <= 2e-5


@pytest.mark.parametrize("window", [None, 5])
def test_verify_graph_layout_matches_eager_extend(window):
    """TARGET_VERIFY through a graph's static layout (``VerifyLayout``: ``n`` rows per request,
    fewer real ones padded, a padded request on the dummy row) gives, on both backends, the
    eager EXTEND output on the real rows, and finite padded rows."""
    from shardline_runtime.attention.base import VerifyLayout

    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, n = 4, 2, 64, 4
    runner = make_runner(hkv, d)
    random_kv(runner, gen)
    lens = [9, 40, 6]
    rows = place(runner, lens, gen)
    ext = [1, 4, 3]  # a request without drafts, a full one, one with fewer drafts
    prefix = [seq - e for seq, e in zip(lens, ext)]
    r2t = runner.req_to_token_pool.req_to_token
    loc = torch.cat([r2t[r, p:q] for r, p, q in zip(rows, prefix, lens)])
    t = sum(ext)
    q = torch.randn(t, hq * d, generator=gen).to(DEVICE)
    k = torch.randn(t, hkv * d, generator=gen).to(DEVICE)
    v = torch.randn(t, hkv * d, generator=gen).to(DEVICE)
    layer = RadixAttention(hq, d, d ** -0.5, hkv, 0, sliding_window=window)
    args = dict(forward_mode=ForwardMode.TARGET_VERIFY, input_ids=[1] * t, req_pool_indices=rows, seq_lens=lens,
                extend_prefix_lens=prefix, out_cache_loc=loc.tolist())
    ref, _ = run_both(runner, args, layer, q, k, v)
    bs, dummy = 4, 7  # the 4th request pads the batch on row 7 (all slot 0)
    index = torch.tensor([i * n + j for i, e in enumerate(ext) for j in range(e)], device=DEVICE)

    def padded(x):
        return torch.zeros(bs * n, x.shape[1], dtype=x.dtype, device=DEVICE).index_copy_(0, index, x)

    def long(values):
        return torch.tensor(values, dtype=torch.int64, device=DEVICE)

    layout = VerifyLayout(bs=bs, tokens_per_req=n, req_pool_indices=long(rows + [dummy]),
                          prefix_lens=long(prefix + [0]), extend_lens=long(ext + [1]),
                          q_start_loc=torch.arange(bs, device=DEVICE) * n)
    out_loc = torch.zeros(bs * n, dtype=torch.int64, device=DEVICE).index_copy_(0, index, loc.to(DEVICE))
    pool = runner.token_to_kv_pool
    saved = [b.clone() for b in pool.k_buffer_head_major + pool.v_buffer_head_major]
    for backend in backends(runner):
        for b, s in zip(pool.k_buffer_head_major + pool.v_buffer_head_major, saved):
            b.copy_(s)
        fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=long([0] * (bs * n)),
                          positions=long([0] * (bs * n)), req_pool_indices=layout.req_pool_indices,
                          seq_lens=long(lens + [1]), out_cache_loc=out_loc, extend_seq_lens=layout.extend_lens,
                          extend_prefix_lens=layout.prefix_lens, req_to_token_pool=runner.req_to_token_pool,
                          token_to_kv_pool=pool, attn_backend=backend)
        backend.init_forward_metadata_verify_graph(layout)
        out = backend.forward(padded(q), padded(k), padded(v), layer, fb).float()
        assert torch.isfinite(out).all(), type(backend).__name__
        assert (out[index] - ref).abs().max() <= 2e-5, type(backend).__name__


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pool_matches_torch_native(kv_dtype):
    """Both backends read the same fp8 cache through k_scale / v_scale."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d = 4, 2, 64
    runner = make_runner(hkv, d, kv_dtype=kv_dtype)
    random_kv(runner, gen, scale=0.5)
    rows = place(runner, [9, 70], gen)
    layer = RadixAttention(hq, d, d ** -0.5, hkv, 0)
    layer.k_scale, layer.v_scale = 0.5, 0.25
    loc = [int(runner.req_to_token_pool.req_to_token[r, n - 1]) for r, n in zip(rows, [9, 70])]
    q = torch.randn(2, hq * d, generator=gen).to(DEVICE)
    kv = torch.randn(2, hkv * d, generator=gen).to(DEVICE)
    args = dict(forward_mode=ForwardMode.DECODE, input_ids=[1, 1], req_pool_indices=rows, seq_lens=[9, 70],
                out_cache_loc=loc)
    ref, got = run_both(runner, args, layer, q, kv, kv)
    assert (got - ref).abs().max() <= 2e-5


PROMPTS = [[5, 17, 33, 80, 9, 41, 77], [7, 8], [300, 12, 55, 66, 77, 88, 99, 3, 4, 5, 6]]


def test_tiny_model_triton_equals_transformers_and_torch_native(tiny_checkpoint):
    """Greedy tokens: triton backend == transformers == torch_native (float32), through the
    scheduler-shaped driver (mixed EXTEND + DECODE steps), then the decode-graph static path."""
    from shardline_runtime.model_executor.cuda_graph_runner import CudaGraphRunner
    from shardline_runtime.model_executor.device_graphs import DeviceGraphs
    from shardline_runtime.sampling import SamplingParams
    from tests.runtime.engine_driver import hf_greedy, make_worker, run_engine

    path = tiny_checkpoint("llama", seed=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    worker = make_worker(path, device_override=DEVICE.type, attention_backend="triton", dtype="float32",
                         disable_cuda_graph=True)
    assert type(worker.model_runner.attn_backend).__name__ == "TritonAttnBackend"
    triton_tokens = run_engine(worker, PROMPTS, params)
    assert triton_tokens == hf_greedy(path, PROMPTS, 5)
    native = make_worker(path, device_override=DEVICE.type, attention_backend="torch_native", dtype="float32",
                         disable_cuda_graph=True)
    assert run_engine(native, PROMPTS, params) == triton_tokens
    # graph-safe decode metadata: static kv_indptr / kv_indices refilled per replay (eager on CPU)
    runner = worker.model_runner
    runner.graphs = DeviceGraphs(runner, decode=CudaGraphRunner(runner, capture=DEVICE.type == "cuda", batch_sizes=[1, 4]))
    assert run_engine(worker, PROMPTS, params, mixed=False) == triton_tokens
    assert worker.model_runner.attn_backend.cuda_graph_kv_indices.shape[0] == 4 * worker.model_runner.req_to_token_pool.max_context_len
