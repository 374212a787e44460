"""Torch-native attention backend: decode reads lengths/indices from tensors (a fixed graph
bound gives the eager result), sliding windows match transformers, IDLE steps run empty."""

import pytest
import torch

import harness
from shardline_runtime.model_executor.forward_batch_info import ForwardBatch, ForwardMode

PROMPT = [5, 17, 200, 33, 9, 41, 77, 300, 12, 8, 101]


def test_decode_with_fixed_graph_bound_equals_eager(tiny_checkpoint):
    runner = harness.make_runner(tiny_checkpoint("llama"))
    seqs = harness.new_seqs(runner, 2)
    harness.extend(runner, seqs, [PROMPT, PROMPT[:4]])
    eager = harness.decode(runner, seqs, [3, 4]).next_token_logits
    assert runner.attn_backend.forward_metadata.kv_len_bound == len(PROMPT) + 1

    # replay the same decode step with the bound a captured graph uses (whole req_to_token row):
    # only tensors (seq_lens, req_pool_indices) say how many keys each request has
    fb = ForwardBatch.init_new(
        forward_mode=ForwardMode.DECODE, input_ids=[3, 4], req_pool_indices=[s.row for s in seqs],
        seq_lens=[len(s.tokens) for s in seqs], out_cache_loc=[seqs[0].slots[-1], seqs[1].slots[-1]],
        model_runner=runner,
    )
    runner.attn_backend.init_forward_metadata_capture_cuda_graph()
    assert runner.attn_backend.forward_metadata.kv_len_bound == runner.req_to_token_pool.max_context_len
    with torch.inference_mode():
        graph_like = runner.model.forward(fb.input_ids, fb.positions, fb).next_token_logits
    assert (graph_like - eager).abs().max() <= 1e-5


@pytest.mark.parametrize("arch, overrides", [
    ("mistral", {"sliding_window": 4}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}),
])
def test_sliding_window_matches_transformers(tiny_checkpoint, arch, overrides):
    import transformers

    path = tiny_checkpoint(arch, **overrides)
    runner = harness.make_runner(path)
    assert any(w is not None for w in runner.model_config.sliding_windows)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    seqs = harness.new_seqs(runner, 1)
    out = harness.extend(runner, seqs, [PROMPT])
    with torch.no_grad():
        first = ref(torch.tensor([PROMPT]), use_cache=True)
    assert (out.next_token_logits[0] - first.logits[0, -1]).abs().max() <= 1e-4
    tokens = list(PROMPT)
    for nxt in (7, 8, 9):
        out = harness.decode(runner, seqs, [nxt])
        tokens.append(nxt)
        with torch.no_grad():
            expect = ref(torch.tensor([tokens])).logits[0, -1]
        assert (out.next_token_logits[0] - expect).abs().max() <= 1e-4


def test_idle_step_runs_without_tokens(tiny_checkpoint):
    runner = harness.make_runner(tiny_checkpoint("llama"))
    fb = ForwardBatch.init_new(forward_mode=ForwardMode.IDLE, input_ids=[], req_pool_indices=[], seq_lens=[],
                               out_cache_loc=[], model_runner=runner)
    out = runner.forward(fb)
    assert out.next_token_logits.shape == (0, 512)
