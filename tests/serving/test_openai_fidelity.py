"""OpenAI API fidelity as clients rely on it (issue 10): echo + prompt logprobs (F2), retrieving a
model (F3), chat templates that raise (F4), BOS / ``add_special_tokens`` (F5). Each input the issue
names is kept here and checked against the right value (transformers on the same ids, where a
number is involved)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from serving_server import start_server, wait_for_baseline

MODEL = "tiny-llama"
FOX = "The quick brown fox"
# Raises on purpose when roles do not alternate, as many real templates do (Llama 2, Mistral).
ALTERNATING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def hf_model(serving_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(serving_checkpoint), dtype=torch.float32).eval()


def _hf_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[k] | ids[:k]) for k >= 1, from transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[k - 1, ids[k]]) for k in range(1, len(ids))]


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def _stream_completion(server, body: dict) -> tuple[str, dict]:
    """Concatenated text and logprobs of a streamed completion (one choice)."""
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in httpx.Response(200, content=line[6:]).json()["choices"]:
                text += choice["text"]
                for key, value in (choice["logprobs"] or {}).items():
                    lp[key] += value
    return text, lp


# ---------------------------------------------------------------- F2 echo + logprobs

def test_f2_echo_logprobs_cover_prompt_then_completion(server, tokenizer, hf_model):
    body = {"model": MODEL, "prompt": FOX, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2,
            "ignore_eos": True}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice, ids = out["choices"][0], tokenizer.encode(FOX)
    lp = choice["logprobs"]
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(ids) + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    generated = _hf_greedy(hf_model, ids, 4)
    assert choice["text"] == FOX + tokenizer.decode(generated)
    full = ids + generated
    expected = _hf_logprobs(hf_model, full)
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) <= 2 and max(top.values()) >= v - 1e-6 for top, v in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:]))
    assert choice["text"].startswith(FOX)
    # Offsets index the echoed text: each token's text is found where its offset says.
    assert lp["text_offset"] == [len(tokenizer.decode(full[:k])) for k in range(len(full))]
    assert all(choice["text"][o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"]))
    assert lp["text_offset"][1] > 0
    assert _stream_completion(server, body) == (choice["text"], lp)


def test_f2_echo_with_max_tokens_zero_scores_the_prompt_only(server, tokenizer, hf_model):
    ids = tokenizer.encode(FOX)
    for prompt in (FOX, ids, [ids, ids]):
        r = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        out = r.json()
        for choice in out["choices"]:
            assert choice["text"] == FOX and choice["finish_reason"] == "length"
            assert choice["logprobs"]["token_logprobs"][0] is None
            assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(_hf_logprobs(hf_model, ids), abs=1e-4)
        assert out["usage"]["completion_tokens"] == 0
    # without echo there is nothing to return: still a 400 naming the field
    r = server.post("/v1/completions", {"model": MODEL, "prompt": FOX, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    wait_for_baseline(server)


def test_f2_offsets_with_multibyte_characters(server, tokenizer):
    prompt = "emoji 🙂 café Привет 机器学习"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 0,
            "ignore_eos": True}
    out = server.post("/v1/completions", body).json()
    text, lp = out["choices"][0]["text"], out["choices"][0]["logprobs"]
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    for o, t in zip(offsets, lp["tokens"]):
        if "\ufffd" not in t:  # a token holding part of a character starts where the character does
            assert text[o:].startswith(t), (o, t)
    assert _stream_completion(server, body) == (text, lp)


# ---------------------------------------------------------------- F3 retrieve a model

def test_f3_retrieve_model(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    listed = client.models.list().data[0]
    assert client.models.retrieve(MODEL) == listed
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("no-such-model")
    assert exc.value.body["type"] == "not_found_error" and "no-such-model" in exc.value.body["message"]


# ---------------------------------------------------------------- F4 / F5: a Llama-style tokenizer

@pytest.fixture(scope="module")
def bos_checkpoint(checkpoint_dir):
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    path = checkpoint_dir / "bos-alternating"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, seed=3, add_bos=True, chat_template=ALTERNATING_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def bos_server(bos_checkpoint, checkpoint_dir):
    srv = start_server(bos_checkpoint, checkpoint_dir, "--max-total-tokens", "1024", "--served-model-name", MODEL)
    yield srv
    srv.stop()


def test_f4_raising_chat_template_is_400_and_connection_survives(bos_server):
    two_users = [{"role": "user", "content": "hello"}, {"role": "user", "content": "again"}]
    with httpx.Client(base_url=bos_server.url, timeout=60) as http:  # one keep-alive connection
        for _ in range(3):
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": two_users, "max_tokens": 2})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == "messages"
            assert "Conversation roles must alternate" in err["message"]
            ok = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hello"}]})
            assert ok.status_code == 200, ok.text
    client = openai.OpenAI(base_url=bos_server.url + "/v1", api_key="unused")  # default retries: none happen
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=two_users, max_tokens=2)


def test_f5_completions_add_bos_as_the_tokenizer_does(bos_server, bos_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bos_checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(bos_checkpoint), dtype=torch.float32).eval()
    ids = tok.encode(FOX)
    assert ids[0] == tok.bos_token_id and len(ids) == len(tok.encode(FOX, add_special_tokens=False)) + 1

    def complete(**extra) -> dict:
        r = bos_server.post("/v1/completions", {"model": MODEL, "prompt": FOX, "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    out = complete()
    assert out["usage"]["prompt_tokens"] == len(ids) == 5
    assert out["choices"][0]["text"] == tok.decode(_hf_greedy(model, ids, 8))
    assert complete(prompt=tok.bos_token + FOX)["usage"]["prompt_tokens"] == 5  # no second BOS
    assert complete(prompt=ids)["usage"]["prompt_tokens"] == 5  # token ids are sent as given
    assert complete(add_special_tokens=False)["usage"]["prompt_tokens"] == 4
    # echo offsets: the BOS the tokenizer added is not in the echoed text
    lp = complete(echo=True, logprobs=0, max_tokens=0)["choices"][0]["logprobs"]
    assert lp["text_offset"][:3] == [0, 0, len(tok.decode(ids[1:2]))]

    gen = bos_server.post("/generate", {"text": FOX, "sampling_params": {"max_new_tokens": 1}}).json()
    assert gen["meta_info"]["prompt_tokens"] == 5
    gen = bos_server.post("/generate", {"text": FOX, "add_special_tokens": False, "sampling_params": {"max_new_tokens": 1}})
    assert gen.json()["meta_info"]["prompt_tokens"] == 4
    # chat: the template writes what it wants; special tokens are added only on request (vLLM)
    messages = [{"role": "user", "content": "hello"}]
    templated = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    n = len(tok.encode(templated, add_special_tokens=False))
    for extra, expected in (({}, n), ({"add_special_tokens": True}, n + 1)):
        r = bos_server.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1, **extra})
        assert r.json()["usage"]["prompt_tokens"] == expected, r.text
