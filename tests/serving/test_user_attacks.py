"""A new user's attacks on the runtime server: malformed and edge-case requests, limits, logprobs,
SIGTERM while busy, and in-place weight updates with mismatching checkpoints. Each bug these
attacks found is fixed and its test now asserts the fixed behaviour.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest
from serving_server import SMALL_CONTEXT, start_server, wait_for_baseline



def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body.get("object") == "error" and set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]


def _load(server) -> int:
    info = server.get("/get_server_info").json()
    return info["num_running_reqs"] + info["num_queued_reqs"]


def _healthy(server) -> None:
    assert server.get("/health").status_code == 200
    out = server.post("/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert out.status_code == 200, out.text


# ---------------------------------------------------------------- malformed requests (regression checks)

_RAW_BAD_BODIES = [
    b"{not json",
    b"[]",
    b'"a string"',
    b'\xff\xfe{"prompt": "a"}',
    b'{"prompt": "\xff\xfe", "max_tokens": 2}',  # non-UTF-8 bytes inside a JSON string
]


@pytest.mark.parametrize("raw", _RAW_BAD_BODIES)
def test_malformed_bodies_are_400_error_objects(server, raw):
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=60)
    err = _error(r)
    assert err["type"] == "invalid_request_error"
    _healthy(server)


@pytest.mark.parametrize("path,raw,where", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages.0.content"),
    ("/v1/completions", b'{"prompt": "\\udfff", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud83d"], "max_tokens": 2}', "stop.0"),
    ("/generate", b'{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}', "text"),
])
def test_lone_surrogate_escapes_are_400_naming_the_field(server, path, raw, where):
    r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    err = _error(r)
    assert err["message"].startswith(f"{where}: contains a lone UTF-16 surrogate"), err
    _healthy(server)


def test_invalid_utf8_body_is_400_naming_the_byte(server):
    raw = b'{"prompt": "\xff", "max_tokens": 2}'
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert "not valid UTF-8: byte 12 is 0xff" in _error(r)["message"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_json_sent_with_another_content_type_is_400_naming_the_header(server, content_type):
    raw = b'{"prompt": "a", "max_tokens": 2}'
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": content_type}, timeout=60)
    assert _error(r)["message"].startswith(f"Content-Type must be application/json, got '{content_type}'")


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "top_p": NaN}', "top_p"),
    (b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    (b'{"prompt": "hi", "repetition_penalty": -Infinity}', "repetition_penalty"),
    (b'{"prompt": "hi", "min_p": NaN}', "min_p"),
])
def test_non_finite_json_numbers_are_400_naming_the_field(server, raw, param):
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=60)
    err = _error(r)
    assert err["param"] == param and param in err["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 100000, "max_tokens": 1}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "not-served"}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5}, "max_tokens"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 1000}, "logprob_start_len"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                              "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_out_of_range_and_wrong_type_fields_are_400_naming_the_field(server, path, body, param):
    err = _error(server.post(path, body))
    assert err["param"] == param, err


def test_control_endpoints_reject_unknown_keys_naming_them(server):
    """A misspelt key on a control endpoint is a 400 naming it, and nothing is done: with the
    key ignored, this update (to the checkpoint already served) would succeed."""
    path = server.get("/get_server_info").json()["model_path"]
    r = server.post("/update_weights_from_disk", {"model_path": path, "revison": "typo"})
    err = _error(r)
    assert err["param"] == "revison" and "revison" in err["message"]
    r = server.post("/abort_request", {"rid": "nobody", "abort_al": True})
    assert _error(r)["param"] == "abort_al"
    _healthy(server)


def test_duplicate_rid_and_abort_all_keep_the_server_consistent(server):
    """A second request with a running request's rid is a 400; abort_all ends every running
    request with finish_reason "abort"; KV returns to baseline.

    The five requests fill the KV pool between them (about 400 decode steps each, far more than
    the few round trips the test makes after it sees all five in flight), and a request that
    still finished first fails the test instead of passing it."""
    import concurrent.futures as cf

    wait_for_baseline(server)
    room = server.get("/get_server_info").json()["max_total_num_tokens"] // 5 - 8

    def gen(rid):
        return server.post("/generate", {"text": "abc", "rid": rid,
                                         "sampling_params": {"max_new_tokens": room, "ignore_eos": True}})

    def long(i):
        return server.post("/v1/completions", {"prompt": f"q{i}", "max_tokens": room, "ignore_eos": True})

    with cf.ThreadPoolExecutor(8) as pool:
        first = pool.submit(gen, "user-attacks-dup")
        others = [pool.submit(long, i) for i in range(4)]
        deadline = time.monotonic() + 60
        while _load(server) < 5:
            assert time.monotonic() < deadline, f"the five requests never ran together: {_load(server)}"
            time.sleep(0.02)
        err = _error(gen("user-attacks-dup"))
        assert err["param"] == "rid"
        assert server.post("/abort_request", {"abort_all": True}).json()["success"] is True
        assert first.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert [f.result().json()["choices"][0]["finish_reason"] for f in others] == ["abort"] * 4
    wait_for_baseline(server)
    _healthy(server)


# ---------------------------------------------------------------- bugs found by these attacks (fixed)

def test_max_tokens_that_exactly_fill_the_context_are_honoured(small_ctx_server):
    n = 100
    room = SMALL_CONTEXT - n
    body = {"prompt": [7] * n, "max_tokens": room, "ignore_eos": True, "temperature": 0}
    r = small_ctx_server.post("/v1/completions", body)
    if r.status_code == 400:  # a fix may reject it instead; then the hint it gives must be achievable
        hint = int(re.search(r"at most (\d+) tokens", _error(r)["message"]).group(1))
        r = small_ctx_server.post("/v1/completions", dict(body, max_tokens=hint))
        room = hint
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == room
    # the error for one token more names a limit that, asked for, is honoured in full
    over = _error(small_ctx_server.post("/v1/completions", dict(body, max_tokens=room + 5)))
    hint = int(re.search(r"at most (\d+) tokens", over["message"]).group(1))
    out = small_ctx_server.post("/v1/completions", dict(body, max_tokens=hint)).json()
    assert out["usage"]["completion_tokens"] == hint
    wait_for_baseline(small_ctx_server)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": [True, 3], "max_tokens": 1}, "prompt"),
    ("/generate", {"input_ids": [True, 5], "sampling_params": {"max_new_tokens": 1}}, "input_ids"),
])
def test_boolean_token_ids_are_rejected(server, path, body, param):
    err = _error(server.post(path, body))
    assert err["param"] == param


def test_completion_top_logprobs_report_the_best_logprob_per_key(server, tokenizer):
    prompt, steps = "hello world", 8
    sp = {"max_new_tokens": steps, "temperature": 0, "ignore_eos": True}
    native = server.post("/generate", {"text": prompt, "return_logprob": True, "top_logprobs_num": 20,
                                       "sampling_params": sp}).json()["meta_info"]["output_token_logprobs"]
    lp = server.post("/v1/completions", {"prompt": prompt, "max_tokens": steps, "temperature": 0, "ignore_eos": True,
                                         "logprobs": 20}).json()["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == len(native) == steps
    for position, (_, _, tops) in enumerate(native):
        expected: dict[str, float] = {}
        for value, token_id in tops:  # best first
            expected.setdefault(tokenizer.decode([token_id]), value)
        got = lp["top_logprobs"][position]
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, abs=1e-4), (position, key)
        # the sampled token's key is never shown with a lower value than the token's own logprob
        assert got[lp["tokens"][position]] >= lp["token_logprobs"][position] - 1e-4


def test_chat_logprobs_bytes_are_the_tokens_own_bytes(server):
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 20}
    content = server.post("/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    assert content
    for entry in content:
        byte_strings = [tuple(t["bytes"]) for t in entry["top_logprobs"]]
        # distinct tokens of a byte-level BPE vocabulary have distinct byte strings
        assert len(set(byte_strings)) == len(byte_strings), byte_strings


@pytest.mark.slow
def test_huge_prompt_does_not_stall_health(server):
    latencies: list[float] = []
    done = threading.Event()

    def probe():
        while not done.is_set():
            t = time.monotonic()
            try:
                httpx.get(server.url + "/health", timeout=30)
            finally:
                latencies.append(time.monotonic() - t)
            time.sleep(0.05)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        time.sleep(0.2)
        r = server.post("/v1/completions", {"prompt": "hello world " * 500_000, "max_tokens": 1})
    finally:
        done.set()
        thread.join()
    assert _error(r)["param"] == "prompt"
    assert max(latencies) < 1.5, f"/health stalled {max(latencies):.1f} s"


@pytest.mark.parametrize("field,value", [
    ("response_format", {"type": "xml"}),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
])
def test_unsupported_chat_features_are_not_silently_ignored(server, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    err = _error(server.post("/v1/chat/completions", body))
    assert err["param"] == field


def test_update_with_other_config_field_is_refused_and_keeps_serving(small_ctx_server, checkpoint_dir):
    """W1 with equal shapes but another rope_theta / rms_norm_eps: refused naming the config field."""
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    srv = small_ctx_server
    body = {"prompt": "hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    before = srv.post("/v1/completions", body).json()["choices"][0]["text"]
    for name, overrides, field in [
        ("attack-rope", {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}, "rope"),
        ("attack-eps", {"rms_norm_eps": 0.5}, "rms_norm_eps"),
    ]:
        path = checkpoint_dir / name
        if not (path / "config.json").exists():
            make_tiny_checkpoint(path, arch="llama", seed=1, max_position_embeddings=4096, **overrides)
        r = srv.post("/update_weights_from_disk", {"model_path": str(path)})
        assert r.status_code == 400 and r.json()["success"] is False, r.text
        assert field in r.json()["message"]
        assert srv.post("/v1/completions", body).json()["choices"][0]["text"] == before
        assert srv.get("/get_model_info").json()["model_path"] != str(path)
    _healthy(srv)


@pytest.mark.slow
def test_sigterm_after_drain_timeout_ends_running_requests_with_abort(serving_checkpoint, checkpoint_dir):
    import concurrent.futures as cf

    srv = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", "4096", "--drain-timeout", "1")
    try:
        def plain():
            return httpx.post(srv.url + "/v1/completions", timeout=60,
                              json={"prompt": "long", "max_tokens": 3000, "ignore_eos": True})

        def stream():
            reasons, done = [], False
            try:
                with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                                  json={"prompt": "long", "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: {"):
                            reasons += [c["finish_reason"] for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
            except httpx.HTTPError as exc:
                return reasons, f"broken stream: {exc!r}"
            return reasons, done

        with cf.ThreadPoolExecutor(2) as pool:
            p, s = pool.submit(plain), pool.submit(stream)
            deadline = time.monotonic() + 30
            while srv.get("/get_server_info").json()["num_running_reqs"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            srv.proc.send_signal(signal.SIGTERM)
            r = p.result()
            reasons, done = s.result()
        assert srv.proc.wait(30) == 0
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] == "abort"
        else:
            assert _error(r, 503)["type"] == "service_unavailable"
        assert reasons == ["abort"] and done is True
    finally:
        srv.stop()


# ---------------------------------------------------------------- non-finite arithmetic in sampling

def _native_ids(server, **sampling) -> list[int]:
    r = server.post("/generate", {"text": "hello hello hello",
                                  "sampling_params": dict({"max_new_tokens": 6, "ignore_eos": True}, **sampling)})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@pytest.mark.parametrize("temperature", [1e-45, 1e-320])
def test_tiny_positive_temperature_is_greedy(server, temperature):
    assert _native_ids(server, temperature=temperature) == _native_ids(server, temperature=0)


def test_extreme_repetition_penalty_never_samples_padding(server):
    r = server.post("/generate", {"text": "hello hello hello", "sampling_params": {
        "max_new_tokens": 6, "ignore_eos": True, "temperature": 1.0, "seed": 0, "repetition_penalty": 1e-300}})
    if r.status_code == 400:  # rejecting the value is a fix too
        assert _error(r)["param"].endswith("repetition_penalty")
        return
    assert r.status_code == 200, r.text
    assert 0 not in r.json()["output_ids"], r.json()
    wait_for_baseline(server)


def test_non_finite_weights_never_give_500(small_ctx_server, serving_checkpoint, checkpoint_dir):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    srv = small_ctx_server
    path = checkpoint_dir / "attack-nan"
    if not path.exists():
        shutil.copytree(serving_checkpoint, path)
        for f in path.glob("*.safetensors"):
            weights = load_file(str(f))
            if "model.norm.weight" in weights:
                weights["model.norm.weight"].fill_(float("nan"))
            save_file(weights, str(f), metadata={"format": "pt"})
    try:
        up = srv.post("/update_weights_from_disk", {"model_path": str(path)})
        if up.status_code == 400:  # refusing non-finite weights (naming the parameter) is a fix too
            assert "model.norm.weight" in up.json()["message"]
            return

        def strict(text: str):
            return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in {text[:200]}"))

        body = {"prompt": "hello", "max_tokens": 3, "logprobs": 2}
        r = srv.post("/v1/completions", body)
        assert r.status_code < 500 or r.status_code == 503, r.text
        strict(r.text)
        r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                              "logprobs": True})
        assert r.status_code < 500 or r.status_code == 503, r.text
        strict(r.text)
        with httpx.stream("POST", srv.url + "/v1/completions", json=dict(body, stream=True), timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    strict(line[6:])
    finally:
        ok = srv.post("/update_weights_from_disk", {"model_path": str(serving_checkpoint)})
        assert ok.status_code == 200, ok.text


@pytest.mark.slow
def test_requests_aborted_at_the_drain_timeout_report_the_tokens_they_used(serving_checkpoint, checkpoint_dir):
    """Field case F11: a response ended by the drain timeout counts its prompt and the tokens it
    already sent in ``usage`` (the body's, and a stream's ``include_usage`` chunk), not 0/0/0."""
    import concurrent.futures as cf

    prompt = [5, 6, 7, 8, 9, 10, 11]
    srv = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", "4096", "--drain-timeout", "1")
    body = {"prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "logprobs": 0}
    try:
        streamed = threading.Event()

        def plain():
            return httpx.post(srv.url + "/v1/completions", timeout=60, json=body)

        def stream():
            tokens, usage = 0, None
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                              json=dict(body, stream=True, stream_options={"include_usage": True})) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    for choice in event["choices"]:
                        tokens += len(choice["logprobs"]["tokens"]) if choice["logprobs"] else 0
                    if tokens:
                        streamed.set()
                    usage = event.get("usage") or usage
            return tokens, usage

        with cf.ThreadPoolExecutor(2) as pool:
            p, s = pool.submit(plain), pool.submit(stream)
            assert streamed.wait(60), "the stream sent no token"
            deadline = time.monotonic() + 30
            while srv.get("/get_server_info").json()["num_running_reqs"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            srv.proc.send_signal(signal.SIGTERM)
            r = p.result()
            tokens, usage = s.result()
        assert srv.proc.wait(30) == 0
    finally:
        srv.stop()
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["choices"][0]["finish_reason"] == "abort"
    sent = len(answer["choices"][0]["logprobs"]["tokens"])
    assert sent > 0, "the plain request generated nothing before the drain ended"
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert answer["usage"]["completion_tokens"] == sent
    assert answer["usage"]["total_tokens"] == len(prompt) + sent
    assert usage is not None, "the stream sent no usage chunk"
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] == tokens
