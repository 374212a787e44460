"""LoRA through a real server: pick adapters by OpenAI ``model`` and ``/generate`` ``lora_path``,
mixed concurrent requests, /v1/models, load / use / unload / reload, and the 400/503 answers."""

import asyncio
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from lora_fixtures import make_peft_adapter, peft_greedy  # noqa: E402
from serving_server import start_server  # noqa: E402

PROMPT = [5, 17, 200, 33, 9, 41, 77, 300]
STEPS = 6


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("lora-serving")
    base = make_tiny_checkpoint(root / "base", arch="llama", seed=0, max_position_embeddings=8192)
    adapters = {
        "a": make_peft_adapter(base, root / "a", r=4, seed=1),
        "b": make_peft_adapter(base, root / "b", r=8, alpha=16, seed=2, target_modules=("q_proj", "v_proj", "up_proj")),
        "c": make_peft_adapter(base, root / "c", r=2, seed=3),
        "high": make_peft_adapter(base, root / "high", r=16, seed=4),
    }
    other = make_tiny_checkpoint(root / "other-base", arch="llama", seed=0, hidden_size=48)
    adapters["other"] = make_peft_adapter(other, root / "other", r=4, seed=5)
    expected = {n: peft_greedy(base, adapters[n], PROMPT, STEPS) for n in ("a", "b", "c")}
    expected[None] = peft_greedy(base, None, PROMPT, STEPS)
    srv = start_server(base, root, "--served-model-name", "tiny", "--max-total-tokens", "20000",
                       "--lora-paths", f"a={adapters['a']}", "--max-loras-per-batch", "2", "--max-lora-rank", "8")
    yield srv, adapters, expected
    srv.stop()


def gen(srv, lora=None, steps=STEPS):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": steps, "temperature": 0, "ignore_eos": True}}
    if lora is not None:
        body["lora_path"] = lora
    return srv.post("/generate", body)


async def _gen_many(srv, loras):
    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
        bodies = [{"input_ids": PROMPT, "lora_path": n,
                   "sampling_params": {"max_new_tokens": STEPS, "temperature": 0, "ignore_eos": True}} for n in loras]
        replies = await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))
        return [r.json()["output_ids"] for r in replies]


def test_load_use_unload_reload(lora_setup):
    srv, adapters, expected = lora_setup
    models = srv.get("/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("a", "tiny")]
    r = gen(srv, "a")
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == expected["a"] != expected[None]
    assert gen(srv).json()["output_ids"] == expected[None]
    chat = srv.post("/v1/completions", {"model": "a", "prompt": PROMPT, "max_tokens": STEPS, "temperature": 0,
                                        "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == "a"

    r = srv.post("/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])})
    assert r.status_code == 200, r.text
    # one forward mixes the base model and both adapters; each equals its request alone
    loras = ["a", None, "b", "a", "b", None]
    assert asyncio.run(_gen_many(srv, loras)) == [expected[n] for n in loras]

    for name, path, param, text in (("x", "/nonexistent", "lora_path", "adapter_config.json not found"),
                                    ("x", str(adapters["high"]), "lora_path", "--max-lora-rank 8"),
                                    ("x", str(adapters["other"]), "lora_path", "wrong base architecture"),
                                    ("a", str(adapters["c"]), "lora_name", "already loaded"),
                                    # the served model's name (or path) would shadow the base model
                                    ("tiny", str(adapters["c"]), "lora_name", "served model's name"),
                                    (models[0]["root"], str(adapters["c"]), "lora_name", "served model's name")):
        r = srv.post("/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and text in r.json()["message"]
    assert gen(srv, "a").json()["output_ids"] == expected["a"]  # still serving after refusals
    assert [m["id"] for m in srv.get("/v1/models").json()["data"]] == ["tiny", "a", "b"]

    r = srv.post("/unload_lora_adapter", {"lora_name": "a"})
    assert r.status_code == 200, r.text
    r = gen(srv, "a")
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert srv.post("/unload_lora_adapter", {"lora_name": "a"}).status_code == 400
    r = srv.post("/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["a"])})
    assert r.status_code == 200, r.text
    assert gen(srv, "a").json()["output_ids"] == expected["a"]
    assert gen(srv, "b").json()["output_ids"] == expected["b"]


def test_full_pool_evicts_idle_or_answers_503(lora_setup):
    srv, adapters, expected = lora_setup
    for name in ("a", "b"):
        if name not in {m["id"] for m in srv.get("/v1/models").json()["data"]}:
            assert srv.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters[name])}).status_code == 200
    gen(srv, "b")  # b is now the more recently used one

    async def busy_then_load():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            long = {"sampling_params": {"max_new_tokens": 8000, "temperature": 0, "ignore_eos": True}, "stream": True}
            started = [asyncio.Event(), asyncio.Event()]

            async def consume(name, event):  # read to the end: closing the stream would abort it
                async with client.stream("POST", "/generate", json={"input_ids": PROMPT, "lora_path": name, **long}) as resp:
                    async for _ in resp.aiter_lines():
                        event.set()

            tasks = [asyncio.create_task(consume(n, e)) for n, e in zip(("a", "b"), started)]
            for event in started:
                await event.wait()
            full = await client.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])})
            await client.post("/abort_request", json={"abort_all": True})
            await asyncio.gather(*tasks)
            return full

    full = asyncio.run(busy_then_load())
    assert full.status_code == 503, full.text
    gen(srv, "a")
    gen(srv, "b")  # the busy phase used both; b is now the more recently used one again
    r = srv.post("/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["c"])})
    assert r.status_code == 200, r.text
    assert sorted(r.json()["loaded_adapters"]) == ["b", "c"]  # a was the least recently used
    assert [m["id"] for m in srv.get("/v1/models").json()["data"]] == ["tiny", "b", "c"]
    assert gen(srv, "c").json()["output_ids"] == expected["c"]


def test_input_embeds_and_replace_embeds_over_http(lora_setup):
    """(Same server: input embeds need no LoRA, this only saves a start-up.) Token embeddings
    sent as ``input_embeds`` give the token path's tokens and logprobs; ``replace_embeds``
    equals transformers with ``inputs_embeds``; wrong shapes are 400s naming the field."""
    import torch
    import transformers

    srv, _, expected = lora_setup
    base = srv.args[srv.args.index("--model-path") + 1]
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    table = model.get_input_embeddings().weight.detach()
    sampling = {"max_new_tokens": STEPS, "temperature": 0, "ignore_eos": True}
    by_ids = srv.post("/generate", {"input_ids": PROMPT, "sampling_params": sampling, "return_logprob": True}).json()
    by_embeds = srv.post("/generate", {"input_embeds": table[PROMPT].tolist(), "sampling_params": sampling,
                                       "return_logprob": True})
    assert by_embeds.status_code == 200, by_embeds.text
    assert by_embeds.json()["output_ids"] == by_ids["output_ids"] == expected[None]
    assert by_embeds.json()["meta_info"]["output_token_logprobs"] == by_ids["meta_info"]["output_token_logprobs"]

    g = torch.Generator().manual_seed(7)
    vectors = torch.randn(2, table.shape[1], generator=g)
    positions = [1, 4]
    r = srv.post("/generate", {"input_ids": PROMPT, "replace_embeds": vectors.tolist(), "replace_positions": positions,
                               "sampling_params": sampling})
    assert r.status_code == 200, r.text
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(STEPS):
            embeds = model.get_input_embeddings()(torch.tensor([ids]))
            embeds[0, positions] = vectors
            ids.append(int(model(inputs_embeds=embeds).logits[0, -1].argmax()))
    assert r.json()["output_ids"] == ids[len(PROMPT):] != expected[None]

    hidden = table.shape[1]
    for body, param in (({"input_embeds": [[0.0] * (hidden - 1)]}, "input_embeds"),
                        ({"input_embeds": []}, "input_embeds"),
                        ({"input_ids": PROMPT, "input_embeds": [[0.0] * hidden]}, "text"),
                        ({"input_ids": PROMPT, "replace_embeds": [[0.0] * hidden], "replace_positions": [len(PROMPT)]}, "replace_positions"),
                        ({"input_ids": PROMPT, "replace_embeds": [[0.0] * 3], "replace_positions": [0]}, "replace_embeds"),
                        ({"input_ids": PROMPT, "replace_embeds": [[0.0] * hidden]}, "replace_positions")):
        r = srv.post("/generate", {**body, "sampling_params": sampling})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text


def test_unload_answers_once_the_adapters_running_requests_finished(lora_setup):
    import threading
    import time

    srv, adapters, _ = lora_setup
    r = srv.post("/load_lora_adapter", {"lora_name": "busy", "lora_path": str(adapters["c"])})
    assert r.status_code == 200, r.text
    finished: dict = {}

    def generate(i: int) -> None:
        body = {"input_ids": PROMPT, "lora_path": "busy",
                "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
        try:
            reply = srv.post("/generate", body, timeout=600)
            finished[i] = (time.monotonic(), reply.status_code, len(reply.json().get("output_ids", [])))
        except Exception as exc:  # reported below with the others' results
            finished[i] = (time.monotonic(), repr(exc), 0)

    runners = [threading.Thread(target=generate, args=(i,)) for i in range(2)]
    for t in runners:
        t.start()
    deadline = time.monotonic() + 60
    while srv.get("/get_server_info").json()["num_running_reqs"] < 2:
        assert time.monotonic() < deadline, "the adapter's requests did not start"
        time.sleep(0.02)
    unload = srv.post("/unload_lora_adapter", {"lora_name": "busy"}, timeout=300)
    unloaded_at = time.monotonic()
    for t in runners:
        t.join(300)
    assert unload.status_code == 200, unload.text
    assert [finished[i][1:] for i in range(2)] == [(200, 200), (200, 200)]  # ran to the end on the adapter
    assert unloaded_at >= max(finished[i][0] for i in range(2)), "the unload answered before its requests ended"
    assert gen(srv, "busy").status_code == 400


def test_prefix_cache_is_off_with_lora(lora_setup):
    srv, _, _ = lora_setup
    first = gen(srv).json()["meta_info"]
    second = gen(srv).json()["meta_info"]  # the same prompt again: with a prefix cache it would hit
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] == 0


SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                   "kind": {"enum": ["a", "b"]}},
    "required": ["id", "ok", "kind"],
    "additionalProperties": False,
}


async def _constrained_batch(srv, loras):
    import json

    async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
        bodies = [{"input_ids": PROMPT, "lora_path": n,
                   "sampling_params": {"max_new_tokens": 60, "temperature": 1.0, "seed": i,
                                       "json_schema": json.dumps(SCHEMA)}}
                  for i, n in enumerate(loras)]
        replies = await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))
    return replies


def test_constrained_output_validates_with_and_without_an_adapter(lora_setup):
    # issue 26: constrained decoding composes with LoRA (the mask applies to the adapter's
    # logits); one batch mixes adapter rows and base rows, all forced by the same schema.
    import json

    import jsonschema

    srv, adapters, _ = lora_setup
    # the earlier tests leave other adapters loaded; an idle one is evicted if the pool is full
    loaded = srv.post("/load_lora_adapter", {"lora_name": "json", "lora_path": str(adapters["b"])})
    assert loaded.status_code == 200, loaded.text
    replies = asyncio.run(_constrained_batch(srv, ["json", None, "json", None]))
    assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
    for reply in replies:
        jsonschema.validate(json.loads(reply.json()["text"]), SCHEMA)
