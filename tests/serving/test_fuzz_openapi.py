"""Property-based fuzzing (schemathesis) of the server's own OpenAPI schema, and of chat requests
drawn from OpenAI's schema of ``messages``: no 5xx except the designed 503s, and the server still
answers afterwards."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from openai_chat_schema import CHAT_SCHEMA
from serving_server import start_server

EXAMPLES_PER_OPERATION = 50  # per operation and mode (valid / invalid data): a few hundred requests
CHAT_EXAMPLES = 100  # per mode, on chat alone


@pytest.fixture(scope="module")
def fuzz_server(serving_checkpoint, checkpoint_dir):
    # A short context keeps every generated request cheap: big max_tokens become 400s.
    srv = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", "512", "--context-length", "96",
                       "--served-model-name", "tiny-llama")
    yield srv
    assert srv.get("/health").status_code == 200
    out = srv.post("/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert out.status_code == 200, out.text
    srv.stop()


def _fuzz(schema, server, examples: int) -> list[int]:
    """Call every operation of ``schema`` with valid and invalid data; return the status codes."""
    calls = []
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation, mode in [(op, m) for op in operations for m in schemathesis.GenerationMode]:

        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case):
            response = case.call(base_url=server.url, timeout=120)
            calls.append(response.status_code)
            assert response.status_code < 500 or response.status_code == 503, (
                f"{case.method} {case.path} body={case.body!r} -> {response.status_code}: {response.text[:500]}"
            )
            if response.status_code >= 400:  # an OpenAI error object, or {"success": false, ...}
                body = response.json()
                assert "error" in body or body.get("success") is False

        try:
            check()
        except Unsatisfiable:
            assert mode == schemathesis.GenerationMode.NEGATIVE  # nothing to make invalid (no parameters)
    return calls


@pytest.mark.slow
def test_no_server_errors(fuzz_server):
    calls = _fuzz(schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json"), fuzz_server, EXAMPLES_PER_OPERATION)
    assert len(calls) >= 300


@pytest.mark.slow
def test_chat_messages_from_openai_schema(fuzz_server):
    calls = _fuzz(schemathesis.openapi.from_dict(CHAT_SCHEMA), fuzz_server, CHAT_EXAMPLES)
    assert len(calls) >= CHAT_EXAMPLES and 200 in calls and 400 in calls  # both paths were exercised
