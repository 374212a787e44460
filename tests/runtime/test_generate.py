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

    from shardline_runtime.managers.schedule_batch import Req, ScheduleBatch

    path = tiny_checkpoint("llama", seed=0)
    worker = make_worker(path)
    prompt = PROMPTS[0]
    req = Req("p", prompt, SamplingParams(max_new_tokens=0), return_logprob=True, logprob_start_len=0)
    batch = ScheduleBatch.init_new([req], worker)
    batch.prepare_for_extend()
    result = worker.forward_batch_generation(batch.get_model_worker_batch()).copy_to_cpu().wait()
    assert result.next_token_ids.tolist() == [-1]
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    expected = logits[:-1].gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
    got = result.logits_output.input_token_logprobs[0]
    assert torch.allclose(got, expected, atol=1e-4)
    batch.release_kv(req)


def test_repetition_penalty_matches_transformers(tiny_checkpoint):
    """Greedy with a repetition penalty (prompt + output tokens, CTRL rule) equals transformers'
    ``generate(repetition_penalty=...)``, with requests mixed in one batch with unpenalised ones."""
    import torch
    import transformers

    path = tiny_checkpoint("llama", seed=0)
    worker = make_worker(path)
    penalised = SamplingParams(temperature=0.0, max_new_tokens=16, repetition_penalty=1.5, ignore_eos=True)
    got = run_engine(worker, PROMPTS, [penalised, GREEDY_32, penalised, GREEDY_32])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for prompt, tokens in zip(PROMPTS[::2], got[::2]):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)
        assert tokens == ref[0, len(prompt):].tolist()
    assert got[1] == hf_greedy(path, [PROMPTS[1]], 32)[0]


def test_stop_token_ids_end_the_request(tiny_checkpoint):
    worker = make_worker(tiny_checkpoint("llama", seed=0))
    full = run_engine(worker, PROMPTS[:1], GREEDY_32)[0]
    stop_at = full[5]
    first = full.index(stop_at)
    params = SamplingParams(temperature=0.0, max_new_tokens=32, stop_token_ids=[stop_at], ignore_eos=True)
    assert run_engine(worker, PROMPTS[:1], params)[0] == full[: first + 1]
    # the model's EOS ends it too unless ignore_eos
    eos_params = SamplingParams(temperature=0.0, max_new_tokens=32)
    assert run_engine(worker, PROMPTS[:1], eos_params, eos_token_ids=[stop_at])[0] == full[: first + 1]
