"""The grammar backend (xgrammar behind ``GrammarBackend``) and the sampler's bitmask, alone."""

from __future__ import annotations

import json

import pytest
import torch

from shardline_runtime.constrained.grammar_spec import GrammarError, GrammarSpec
from shardline_runtime.constrained.xgrammar_backend import (
    GrammarBackend,
    allow_all_bitmask,
    apply_token_bitmask,
    bounded_strings_without_control_characters,
)


@pytest.fixture(scope="module")
def backend(tiny_checkpoint):
    path = tiny_checkpoint("llama", 0)
    return GrammarBackend.from_tokenizer_path(str(path), vocab_size=512, stop_token_ids=[2])


def test_bitmask_keeps_allowed_tokens_and_sets_the_rest_to_minus_infinity():
    logits = torch.zeros(2, 70)
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # row 0: token 5 only
    bitmask[1, 2] = 1 << 1  # row 1: token 65 only
    apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(logits).nonzero().tolist() == [[0, 5], [1, 65]]


def test_a_bitmask_of_other_rows_is_refused():
    with pytest.raises(ValueError, match="does not cover"):
        apply_token_bitmask(torch.zeros(2, 70), torch.zeros(1, 3, dtype=torch.int32))


def test_allow_all_bitmask_leaves_logits_unchanged():
    logits = torch.randn(3, 100)
    assert torch.equal(apply_token_bitmask(logits.clone(), allow_all_bitmask(3, 100)), logits)


def test_a_matcher_allows_exactly_the_grammar_first_tokens(backend):
    grammar = backend.matcher(GrammarSpec("regex", "[0-9]+", param="regex"))
    bitmask = allow_all_bitmask(1, 512)
    grammar.fill_bitmask(bitmask, 0)
    logits = apply_token_bitmask(torch.zeros(1, 512), bitmask)
    tokenizer = backend.tokenizer
    allowed = [tokenizer.decode([t]) for t in torch.isfinite(logits[0]).nonzero().flatten().tolist()]
    assert allowed and all(text.isdigit() for text in allowed), allowed


def test_compiled_grammars_are_cached_per_schema(backend):
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert backend.compile(spec) is backend.compile(GrammarSpec(spec.kind, spec.source))


def test_a_schema_the_library_rejects_names_the_request_field(backend):
    with pytest.raises(GrammarError) as err:
        backend.compile(GrammarSpec("json_schema", json.dumps({"type": "nonsense"})))
    assert err.value.param == "response_format"


def test_the_grammar_completes_only_through_a_stop_token(backend):
    grammar = backend.matcher(GrammarSpec("regex", "a", param="regex"))
    tokenizer = backend.tokenizer
    assert grammar.accept(tokenizer.encode("a")[0])
    assert not grammar.is_terminated()
    assert grammar.accept(2)
    assert grammar.is_terminated()


def test_bounded_strings_become_patterns_without_control_characters():
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 4}}}
    fixed = bounded_strings_without_control_characters(schema)
    assert fixed["properties"]["s"] == {"type": "string", "pattern": '^[^\\x00-\\x1f"\\\\]{1,4}$'}
