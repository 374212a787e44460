"""CudaGraphRunner: batch sizes, padding into static buffers (eager on CPU), real capture (gpu)."""

from __future__ import annotations

import pytest
import torch

from shardline_runtime.mem_cache.memory_pool import DUMMY_SLOT
from shardline_runtime.model_executor.cuda_graph_runner import CudaGraphRunner, get_batch_sizes_to_capture
from shardline_runtime.model_executor.device_graphs import DeviceGraphs
from shardline_runtime.sampling import SamplingParams

from tests.runtime.engine_driver import make_worker, run_engine

PROMPTS = [[5, 17, 33, 80, 9], [7, 8], [300, 12, 55, 66, 77, 88], [42, 43, 44, 45], [1, 2, 3]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


def test_batch_sizes_to_capture():
    assert get_batch_sizes_to_capture(1) == [1]
    assert get_batch_sizes_to_capture(20) == [1, 2, 4, 8, 16, 20]
    assert get_batch_sizes_to_capture(160)[-3:] == [144, 152, 160]
    assert get_batch_sizes_to_capture(160, max_running_requests=6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        get_batch_sizes_to_capture(0)


def attach_static_runner(worker, batch_sizes=(1, 2, 4)):
    runner = CudaGraphRunner(worker.model_runner, capture=False, batch_sizes=list(batch_sizes))
    worker.model_runner.graphs = DeviceGraphs(worker.model_runner, decode=runner)
    return runner


def test_static_path_with_padding_matches_eager(tiny_checkpoint):
    path = tiny_checkpoint("llama", seed=0)
    worker = make_worker(path)
    eager_3 = run_engine(worker, PROMPTS[:3], GREEDY)
    eager_5 = run_engine(worker, PROMPTS, GREEDY)
    runner = attach_static_runner(worker)
    calls = []
    original = runner.replay
    runner.replay = lambda fb: calls.append(fb.batch_size) or original(fb)
    assert run_engine(worker, PROMPTS[:3], GREEDY) == eager_3  # decode bs 3 pads to 4
    assert 3 in calls and max(calls) <= 4
    calls.clear()
    assert run_engine(worker, PROMPTS, GREEDY) == eager_5  # eager == transformers: test_generate.py
    assert calls and 5 not in calls  # bs 5 > max captured 4 ran eagerly; smaller ones replayed


def test_padded_rows_touch_only_the_dummy_slot(tiny_checkpoint):
    worker = make_worker(tiny_checkpoint("llama", seed=0))
    runner = attach_static_runner(worker, batch_sizes=[8])
    pool = worker.model_runner.token_to_kv_pool
    before = [k.clone() for k in pool.k_buffer]
    run_engine(worker, PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=3))
    slots_written = {int(s) for s in torch.nonzero((pool.k_buffer[0] != before[0]).any(-1).any(-1)).flatten()}
    # one request: prompt 5 + 2 decode tokens = 7 real slots; the 7 padded rows only ever
    # address the dummy slot (its content may stay zero: the pad token's embedding is zero)
    assert len(slots_written - {DUMMY_SLOT}) == 7
    assert runner.out_cache_loc[1:].eq(DUMMY_SLOT).all() and runner.seq_lens[1:].eq(1).all()
    assert runner.req_pool_indices[1:].eq(runner.dummy_req_row).all()
    assert runner.padded_batch_size(1) == 8
    assert worker.model_runner.req_to_token_pool.req_to_token[runner.dummy_req_row].eq(DUMMY_SLOT).all()


def test_padded_batch_size_bounds(tiny_checkpoint):
    worker = make_worker(tiny_checkpoint("llama", seed=0))
    runner = attach_static_runner(worker)
    assert [runner.padded_batch_size(b) for b in (1, 2, 3, 4)] == [1, 2, 4, 4]
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        runner.padded_batch_size(5)


@pytest.mark.gpu
def test_real_capture_matches_eager_on_cuda(tiny_checkpoint):
    path = tiny_checkpoint("llama", seed=0)
    eager = make_worker(path, device_override="cuda", disable_cuda_graph=True)
    graphs = make_worker(path, device_override="cuda", cuda_graph_max_bs=8)
    assert graphs.model_runner.graphs.decode is not None
    assert graphs.model_runner.graphs.decode.graphs
    expected = run_engine(eager, PROMPTS, GREEDY, mixed=False)
    assert run_engine(graphs, PROMPTS, GREEDY, mixed=False) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("backend, kv_cache_dtype", [("triton", "auto"), ("torch_native", "auto"), ("triton", "fp8_e4m3")])
def test_decode_graphs_per_backend_and_kv_dtype_on_cuda(tiny_checkpoint, backend, kv_cache_dtype):
    """Captured decode == eager decode for each backend (and an fp8 cache); with triton the
    graph reads kv_indptr / kv_indices refilled before each replay (no bound baked in)."""
    path = tiny_checkpoint("llama", seed=0)
    kwargs = dict(device_override="cuda", attention_backend=backend, kv_cache_dtype=kv_cache_dtype)
    eager = make_worker(path, disable_cuda_graph=True, **kwargs)
    graphs = make_worker(path, cuda_graph_max_bs=8, **kwargs)
    assert type(graphs.model_runner.attn_backend).__name__.lower().startswith(backend.replace("_", ""))
    expected = run_engine(eager, PROMPTS, GREEDY, mixed=False)
    assert run_engine(graphs, PROMPTS, GREEDY, mixed=False) == expected
    if kv_cache_dtype == "fp8_e4m3":  # agreement with a full-precision cache: test_kv_cache_dtype.py
        assert graphs.model_runner.token_to_kv_pool.dtype == torch.float8_e4m3fn
        assert graphs.model_runner.token_to_kv_pool.k_buffer[0].element_size() == 1
