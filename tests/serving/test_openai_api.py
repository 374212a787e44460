"""The official openai client (sync, async, streaming) and curl against a real server process."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import openai
import pytest

from serving_server import CONTEXT, wait_for_baseline

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_served_name_and_context(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == CONTEXT


def test_sync_completion_and_usage(client):
    out = client.completions.create(model=MODEL, prompt="hello world how are", max_tokens=7, temperature=0,
                                     extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 7
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_streamed_text_equals_non_streamed(client):
    kwargs = dict(model=MODEL, prompt="the quick brown fox", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full
    assert chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_sync_stream_equal(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    parts, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(parts) == full.choices[0].message.content
    assert usage.completion_tokens == full.usage.completion_tokens == 16
    assert reasons[-1] == "length"


def test_async_client_concurrent(server):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        outs = await asyncio.gather(*[
            aclient.completions.create(model=MODEL, prompt=f"one two {i}", max_tokens=5, temperature=0) for i in range(6)
        ])
        stream = await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=4, stream=True)
        n = 0
        async for _ in stream:
            n += 1
        await aclient.close()
        return outs, n

    outs, n = asyncio.run(run())
    assert all(o.choices[0].finish_reason in ("stop", "length") for o in outs)
    assert n >= 2


def test_n_choices_and_seed_reproducible(client):
    kwargs = dict(model=MODEL, prompt="hello", max_tokens=8, temperature=0.8, n=4, seed=7, extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert sorted(c.index for c in a.choices) == [0, 1, 2, 3]
    assert len({c.text for c in a.choices}) > 1
    assert a.usage.completion_tokens == 32


def test_logprobs_completion_and_chat(client):
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=4, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(abs(max(top.values()) - v) < 1e-5 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_unknown_model_is_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    assert "nope" in str(exc.value)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_completion_and_stream(server):
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0})
    out = subprocess.run(["curl", "-sS", "-H", "Content-Type: application/json", "-d", body, server.url + "/v1/completions"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout)["object"] == "text_completion"
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True})
    out = subprocess.run(["curl", "-sSN", "-H", "Content-Type: application/json", "-d", body, server.url + "/v1/completions"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.rstrip().endswith("data: [DONE]")


def test_native_generate_and_info(server, tokenizer):
    ids = tokenizer.encode("hello world")
    r = server.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
                                  "return_logprob": True, "logprob_start_len": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["output_ids"]) == 5 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["text"] == tokenizer.decode(out["output_ids"])
    prompt_lps = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in prompt_lps] == ids and prompt_lps[0][0] is None
    assert all(lp is not None and lp <= 0 for lp, _, _ in prompt_lps[1:])
    info = server.get("/get_server_info").json()
    assert info["weights_phase"] == "serving" and info["weights_revision"] == "rev-a"
    assert info["max_total_num_tokens"] == 2048
    assert server.get("/get_model_info").json()["served_model_name"] == MODEL
    assert server.get("/health").status_code == 200 and server.get("/ready").status_code == 200
    assert server.get("/health_generate").status_code == 200
    wait_for_baseline(server)


def test_prompt_list_with_n_and_echo(server, tokenizer):
    prompts = ["hello world", "one two three"]
    r = server.post("/v1/completions", {"model": MODEL, "prompt": prompts, "n": 2, "echo": True, "max_tokens": 3,
                                        "temperature": 0, "ignore_eos": True})
    out = r.json()
    assert r.status_code == 200, out
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        assert c["text"].startswith(prompts[c["index"] // 2])
    assert choices[0]["text"] == choices[1]["text"]  # greedy: both choices of a prompt agree
    assert out["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    assert out["usage"]["completion_tokens"] == 12
