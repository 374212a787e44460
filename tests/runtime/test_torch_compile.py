"""``--enable-torch-compile`` on the CPU: the compiled decode forward (Inductor's C++ backend)
gives eager's logits, padded sizes included; after an in-place weight update it serves the new
weights; the flag refuses what it does not compose with; the graph report says which sizes run
compiled."""

from __future__ import annotations

import pytest
import torch

import harness
from shardline_runtime.server_args import ServerArgs, ServerArgsError

PROMPT = [5, 17, 200, 33, 9, 41, 77, 300, 12, 8, 101]
STEPS = ([3, 4, 5], [6, 7, 8])


def _decode_logits(runner) -> torch.Tensor:
    """Logits of two DECODE steps of 3 requests (padded to the compiled size 4), then of 1."""
    seqs = harness.new_seqs(runner, 3)
    harness.extend(runner, seqs, [PROMPT, PROMPT[:4], PROMPT[2:9]])
    out = [harness.decode(runner, seqs, toks).next_token_logits for toks in STEPS]
    harness.release(runner, seqs[1:])
    out.append(harness.decode(runner, seqs[:1], [9]).next_token_logits)
    harness.release(runner, seqs[:1])
    return torch.cat(out)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    paths = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"ckpt-compile-s{seed}")
        make_tiny_checkpoint(path, arch="llama", seed=seed)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def compiled_runner(checkpoints):
    from shardline_runtime.model_executor.torch_compile import cxx_compiler

    if cxx_compiler() is None:
        pytest.skip("Inductor's CPU backend needs a C++ compiler")
    return harness.make_runner(checkpoints[0], enable_torch_compile=True, torch_compile_max_bs=4)


@pytest.mark.slow  # Inductor compiles C++ (tens of seconds on a cold cache)
def test_compiled_decode_equals_eager(checkpoints, compiled_runner):
    eager = _decode_logits(harness.make_runner(checkpoints[0]))
    torch.testing.assert_close(_decode_logits(compiled_runner), eager, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_compiled_decode_serves_the_weights_of_an_in_place_update(checkpoints, compiled_runner):
    _decode_logits(compiled_runner)  # compiled against the first weights
    ok, message = compiled_runner.update_weights_from_disk(str(checkpoints[1]))
    assert ok, message
    expected = _decode_logits(harness.make_runner(checkpoints[1]))
    torch.testing.assert_close(_decode_logits(compiled_runner), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_the_graph_report_names_the_compiled_batch_sizes(compiled_runner):
    assert compiled_runner.graphs.report().torch_compile_batch_sizes == (1, 2, 4)


def test_the_graph_report_is_empty_of_compiled_sizes_without_the_flag(checkpoints):
    assert harness.make_runner(checkpoints[0]).graphs.report().torch_compile_batch_sizes == ()


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--disable-cuda-graph"], "--disable-cuda-graph"),
        (["--enable-lora"], "--enable-lora"),
        (["--pp-size", "2"], "--pp-size"),
        (["--eplb-rebalance-num-iterations", "10"], "--eplb-rebalance-num-iterations"),
    ],
)
def test_torch_compile_refuses_flags_it_does_not_compose_with(flags, named):
    with pytest.raises(ServerArgsError, match=f"--enable-torch-compile.*{named}"):
        ServerArgs.from_cli(["--model-path", "/m", "--enable-torch-compile", *flags])


def test_torch_compile_max_bs_below_one_is_refused():
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--model-path", "/m", "--torch-compile-max-bs", "0"])
