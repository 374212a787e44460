"""Claims of docs/api.md that no other test checked, each against a real server: default
``max_tokens``, the chat prompt, ``skip_special_tokens`` and ``/flush_cache``."""

from __future__ import annotations

import threading
import time

import pytest
from serving_server import SMALL_CONTEXT, wait_for_baseline


def _ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_default_max_tokens_is_16(server):
    out = _ok(server.post("/v1/completions", {"prompt": "hello world", "temperature": 0, "ignore_eos": True}))
    assert out["usage"]["completion_tokens"] == 16
    assert out["choices"][0]["finish_reason"] == "length"


def test_chat_default_max_tokens_is_what_fits_the_context(small_ctx_server):
    body = {"messages": [{"role": "user", "content": "hello world"}], "temperature": 0, "ignore_eos": True}
    out = _ok(small_ctx_server.post("/v1/chat/completions", body))
    usage = out["usage"]
    assert usage["completion_tokens"] == SMALL_CONTEXT - 1 - usage["prompt_tokens"]  # prompt + output < context
    assert out["choices"][0]["finish_reason"] == "length"


def _template_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_prompt_is_the_tokenizers_chat_template(server, tokenizer):
    """The chat prompt is exactly ``apply_chat_template(messages, add_generation_prompt=True)``:
    same length, the same greedy answer, and the prefix cache filled by the template's ids
    serves the chat request as it serves those ids again."""
    messages = [{"role": "system", "content": "you serve tokens"}, {"role": "user", "content": "the model serves"},
                {"role": "assistant", "content": "over a group"}, {"role": "user", "content": "of pods each rank"}]
    ids = _template_ids(tokenizer, messages)
    native_body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    native = _ok(server.post("/generate", native_body))
    again = _ok(server.post("/generate", native_body))
    chat = _ok(server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0,
                                                    "ignore_eos": True}))
    assert chat["usage"]["prompt_tokens"] == len(ids)
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == again["meta_info"]["cached_tokens"] > 0
    assert chat["choices"][0]["message"]["content"] == native["text"]
    wait_for_baseline(server)


def test_skip_special_tokens(server, tokenizer):
    """Special tokens in the output are left out of the text by default and kept with
    ``skip_special_tokens: false`` (``/generate`` and completions); the ids are the same either way."""
    special = set(tokenizer.all_special_ids)
    body = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 160, "temperature": 1.0, "ignore_eos": True}}
    for seed in range(32):  # a seeded sample is reproducible; find one that emits a special token
        body["sampling_params"]["seed"] = seed
        out = _ok(server.post("/generate", body))
        if special & set(out["output_ids"]):
            break
    else:
        pytest.fail("no seed produced a special token")
    ids = out["output_ids"]
    kept = _ok(server.post("/generate", {**body, "sampling_params": {**body["sampling_params"],
                                                                    "skip_special_tokens": False}}))
    assert kept["output_ids"] == ids
    assert out["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert kept["text"] == tokenizer.decode(ids, skip_special_tokens=False) != out["text"]
    completion = _ok(server.post("/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 160, "temperature": 1.0,
                                                     "seed": seed, "ignore_eos": True, "skip_special_tokens": False}))
    assert completion["choices"][0]["text"] == kept["text"]


def test_flush_cache_drops_the_prefix_cache_and_refuses_while_requests_run(server):
    wait_for_baseline(server)
    body = {"input_ids": list(range(100, 164)), "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    _ok(server.post("/generate", body))
    assert _ok(server.post("/generate", body))["meta_info"]["cached_tokens"] > 0
    r = server.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert _ok(server.post("/generate", body))["meta_info"]["cached_tokens"] == 0
    # while a request runs (one as long as the pool allows) the flush is refused, nothing dropped
    rid, result = "flush-cache-long", {}
    room = server.get("/get_server_info").json()["max_req_len"] - 3
    thread = threading.Thread(target=lambda: result.update(r=server.post("/generate", {
        "input_ids": [5, 6, 7], "rid": rid, "sampling_params": {"max_new_tokens": room, "ignore_eos": True}})))
    thread.start()
    deadline = time.monotonic() + 60
    while server.get("/get_server_info").json()["num_running_reqs"] < 1:
        assert time.monotonic() < deadline, "the long request never ran"
        time.sleep(0.02)
    r = server.post("/flush_cache")
    assert server.post("/abort_request", {"rid": rid}).json()["success"] is True
    thread.join(60)
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert result["r"].json()["meta_info"]["finish_reason"]["type"] == "abort", "the request ended before the flush"
    assert _ok(server.post("/generate", body))["meta_info"]["cached_tokens"] > 0  # the refused flush kept the cache
    wait_for_baseline(server)


@pytest.mark.parametrize("path,body", [
    ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/adapters/a"}),
    ("/unload_lora_adapter", {"lora_name": "a"}),
])
def test_adapter_endpoints_without_enable_lora_are_400_naming_the_flag(server, path, body):
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    assert "--enable-lora" in r.text


def test_server_info_reports_that_a_cpu_server_captured_no_graphs(server):
    graphs = _ok(server.get("/get_server_info"))["cuda_graphs"]
    assert graphs == {"decode_batch_sizes": [], "piecewise_token_buckets": [], "reason": "cpu: no CUDA graphs",
                      "torch_compile_batch_sizes": [], "verify_batch_sizes": [], "verify_tokens_per_request": 0,
                      "draft_batch_sizes": [], "speculative_reason": None}


def test_server_info_carries_the_graphs_report_in_the_weights_block(server):
    info = _ok(server.get("/get_server_info"))
    assert info["weights"]["graphs"] == info["cuda_graphs"]
