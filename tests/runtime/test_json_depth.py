"""The request-body depth limit is found without parsing (so without recursion)."""

from __future__ import annotations

import pytest

from shardline_runtime.entrypoints.json_depth import MAX_JSON_DEPTH, check_depth, too_deep
from shardline_runtime.managers.request_validation import RequestValidationError


def _arrays(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_nesting_at_the_limit_passes():
    assert too_deep('{"a": ' + _arrays(MAX_JSON_DEPTH - 1) + "}") is None


def test_nesting_past_the_limit_names_the_top_level_key():
    assert too_deep('{"x": 1, "deep": ' + _arrays(MAX_JSON_DEPTH) + "}") == ("deep", MAX_JSON_DEPTH + 1)


def test_brackets_inside_strings_do_not_count():
    text = '{"prompt": "' + "[{" * 1000 + '\\" [[["}'
    assert too_deep(text) is None


def test_an_escaped_quote_does_not_end_a_key():
    assert too_deep('{"k\\"ey": ' + _arrays(MAX_JSON_DEPTH) + "}") == ('k\\"ey', MAX_JSON_DEPTH + 1)


def test_check_depth_names_the_given_field():
    with pytest.raises(RequestValidationError) as info:
        check_depth(_arrays(MAX_JSON_DEPTH + 1), "sampling_params.json_schema")
    assert info.value.param == "sampling_params.json_schema"


def test_a_top_level_array_too_deep_names_the_request_body():
    with pytest.raises(RequestValidationError, match="^request body: JSON nested more than 400"):
        check_depth(_arrays(MAX_JSON_DEPTH + 1))
