"""Constrained decoding inside the scheduler: a random tiny model, sampled at temperature 1,
forced by a JSON schema / regex / EBNF grammar produces output that fits for every request, in
mixed batches with free requests, with and without overlap scheduling, with chunked prefill,
``n`` copies of one prompt, retraction, and across an in-place weight update."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from scheduler_harness import collect_results, greedy, make_scheduler, run_loop

from shardline_runtime.constrained.grammar_spec import GrammarSpec
from shardline_runtime.managers.io_struct import AbortReq, TokenizedGenerateReqInput, UpdateWeightsFromDiskReqInput
from shardline_runtime.sampling.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "color", "tags"],
    "additionalProperties": False,
}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama", 0, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpt))


def _request(rid: str, rng: random.Random, grammar: GrammarSpec | None, seed: int, prompt_len: int = 12):
    params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=seed)
    return TokenizedGenerateReqInput(
        rid=rid, input_ids=[rng.randrange(5, 500) for _ in range(prompt_len)], sampling_params=params,
        grammar=grammar,
    )


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_every_constrained_request_of_a_mixed_batch_produces_json_that_validates(ckpt, tokenizer, overlap):
    rng = random.Random(0)
    scheduler = make_scheduler(ckpt, disable_overlap_schedule=not overlap, chunked_prefill_size=16)
    arrivals: dict[int, list] = {0: [], 3: []}
    for i in range(12):  # half constrained, half free; a long prompt is prefilled in chunks
        grammar = SPEC if i % 2 == 0 else None
        arrivals[0 if i < 6 else 3].append(_request(f"r{i}", rng, grammar, seed=i, prompt_len=40 if i == 4 else 12))
    results = run_loop(scheduler, arrivals)
    for i in range(0, 12, 2):
        out = results[f"r{i}"]
        assert out["finish"]["type"] == "stop", f"r{i} ended {out['finish']}"
        jsonschema.validate(json.loads(_text(tokenizer, out["ids"])), SCHEMA)


def test_free_requests_of_a_mixed_batch_sample_as_without_constrained_neighbours(ckpt):
    """A seeded free request draws the same tokens whether constrained requests share its batch."""
    rng = random.Random(1)
    free = _request("free", rng, None, seed=7)
    alone = run_loop(make_scheduler(ckpt), {0: [free]})["free"]["ids"]
    mixed = run_loop(make_scheduler(ckpt), {0: [free, _request("c", rng, SPEC, seed=3)]})["free"]["ids"]
    assert mixed == alone


def test_n_copies_of_one_prompt_each_follow_the_schema(ckpt, tokenizer):
    rng = random.Random(2)
    first = _request("c0", rng, SPEC, seed=0)
    copies = [TokenizedGenerateReqInput(rid=f"c{k}", input_ids=first.input_ids,
                                        sampling_params=SamplingParams(max_new_tokens=200, temperature=1.0, seed=k),
                                        grammar=SPEC) for k in range(4)]
    results = run_loop(make_scheduler(ckpt), {0: copies})
    texts = [_text(tokenizer, results[f"c{k}"]["ids"]) for k in range(4)]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1, "the copies are independent draws"


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        (GrammarSpec("regex", r"[a-c]{2,5}-[0-9]{3}", param="regex"), r"[a-c]{2,5}-[0-9]{3}"),
        (GrammarSpec("ebnf", 'root ::= ("yes" | "no") " " [0-9]', param="ebnf"), r"(yes|no) [0-9]"),
    ],
    ids=["regex", "ebnf"],
)
def test_regex_and_ebnf_outputs_match(ckpt, tokenizer, spec, pattern):
    rng = random.Random(3)
    results = run_loop(make_scheduler(ckpt), {0: [_request(f"g{i}", rng, spec, seed=i) for i in range(4)]})
    for i in range(4):
        assert re.fullmatch(pattern, _text(tokenizer, results[f"g{i}"]["ids"])), results[f"g{i}"]


@pytest.mark.slow
def test_retracted_constrained_requests_still_produce_valid_json(ckpt, tokenizer):
    """A KV pool too small for every request retracts some; re-prefilled, they keep their grammar."""
    rng = random.Random(4)
    scheduler = make_scheduler(ckpt, max_total_tokens=300)
    reqs = [_request(f"t{i}", rng, SPEC, seed=i, prompt_len=30) for i in range(8)]
    results = run_loop(scheduler, {0: reqs})
    for i in range(8):
        jsonschema.validate(json.loads(_text(tokenizer, results[f"t{i}"]["ids"])), SCHEMA)


@pytest.mark.slow
def test_constrained_requests_survive_an_in_place_weight_update(ckpt, tokenizer, tiny_checkpoint):
    """Requests held across an in-place update run on the new weights under their grammars."""
    other = tiny_checkpoint("llama", 1, max_position_embeddings=2048)
    rng = random.Random(5)
    scheduler = make_scheduler(ckpt)
    first = [_request(f"a{i}", rng, SPEC, seed=i) for i in range(3)]
    later = [_request(f"b{i}", rng, SPEC, seed=i) for i in range(3)]
    update = UpdateWeightsFromDiskReqInput(model_path=str(other))
    results = run_loop(scheduler, {0: first, 2: [update], 3: later})
    for rid in [r.rid for r in first + later]:
        jsonschema.validate(json.loads(_text(tokenizer, results[rid]["ids"])), SCHEMA)


def test_constrained_requests_keep_their_grammar_under_speculative_decoding(ckpt, tokenizer):
    """With ``--speculative-algorithm NGRAM`` and repetitive prompts (drafts exist), every
    constrained output still fits its schema or regex."""
    rng = random.Random(5)
    scheduler = make_scheduler(ckpt, disable_overlap_schedule=True, speculative_algorithm="NGRAM")
    regex = GrammarSpec("regex", r"(yes|no)[0-9]{2}", param="regex")
    reqs = [_request(f"j{i}", rng, SPEC, seed=i) for i in range(3)]
    reqs += [_request(f"r{i}", rng, regex, seed=i) for i in range(3)]
    for req in reqs:
        req.input_ids = req.input_ids[:4] * 5
    results = run_loop(scheduler, {0: reqs})
    for i in range(3):
        jsonschema.validate(json.loads(_text(tokenizer, results[f"j{i}"]["ids"])), SCHEMA)
        assert re.fullmatch(r"(yes|no)[0-9]{2}", _text(tokenizer, results[f"r{i}"]["ids"])), results[f"r{i}"]


def _slow_spec() -> GrammarSpec:
    """390 nested arrays: seconds to compile (the HTTP tier's slow-schema test uses the same)."""
    schema: dict = {"type": "integer"}
    for _ in range(390):
        schema = {"type": "array", "items": schema}
    return GrammarSpec("json_schema", json.dumps(schema))


def _step(scheduler, messages=()) -> None:
    scheduler.receiver.backlog.extend(messages)
    scheduler.run_step(scheduler.recv_requests())


def _tokens(scheduler, rid: str) -> int:
    return len(collect_results(scheduler.sender.socket.messages).get(rid, {"ids": []})["ids"])


@pytest.mark.slow
def test_free_requests_keep_decoding_while_a_slow_grammar_compiles(ckpt):
    """The compile runs in a worker thread: the loop keeps stepping the free request meanwhile,
    and the constrained request is admitted once its grammar is ready."""
    scheduler = make_scheduler(ckpt, disable_overlap_schedule=True)
    _step(scheduler, [greedy("free", list(range(5, 15)), 1500)])
    slow = TokenizedGenerateReqInput(rid="slow", input_ids=[5, 6, 7],
                                     sampling_params=SamplingParams(max_new_tokens=4, temperature=1.0))
    slow.grammar = _slow_spec()
    _step(scheduler, [slow])
    steps_while_compiling = 0
    while "slow" in scheduler.grammar_queue.pending:
        before = _tokens(scheduler, "free")
        _step(scheduler)
        steps_while_compiling += "slow" in scheduler.grammar_queue.pending and _tokens(scheduler, "free") > before
    while not scheduler.is_idle():
        _step(scheduler)
    assert steps_while_compiling >= 3
    assert _tokens(scheduler, "slow") == 4


def test_aborting_a_request_whose_grammar_compiles_answers_it_and_frees_the_queue(ckpt):
    scheduler = make_scheduler(ckpt)
    slow = TokenizedGenerateReqInput(rid="slow", input_ids=[5, 6, 7],
                                     sampling_params=SamplingParams(max_new_tokens=4), grammar=_slow_spec())
    _step(scheduler, [slow])
    _step(scheduler, [AbortReq("slow")])
    assert collect_results(scheduler.sender.socket.messages)["slow"]["finish"]["type"] == "abort"
    assert scheduler.is_idle()
