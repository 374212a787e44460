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


@pytest.mark.parametrize("hq, hkv", [(4, 2), (3, 3)])
def test_cpu_decode_attention_equals_sdpa_per_request(hq, hkv):
    import torch.nn.functional as F

    from shardline_runtime.attention.paged_decode import DecodeScratch, decode_attention_cpu

    g = torch.Generator().manual_seed(0)
    bs, d, bound, size = 3, 8, 7, 40
    k_pool, v_pool = torch.randn(hkv, size + 1, d, generator=g), torch.randn(hkv, size + 1, d, generator=g)
    slots = torch.randperm(size, generator=g)[: bs * bound].view(bs, bound) + 1
    lens = [7, 2, 5]
    bias = torch.zeros(bs, bound)
    for i, n in enumerate(lens):
        bias[i, n:] = float("-inf")
    q = torch.randn(bs, hq, d, generator=g)
    for scratch in (DecodeScratch(), DecodeScratch(max_bytes=0)):  # reused buffers / fresh ones
        for _ in range(2):  # the second call reuses the scratch buffers
            out = decode_attention_cpu(q, k_pool, v_pool, slots.reshape(-1), bias, 0.3, scratch)
            for i, n in enumerate(lens):
                k, v = k_pool[:, slots[i, :n]], v_pool[:, slots[i, :n]]  # (Hkv, n, D)
                ref = F.scaled_dot_product_attention(q[i][:, None], k, v, scale=0.3, enable_gqa=True)[:, 0]
                assert torch.allclose(out[i], ref, atol=1e-6)


def test_decode_scratch_views_are_reused_per_shape_and_writable_in_and_out_of_inference_mode():
    from shardline_runtime.attention.paged_decode import DecodeScratch

    scratch = DecodeScratch()
    with torch.inference_mode():  # the scheduler's mode
        k, v = scratch.kv((2, 6, 4), torch.float32, torch.device("cpu"))
        k_again, v_again = scratch.kv((2, 6, 4), torch.float32, torch.device("cpu"))
        assert k_again is k and v_again is v  # the next layer gets the same views
        k.fill_(1.0)
    v.fill_(2.0)  # a test's forward outside inference mode writes the views made inside it
    assert k.sum().item() == 48 and v.sum().item() == 96
    k2, v2 = scratch.kv((2, 8, 4), torch.float32, torch.device("cpu"))  # a longer step: new views
    assert k2.shape == (2, 8, 4) and k2.data_ptr() != v2.data_ptr()
    assert not k2.is_inference()
