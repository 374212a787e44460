"""End to end through TpModelWorker: greedy tokens equal transformers ``generate``; seeds."""

from __future__ import annotations

import pytest

from shardline_runtime.sampling import SamplingParams

from tests.runtime.engine_driver import hf_greedy, make_worker, run_engine

PROMPTS = [[5, 17, 33, 80, 9, 100, 41], [7, 8], [300, 12, 55, 66, 77, 88, 99, 110, 120, 130, 140], [42, 43, 44, 45]]
GREEDY_32 = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_batch_matches_transformers_generate(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch, seed=0)
    worker = make_worker(path)
    got = run_engine(worker, PROMPTS, GREEDY_32, mixed=True)
    assert got == hf_greedy(path, PROMPTS, 32)


def test_chunked_prefill_and_unmixed_steps_give_same_tokens(tiny_checkpoint):
    path = tiny_checkpoint("llama", seed=0)
    worker = make_worker(path)
    reference = run_engine(worker, PROMPTS, GREEDY_32, mixed=True)
    assert run_engine(worker, PROMPTS, GREEDY_32, mixed=False, chunk=3) == reference


def test_seeded_request_same_alone_and_batched(tiny_checkpoint):
    path = tiny_checkpoint("llama", seed=0)
    worker = make_worker(path)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, seed=2024, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    alone = run_engine(worker, [PROMPTS[0]], [seeded])[0]
    batched = run_engine(worker, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], [unseeded, seeded, unseeded])[1]
    assert batched == alone
    assert len(set(alone)) > 1  # it really sampled


def test_prefill_only_request_returns_prompt_logprobs(tiny_checkpoint):
    import torch

    from shardline_runtime.managers.schedule_batch import Req

    path = tiny_checkpoint("llama", seed=0)
    worker = make_worker(path)
    prompt = PROMPTS[0]
    req = Req("p", prompt, SamplingParams(max_new_tokens=0), return_logprob=True, logprob_start_len=0)
    batch = worker.new_batch([req])
    batch.prepare_for_extend()
    result = worker.forward_batch_generation(batch)
    assert result.next_token_ids.tolist() == [-1]
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    expected = logits[:-1].gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
    got = result.logits_output.input_token_logprobs[0]
    assert torch.allclose(got, expected, atol=1e-4)
    batch.release_kv(req)
