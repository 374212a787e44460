"""Field cases R1-R6 (FIELD_CASES.md) against a real server process."""

from __future__ import annotations

import json

import httpx
import pytest
from serving_server import CONTEXT, wait_for_baseline


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


def _complete(server, **body) -> dict:
    body.setdefault("model", "tiny-llama")
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_text(server, path: str, body: dict) -> tuple[list[str], list[dict]]:
    deltas, events = [], []
    with httpx.stream("POST", server.url + path, json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            for c in event.get("choices", []):
                deltas.append(c["text"] if "text" in c else c["delta"].get("content") or "")
    return deltas, events


# ---------------------------------------------------------------- R1 empty prompt

@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [""]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"text": ""}, "text"),
])
def test_r1_empty_prompt_is_400_and_server_keeps_serving(server, path, body, param):
    err = _error(server.post(path, body))
    assert err["param"] == param, err
    assert "empty" in err["message"] or "at least one token" in err["message"], err
    assert _complete(server, prompt="hello", max_tokens=2)["choices"][0]["finish_reason"] in ("length", "stop")
    assert server.get("/health").status_code == 200


# ---------------------------------------------------------------- R2 max_tokens edges

def test_r2_max_tokens_edges(server):
    out = _complete(server, prompt="hello world", max_tokens=1, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 1 and out["choices"][0]["finish_reason"] == "length"
    err = _error(server.post("/v1/completions", {"prompt": "hi", "max_tokens": -1}))
    assert err["param"] == "max_tokens"
    # documented choice (docs/api.md): max_tokens 0 is a 400 on the OpenAI endpoints unless echo is set
    err = _error(server.post("/v1/completions", {"prompt": "hi", "max_tokens": 0}))
    assert err["param"] == "max_tokens" and ">= 1" in err["message"]
    err = _error(server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}))
    assert err["param"] == "max_tokens"
    wait_for_baseline(server)


# ---------------------------------------------------------------- R3 prompt longer than the context

def test_r3_prompt_over_limits(server, tokenizer):
    long_prompt = list(range(10, 10 + 500)) * 10  # 5000 tokens > context 4096
    err = _error(server.post("/v1/completions", {"prompt": long_prompt, "max_tokens": 1}))
    assert "5000 tokens" in err["message"] and err["param"] == "prompt"
    ids = tokenizer.encode("hello world " * 20)
    err = _error(server.post("/v1/completions", {"prompt": ids, "max_tokens": CONTEXT}))
    assert f"{len(ids)} tokens" in err["message"] and str(CONTEXT) in err["message"] and err["param"] == "max_tokens"
    models = server.get("/v1/models").json()
    assert models["data"][0]["max_model_len"] == CONTEXT
    wait_for_baseline(server)


# ---------------------------------------------------------------- R4 top_k / top_p edges

def _texts(server, **sampling) -> list[str]:
    out = _complete(server, prompt="one two three", max_tokens=12, n=8, seed=1234, ignore_eos=True, **sampling)
    return [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]


@pytest.mark.slow
def test_r4_top_k_top_p_edges(server):
    greedy = _complete(server, prompt="one two three", max_tokens=12, temperature=0, ignore_eos=True)["choices"][0]["text"]
    for disabled in (-1, 0):
        assert len(set(_texts(server, temperature=0.8, top_k=disabled))) > 1, f"top_k={disabled} must sample"
    assert _texts(server, temperature=0.8, top_k=1) == [greedy] * 8
    assert _texts(server, temperature=0.8, top_p=0.0) == [greedy] * 8
    assert _texts(server, temperature=0, top_k=50, top_p=0.3) == [greedy] * 8
    assert len(_texts(server, temperature=0.8, top_k=10**6)) == 8  # clamped to the vocabulary
    for field, value in [("top_k", -2), ("top_p", 1.5), ("top_p", -0.1), ("temperature", -1), ("min_p", 2.0),
                         ("presence_penalty", 3), ("n", 0), ("seed", -1)]:
        err = _error(server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value}))
        assert field in (err["param"] or "") and field in err["message"]


# ---------------------------------------------------------------- R5 stop strings across tokens

def _greedy_tokens(server, tokenizer, prompt: str, n: int) -> list[int]:
    out = server.post("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}).json()
    return out["output_ids"]


def _boundary_case(server, tokenizer):
    """A greedy output, and a token index k where tokens k and k+1 are clean ASCII pieces."""
    for prompt in ("one two three four", "the model serves tokens over", "hello world how are you"):
        ids = _greedy_tokens(server, tokenizer, prompt, 40)
        full = tokenizer.decode(ids)
        pieces = [tokenizer.decode([t]) for t in ids]
        for k in range(len(ids) - 1):
            head, head2 = tokenizer.decode(ids[: k + 1]), tokenizer.decode(ids[: k + 2])
            a, b = pieces[k], pieces[k + 1]
            if not (len(a) >= 2 and len(b) >= 2 and (a + b).isascii() and head2 == head + b and head.endswith(a)
                    and full.startswith(head2)):
                continue
            if full.find(a[-2:] + b[:2]) == len(head) - 2 and full.find(a + b) == len(head) - len(a):
                return prompt, ids, full, pieces, k
    pytest.fail("no clean token boundary in the greedy outputs")


def test_r5_stop_string_across_token_boundary(server, tokenizer):
    prompt, ids, full, pieces, k = _boundary_case(server, tokenizer)
    for stop in (pieces[k][-2:] + pieces[k + 1][:2], pieces[k] + pieces[k + 1]):  # mid-token start; whole tokens
        expected = full[: full.index(stop)]
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [stop]}
        out = server.post("/v1/completions", body).json()
        assert out["choices"][0]["text"] == expected
        assert out["choices"][0]["finish_reason"] == "stop"
        deltas, _ = _stream_text(server, "/v1/completions", body)
        assert "".join(deltas) == expected  # append-only stream: nothing emitted was retracted
        assert all(stop not in d for d in deltas)
        with_stop = server.post("/v1/completions", dict(body, include_stop_str_in_output=True)).json()
        assert with_stop["choices"][0]["text"] == expected + stop
    wait_for_baseline(server)


# ---------------------------------------------------------------- R6 UTF-8 in streaming

_CANDIDATE_CHARS = "🤖机✨器é学习模型推理服务张量并行你好世界東京大阪日本語テキストこんにちは🙂🚀🎉👍😀—ïΩμέγαПривет"


@pytest.fixture(scope="module")
def parrot_server(serving_checkpoint, checkpoint_dir, tokenizer):
    """A server whose greedy output repeats a text of CJK, emoji and accented characters."""
    from parrot_checkpoint import make_parrot_checkpoint
    from serving_server import start_server

    text, used = "", []
    for ch in _CANDIDATE_CHARS:  # the longest run of characters with distinct token ids
        ids = tokenizer.encode(text + ch, add_special_tokens=False)
        if len(set(ids)) == len(ids) and len(ids) <= 60:
            text, used = text + ch, ids
    ids = make_parrot_checkpoint(serving_checkpoint, checkpoint_dir / "parrot", tokenizer, text)
    srv = start_server(checkpoint_dir / "parrot", checkpoint_dir, "--max-total-tokens", "1024")
    yield srv, text, ids
    srv.stop()


def test_r6_utf8_streaming_equals_full_text(parrot_server, tokenizer):
    server, text, ids = parrot_server
    assert any(len(tokenizer.encode(ch, add_special_tokens=False)) > 1 for ch in text)  # multi-token characters
    body = {"prompt": text, "max_tokens": 2 * len(ids), "temperature": 0, "ignore_eos": True}
    full = server.post("/v1/completions", body).json()["choices"][0]["text"]
    assert full == text * 2
    deltas, _ = _stream_text(server, "/v1/completions", body)
    assert "".join(deltas) == full
    assert all("\ufffd" not in d for d in deltas)
    assert sum(len(d) > 0 for d in deltas) > 1
    # a stream cut mid-character (max_tokens ends inside a multi-byte character) shows exactly
    # what the tokens decode to, never a duplicated or extra character
    cut = next(i for i in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:i]))
    out = server.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": cut, "temperature": 0, "ignore_eos": True}}).json()
    assert out["text"] == tokenizer.decode(out["output_ids"]) == tokenizer.decode(ids[:cut])
    previous = ""
    with httpx.stream("POST", server.url + "/generate", timeout=120,
                      json={"text": text, "sampling_params": {"max_new_tokens": 2 * len(ids), "temperature": 0, "ignore_eos": True}, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                current = json.loads(line[6:])["text"]
                assert current.startswith(previous) and "\ufffd" not in current
                previous = current
    assert previous == text * 2
    chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 30, "temperature": 0,
                                                "ignore_eos": True}).json()
    chat_deltas, _ = _stream_text(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                                   "max_tokens": 30, "temperature": 0, "ignore_eos": True})
    assert "".join(chat_deltas) == chat["choices"][0]["message"]["content"]


# ---------------------------------------------------------------- F6 assistant prefill

PREFILL = [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "The colour is"}]


def _prefill_ids(tokenizer) -> list[int]:
    """What transformers renders for an open final assistant message."""
    return tokenizer.apply_chat_template(PREFILL, continue_final_message=True, add_generation_prompt=False,
                                         tokenize=True, return_dict=False)


def test_continue_final_message_continues_the_assistant_message(server, tokenizer):
    body = {"model": "tiny-llama", "messages": PREFILL, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "continue_final_message": True, "add_generation_prompt": False}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    expected_ids = _prefill_ids(tokenizer)
    assert r.json()["usage"]["prompt_tokens"] == len(expected_ids)
    same_prompt = server.post("/generate", {"input_ids": expected_ids, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}).json()
    assert r.json()["choices"][0]["message"]["content"] == same_prompt["text"]


def test_continue_final_message_renders_differently_from_a_closed_turn(tokenizer):
    closed = tokenizer.apply_chat_template(PREFILL, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert _prefill_ids(tokenizer) != closed  # else the test above could not tell them apart


def test_continue_final_message_without_add_generation_prompt_turns_it_off(server, tokenizer):
    body = {"model": "tiny-llama", "messages": PREFILL, "max_tokens": 2, "continue_final_message": True}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(_prefill_ids(tokenizer))


def test_continue_final_message_with_add_generation_prompt_is_400_naming_it(server):
    body = {"model": "tiny-llama", "messages": PREFILL, "max_tokens": 2, "continue_final_message": True,
            "add_generation_prompt": True}
    error = _error(server.post("/v1/chat/completions", body))
    assert error["param"] == "continue_final_message"
    assert "add_generation_prompt" in error["message"]
