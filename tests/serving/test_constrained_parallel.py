"""Constrained decoding under tensor and pipeline parallelism: every TP rank fills the same
bitmask from the same matchers (the ranks sample identical tokens), and under PP every stage keeps
the matchers while the last stage applies the mask; the output validates either way."""

from __future__ import annotations

import json

import jsonschema
import pytest
from serving_server import start_server

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                   "kind": {"enum": ["a", "b"]}},
    "required": ["id", "ok", "kind"],
    "additionalProperties": False,
}


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--tp-size", "2"), ("--pp-size", "2")], ids=["tp2", "pp2"])
def test_json_schema_output_validates_under_parallelism(serving_checkpoint, checkpoint_dir, flags):
    server = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", "1024", *flags)
    try:
        body = {"messages": [{"role": "user", "content": "json please"}], "n": 3, "max_tokens": 60,
                "temperature": 1.0, "seed": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
        r = server.post("/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    finally:
        server.stop()
