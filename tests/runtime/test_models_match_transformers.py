"""Each architecture, run through ModelRunner (extend, cached-prefix extend, decode), gives the
logits transformers gives on the same tiny checkpoint (float32, max abs diff <= 1e-4)."""

import pytest
import torch

import harness

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
TOL = 1e-4
PROMPT = [5, 17, 200, 33, 9, 41, 77, 300, 12, 8, 101]


def reference(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def ref_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]  # (T, vocab)


@pytest.mark.parametrize("arch", ARCHS)
def test_extend_prefix_and_decode_match_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    runner = harness.make_runner(path)
    ref = reference(path)
    seqs = harness.new_seqs(runner, 1)
    first = harness.extend(runner, seqs, [PROMPT[:6]])
    # second extend reads the first 6 tokens from the KV cache (cached prefix)
    second = harness.extend(runner, seqs, [PROMPT[6:]])
    full = ref_logits(ref, PROMPT)
    assert first.next_token_logits.shape == (1, 512)
    assert (first.next_token_logits[0] - full[5]).abs().max() <= TOL
    assert (second.next_token_logits[0] - full[-1]).abs().max() <= TOL
    tokens = list(PROMPT)
    nxt = int(full[-1].argmax())
    for _ in range(4):
        out = harness.decode(runner, seqs, [nxt])
        tokens.append(nxt)
        expect = ref_logits(ref, tokens)[-1]
        assert (out.next_token_logits[0] - expect).abs().max() <= TOL
        nxt = int(expect.argmax())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_extend_and_decode_of_unequal_prompts(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    runner = harness.make_runner(path)
    ref = reference(path)
    prompts = [PROMPT, PROMPT[:3], [7, 7, 7, 7, 7]]
    seqs = harness.new_seqs(runner, 3)
    out = harness.extend(runner, seqs, prompts)
    for i, p in enumerate(prompts):
        assert (out.next_token_logits[i] - ref_logits(ref, p)[-1]).abs().max() <= TOL
    nxt = [11, 22, 33]
    out = harness.decode(runner, seqs, nxt)
    for i, p in enumerate(prompts):
        assert (out.next_token_logits[i] - ref_logits(ref, p + [nxt[i]])[-1]).abs().max() <= TOL


def test_prompt_logprobs_match_transformers(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    runner = harness.make_runner(path)
    ref = reference(path)
    seqs = harness.new_seqs(runner, 2)
    prompts = [PROMPT, PROMPT[:4]]
    out = harness.extend(runner, seqs, prompts, return_logprob=True, logprob_starts=[2, 0], top_logprobs_nums=[3, 0])
    lp = torch.log_softmax(ref_logits(ref, PROMPT), -1)
    expect = lp[2:-1].gather(1, torch.tensor(PROMPT[3:])[:, None]).squeeze(1)
    assert out.input_token_logprobs[0].shape == (len(PROMPT) - 3,)
    assert (out.input_token_logprobs[0] - expect).abs().max() <= TOL
    assert out.input_token_logprobs[1].shape == (3,)
    top_val, top_idx = lp[2:-1].topk(3, dim=-1)
    assert torch.equal(out.input_top_logprobs_idx[0], top_idx)
    assert (out.input_top_logprobs_val[0] - top_val).abs().max() <= TOL
    assert out.input_top_logprobs_val[1].shape == (3, 0)


def test_split_prefill_equals_extend(tiny_checkpoint):
    from shardline_runtime.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    path = tiny_checkpoint("llama")
    runner = harness.make_runner(path)
    seqs = harness.new_seqs(runner, 1)
    whole = harness.extend(runner, seqs, [PROMPT]).next_token_logits
    harness.release(runner, seqs)
    seqs = harness.new_seqs(runner, 1)
    slots = runner.token_to_kv_pool_allocator.alloc(len(PROMPT))
    runner.req_to_token_pool.write((seqs[0].row, slice(0, len(PROMPT))), slots)

    def step(start, end):
        fb = ForwardBatch.init_new(
            forward_mode=ForwardMode.SPLIT_PREFILL, input_ids=PROMPT, req_pool_indices=[seqs[0].row],
            seq_lens=[len(PROMPT)], out_cache_loc=slots, model_runner=runner,
            split_forward_start_layer=start, split_forward_end_layer=end,
        )
        return fb

    fb = step(0, 1)
    assert runner.forward(fb) is None
    fb.split_forward_start_layer, fb.split_forward_end_layer = 1, 2
    out = runner.forward(fb)
    assert (out.next_token_logits - whole).abs().max() <= TOL


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama", {"head_dim": 32}),
    ("mistral", {"head_dim": 8}),
    ("qwen3", {"attention_bias": True, "head_dim": 8}),
    ("qwen2", {"num_key_value_heads": 4}),
])
def test_config_variants_match_transformers(tiny_checkpoint, arch, overrides):
    path = tiny_checkpoint(arch, seed=5, **overrides)
    runner = harness.make_runner(path)
    ref = reference(path)
    seqs = harness.new_seqs(runner, 1)
    out = harness.extend(runner, seqs, [PROMPT])
    assert (out.next_token_logits[0] - ref_logits(ref, PROMPT)[-1]).abs().max() <= TOL
    out = harness.decode(runner, seqs, [42])
    assert (out.next_token_logits[0] - ref_logits(ref, PROMPT + [42])[-1]).abs().max() <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_runner_matches_transformers_and_sizes_pool(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    free_before, _ = torch.cuda.mem_get_info()
    # weights + KV cache may take 2% of the memory free before loading (the design notes' sizing)
    runner = harness.make_runner(path, device="cuda", max_total_tokens=None, mem_fraction_static=0.02,
                                 disable_cuda_graph=True)
    kv_bytes = runner.token_to_kv_pool.mem_usage_bytes()
    per_token = kv_bytes // (runner.max_total_num_tokens + 1)  # the pool also holds the dummy slot 0
    assert runner.max_total_num_tokens > 0 and 0 < kv_bytes - per_token <= 0.02 * free_before
    ref = reference(path)
    seqs = harness.new_seqs(runner, 1)
    harness.extend(runner, seqs, [PROMPT[:6]])
    out = harness.extend(runner, seqs, [PROMPT[6:]])
    assert (out.next_token_logits[0].cpu() - ref_logits(ref, PROMPT)[-1]).abs().max() <= 1e-3
    out = harness.decode(runner, seqs, [42])
    assert (out.next_token_logits[0].cpu() - ref_logits(ref, PROMPT + [42])[-1]).abs().max() <= 1e-3
