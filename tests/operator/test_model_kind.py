"""spec.model.kind: what a deployment serves (generate / embed), parsed, rendered into the
runtime's ``--model-kind`` and the client Service's label only when declared."""

from __future__ import annotations

import pytest

from shardline_operator import labels
from shardline_operator.render.services import build_client_service
from shardline_operator.runtime_args import ServedModel, runtime_args
from shardline_operator.spec import SpecError, parse_spec


def _spec(model_extra=None):
    model = {"name": "emb", "path": "/var/lib/shardline/models/emb/v1", **(model_extra or {})}
    return parse_spec("emb", "ns", "u", {"model": model, "runtime": {"image": "i"}})


def test_model_kind_defaults_to_auto():
    assert _spec().model.kind == "auto"


def test_unknown_model_kind_names_the_field_and_choices():
    with pytest.raises(SpecError, match="spec.model.kind must be one of auto, generate, embed"):
        _spec({"kind": "rerank"})


def test_a_declared_kind_is_passed_to_the_runtime():
    spec = _spec({"kind": "embed"})
    args = runtime_args(spec, 0, ServedModel.desired(spec))
    assert args[args.index("--model-kind") + 1] == "embed"


def test_auto_renders_no_model_kind_flag():
    spec = _spec()
    assert "--model-kind" not in runtime_args(spec, 0, ServedModel.desired(spec))


def test_the_client_service_is_labelled_with_a_declared_kind():
    service = build_client_service(_spec({"kind": "embed"}))
    assert service["metadata"]["labels"][labels.LABEL_MODEL_KIND] == "embed"


def test_user_args_may_not_repeat_the_model_kind_flag():
    with pytest.raises(SpecError, match="--model-kind"):
        parse_spec("emb", "ns", "u", {"model": {"name": "emb", "path": "/m/v1"},
                                      "runtime": {"image": "i", "args": ["--model-kind", "embed"]}})
