"""``spec.runtime.speculative``: parsed into the runtime's flags, refused where the runtime
refuses it (pipeline parallelism, LoRA adapters, an algorithm it does not serve)."""

from __future__ import annotations

import pytest

from shardline_operator.spec import SpecError, parse_spec

BASE = {"model": {"name": "m", "path": "/models/m/v1"}, "runtime": {"image": "r:1"}}


def _spec(speculative, **extra):
    return {**BASE, "runtime": {"image": "r:1", "speculative": speculative}, **extra}


def test_speculative_defaults_to_five_draft_tokens():
    parsed = parse_spec("m", "ns", "u", _spec({"algorithm": "NGRAM"}))
    assert parsed.runtime.speculative.num_draft_tokens == 5


def test_absent_speculative_is_off():
    assert parse_spec("m", "ns", "u", BASE).runtime.speculative is None


@pytest.mark.parametrize(
    ("speculative", "extra", "message"),
    [
        ({"algorithm": "MEDUSA"}, {}, "spec.runtime.speculative.algorithm must be one of NGRAM, STANDALONE, EAGLE, EAGLE3"),
        ({}, {}, "spec.runtime.speculative.algorithm must be one of NGRAM, STANDALONE, EAGLE, EAGLE3"),
        ({"algorithm": "EAGLE3"}, {}, "spec.runtime.speculative.draftModel is required with algorithm EAGLE3"),
        ({"algorithm": "EAGLE"}, {}, "spec.runtime.speculative.draftModel is required with algorithm EAGLE"),
        ({"algorithm": "NGRAM", "numDraftTokens": 1}, {}, "numDraftTokens"),
        ({"algorithm": "NGRAM"}, {"parallelism": {"tensor": 2, "pipeline": 2, "gpusPerPod": 4}},
         "not served with spec.parallelism.pipeline > 1"),
        ({"algorithm": "NGRAM"}, {"loraAdapters": [{"name": "a", "path": "/models/a"}]}, "spec.loraAdapters"),
    ],
)
def test_speculative_combinations_the_runtime_refuses_are_refused(speculative, extra, message):
    with pytest.raises(SpecError, match=message):
        parse_spec("m", "ns", "u", _spec(speculative, **extra))


def test_speculative_flags_are_reserved():
    with pytest.raises(SpecError, match="--speculative-algorithm"):
        parse_spec("m", "ns", "u", {**BASE, "runtime": {"image": "r:1", "args": ["--speculative-algorithm=NGRAM"]}})


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_eagle_renders_the_head_path(algorithm):
    from shardline_operator.runtime_args import ServedModel, runtime_args

    parsed = parse_spec("m", "ns", "u", _spec({"algorithm": algorithm, "draftModel": {"path": "/models/head"}}))
    args = runtime_args(parsed, 0, ServedModel.desired(parsed))
    assert args[args.index("--speculative-algorithm") + 1] == algorithm
    assert args[args.index("--speculative-draft-model-path") + 1] == "/models/head"


def test_standalone_renders_the_draft_model_path():
    from shardline_operator.runtime_args import ServedModel, runtime_args

    parsed = parse_spec("m", "ns", "u", _spec({"algorithm": "STANDALONE", "draftModel": {"path": "/models/draft"}}))
    args = runtime_args(parsed, 0, ServedModel.desired(parsed))
    assert args[args.index("--speculative-draft-model-path") + 1] == "/models/draft"


@pytest.mark.parametrize(
    ("speculative", "message"),
    [
        ({"algorithm": "STANDALONE"}, "spec.runtime.speculative.draftModel is required with algorithm STANDALONE"),
        ({"algorithm": "NGRAM", "draftModel": {"path": "/d"}}, "draftModel is not used by algorithm NGRAM"),
        ({"algorithm": "STANDALONE", "draftModel": {"path": "d"}}, "draftModel.path must be an absolute path"),
        ({"algorithm": "STANDALONE", "draftModel": {}}, "set exactly one of spec.runtime.speculative.draftModel.path"),
        ({"algorithm": "EAGLE", "draftModel": {"path": "/d", "uri": "hf://o/n"}}, "set exactly one of"),
        ({"algorithm": "EAGLE", "draftModel": {"uri": "pvc://claim/d"}},
         "draftModel.uri must be hf://ORG/NAME\\[@REVISION\\] or s3://BUCKET/PREFIX"),
    ],
)
def test_draft_model_fields_are_checked(speculative, message):
    with pytest.raises(SpecError, match=message):
        parse_spec("m", "ns", "u", _spec(speculative))


REMOTE = {"name": "m", "uri": "hf://org/target@v1"}


def test_a_draft_uri_renders_as_the_draft_path():
    from shardline_operator.runtime_args import ServedModel, runtime_args

    raw = {**_spec({"algorithm": "EAGLE", "draftModel": {"uri": "hf://org/head@v2"}}), "model": REMOTE}
    parsed = parse_spec("m", "ns", "u", raw)
    args = runtime_args(parsed, 0, ServedModel.desired(parsed))
    assert args[args.index("--speculative-draft-model-path") + 1] == "hf://org/head@v2"


def test_a_draft_uri_needs_a_remote_target():
    raw = _spec({"algorithm": "STANDALONE", "draftModel": {"uri": "s3://bucket/draft"}})
    with pytest.raises(SpecError, match="draftModel.uri needs an hf:// or s3:// spec.model.uri"):
        parse_spec("m", "ns", "u", raw)
