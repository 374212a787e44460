"""DeviceGraphs: the one table of when a graph may run, and its CPU static-buffer path."""

from __future__ import annotations

import pytest
import torch

from shardline_runtime.model_executor.cuda_graph_runner import CudaGraphRunner
from shardline_runtime.model_executor.device_graphs import DeviceGraphs, graphs_blocked_by, replay_kind
from shardline_runtime.model_executor.forward_batch_info import ForwardMode
from shardline_runtime.model_executor.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner
from shardline_runtime.sampling import SamplingParams

from tests.runtime.engine_driver import make_worker, run_engine

PROMPTS = [[5, 17, 33, 80, 9], [7, 8], [300, 12, 55, 66, 77, 88]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.mark.parametrize(
    "mode, facts, expected",
    [
        (ForwardMode.DECODE, {}, "decode"),
        (ForwardMode.EXTEND, {}, "piecewise"),
        (ForwardMode.IDLE, {}, None),
        (ForwardMode.SPLIT_PREFILL, {}, None),
        (ForwardMode.DECODE, {"pp_size": 2}, "decode"),
        (ForwardMode.EXTEND, {"pp_size": 2}, None),
        (ForwardMode.DECODE, {"lora": True}, "decode"),
        (ForwardMode.EXTEND, {"lora": True}, None),
        (ForwardMode.DECODE, {"dynamic_rope": True}, None),
        (ForwardMode.EXTEND, {"dynamic_rope": True}, None),
        (ForwardMode.DECODE, {"recording": True}, "decode"),
        (ForwardMode.DECODE, {"lora": True, "recording": True}, "decode"),
        (ForwardMode.EXTEND, {"recording": True}, None),
        (ForwardMode.EXTEND, {"input_embeds": True}, None),
        (ForwardMode.DECODE, {"input_embeds": True}, "decode"),
        (ForwardMode.TARGET_VERIFY, {}, "verify"),
        (ForwardMode.TARGET_VERIFY, {"lora": True}, None),
        (ForwardMode.TARGET_VERIFY, {"recording": True}, None),
        (ForwardMode.TARGET_VERIFY, {"pp_size": 2}, None),
        (ForwardMode.TARGET_VERIFY, {"dynamic_rope": True}, None),
    ],
)
def test_eligibility_table(mode, facts, expected):
    assert replay_kind(mode, **facts) == expected


@pytest.mark.parametrize("dynamic_rope, fragment", [(False, None), (True, "dynamic")])
def test_what_keeps_graphs_from_being_captured(dynamic_rope, fragment):
    reason = graphs_blocked_by(dynamic_rope)
    assert (reason is None) if fragment is None else (fragment in reason)


def test_a_cpu_runner_builds_no_graphs(tiny_checkpoint):
    worker = make_worker(tiny_checkpoint("llama", seed=0))
    assert not worker.model_runner.graphs.present


def test_cpu_static_buffer_decode_path_equals_eager(tiny_checkpoint):
    worker = make_worker(tiny_checkpoint("llama", seed=0))
    runner = worker.model_runner
    eager = run_engine(worker, PROMPTS, GREEDY)
    decode = CudaGraphRunner(runner, capture=False, batch_sizes=[1, 2, 4])
    runner.graphs = DeviceGraphs(runner, decode=decode)
    replayed = []
    original = decode.replay
    decode.replay = lambda fb: replayed.append(fb.batch_size) or original(fb)
    assert run_engine(worker, PROMPTS, GREEDY) == eager
    assert replayed  # the static path ran (bs 3 padded to 4)


def test_cpu_static_buffer_piecewise_path_equals_eager(tiny_checkpoint):
    worker = make_worker(tiny_checkpoint("llama", seed=0))
    runner = worker.model_runner
    eager = run_engine(worker, PROMPTS, GREEDY, mixed=False)
    pieces = PiecewiseCudaGraphRunner(runner, capture=False, token_buckets=[8, 16])
    runner.graphs = DeviceGraphs(runner, piecewise=pieces)
    replayed = []
    original = pieces.replay
    pieces.replay = lambda fb: replayed.append(fb.num_tokens) or original(fb)
    assert run_engine(worker, PROMPTS, GREEDY, mixed=False) == eager
    assert replayed


def _record(worker, static: bool):
    """Greedy tokens and the expert record of PROMPTS, decode through the static-buffer path or
    eagerly; returns (tokens, physical counts, passes recorded, decode steps replayed)."""
    runner = worker.model_runner
    replayed = []
    if static:
        decode = CudaGraphRunner(runner, capture=False, batch_sizes=[1, 2, 4])
        original = decode.replay
        decode.replay = lambda fb: replayed.append(fb.batch_size) or original(fb)
        runner.graphs = DeviceGraphs(runner, decode=decode)
    recorder = runner.eplb_manager.recorder
    recorder.start()
    tokens = run_engine(worker, PROMPTS, GREEDY)
    recorder.stop()
    return tokens, recorder.physical_counts(), recorder.to_dict(
        runner.eplb_manager.physical_to_logical(), runner.eplb_manager.num_experts
    )["num_forward_passes"], replayed


@pytest.fixture(scope="module")
def moe_records(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", seed=0)
    return _record(make_worker(path), static=False), _record(make_worker(path), static=True)


def test_recording_experts_replays_the_decode_graph_path(moe_records):
    assert moe_records[1][3]  # the decode steps went through the static buffers (bs 3 padded to 4)


def test_recording_through_the_graph_path_gives_the_eager_tokens(moe_records):
    assert moe_records[1][0] == moe_records[0][0]


def test_recording_through_the_graph_path_gives_the_eager_counts(moe_records):
    """Padded rows (bs 3 runs the graph of 4) are masked out of the counts."""
    assert torch.equal(moe_records[1][1], moe_records[0][1])


def test_recording_through_the_graph_path_counts_every_pass(moe_records):
    assert moe_records[1][2] == moe_records[0][2]


def test_a_graph_step_while_nothing_records_leaves_the_next_record_clean(tiny_checkpoint):
    """A captured graph always writes counts; a record started later holds only its own."""
    worker = make_worker(tiny_checkpoint("qwen3_moe", seed=0))
    runner = worker.model_runner
    runner.graphs = DeviceGraphs(runner, decode=CudaGraphRunner(runner, capture=False, batch_sizes=[4]))
    run_engine(worker, PROMPTS, GREEDY)  # nothing records
    runner.eplb_manager.recorder.start()
    assert int(runner.eplb_manager.recorder.physical_counts().sum()) == 0


def test_release_drops_the_runners_and_resume_brings_them_back(tiny_checkpoint):
    worker = make_worker(tiny_checkpoint("llama", seed=0))
    runner = worker.model_runner
    decode = CudaGraphRunner(runner, capture=False, batch_sizes=[1, 2])
    graphs = DeviceGraphs(runner, decode=decode)
    graphs.release()
    assert graphs.decode is None
    graphs.resume()
    assert graphs.decode is decode


def test_a_memory_release_goes_through_the_graphs(tiny_checkpoint):
    worker = make_worker(tiny_checkpoint("llama", seed=0), enable_weights_cpu_backup=True)
    runner = worker.model_runner
    decode = CudaGraphRunner(runner, capture=False, batch_sizes=[1, 2])
    runner.graphs = DeviceGraphs(runner, decode=decode)
    runner.memory_saver.release(["cuda_graph"])
    assert not runner.graphs.present
    runner.memory_saver.resume(["cuda_graph"])
    assert runner.graphs.decode is decode


def test_a_cpu_runner_reports_that_it_captured_nothing_and_why(tiny_checkpoint):
    report = make_worker(tiny_checkpoint("llama", seed=0)).captured_graphs()
    assert (report.decode_batch_sizes, report.reason) == ((), "cpu: no CUDA graphs")


def test_the_static_buffer_path_is_not_reported_as_captured(tiny_checkpoint):
    """A runner built with ``capture=False`` (the CPU path) holds buffers but no graph."""
    worker = make_worker(tiny_checkpoint("llama", seed=0))
    runner = worker.model_runner
    runner.graphs = DeviceGraphs(runner, decode=CudaGraphRunner(runner, capture=False, batch_sizes=[1, 2]))
    assert runner.graphs.report().captured is False


def test_the_report_lists_the_batch_sizes_that_hold_a_graph(tiny_checkpoint):
    worker = make_worker(tiny_checkpoint("llama", seed=0))
    runner = worker.model_runner
    decode = CudaGraphRunner(runner, capture=False, batch_sizes=[1, 2, 4])
    decode.graphs = {4: object(), 1: object()}  # what capture() leaves behind on a GPU
    runner.graphs = DeviceGraphs(runner, decode=decode)
    assert runner.graphs.report().decode_batch_sizes == (1, 4)


def test_a_released_runner_reports_why_it_holds_no_graph(tiny_checkpoint):
    worker = make_worker(tiny_checkpoint("llama", seed=0))
    runner = worker.model_runner
    graphs = DeviceGraphs(runner, decode=CudaGraphRunner(runner, capture=False, batch_sizes=[1]))
    graphs.release()
    assert graphs.report().reason == "released with the GPU memory"
