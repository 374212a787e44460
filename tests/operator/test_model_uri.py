"""spec.model.uri: parsing (hf://, s3://, pvc://), its errors, and what it renders."""

from __future__ import annotations

import pytest

from shardline_operator.render.pod_template import build_pod_template
from shardline_operator.runtime_args import ServedModel, runtime_args
from shardline_operator.spec import SpecError
from shardline_operator.spec_model import MODEL_CACHE_DIR

ONE_POD = {"parallelism": {"tensor": 1, "gpusPerPod": 1}}
HF = {"name": "m", "uri": "hf://Org/Name@v2"}
S3 = {"name": "m", "uri": "s3://models/llama/v3", "s3": {"endpoint": "http://s3.local:7070",
      "region": "eu-1"}, "credentialsSecretRef": {"name": "store-keys"}}


def _env(spec) -> dict:
    container = build_pod_template(spec, 0, ServedModel.desired(spec))["spec"]["containers"][0]
    return {e["name"]: e for e in container["env"]}


def _volumes(spec) -> dict:
    template = build_pod_template(spec, 0, ServedModel.desired(spec))
    return {v["name"]: v for v in template["spec"]["volumes"]}


def test_hf_uri_is_the_runtime_model_path(make_spec):
    spec = make_spec({**ONE_POD, "model": HF})
    args = runtime_args(spec, 0, ServedModel.desired(spec))
    assert args[args.index("--model-path") + 1] == "hf://Org/Name@v2"


def test_hf_uri_revision_is_the_default_label(make_spec):
    assert make_spec({**ONE_POD, "model": HF}).model.revision == "v2"


def test_hf_uri_without_revision_is_labelled_main(make_spec):
    assert make_spec({**ONE_POD, "model": {"name": "m", "uri": "hf://Org/Name"}}).model.revision == "main"


def test_s3_uri_revision_is_the_last_prefix_component(make_spec):
    assert make_spec({**ONE_POD, "model": S3}).model.revision == "v3"


def test_remote_uri_downloads_into_the_cache_volume(make_spec):
    spec = make_spec({**ONE_POD, "model": HF})
    assert _env(spec)["SHARDLINE_MODEL_CACHE"]["value"] == MODEL_CACHE_DIR


def test_download_dir_flag_reads_the_cache_env(make_spec):
    spec = make_spec({**ONE_POD, "model": HF})
    args = runtime_args(spec, 0, ServedModel.desired(spec))
    assert args[args.index("--download-dir") + 1] == "$(SHARDLINE_MODEL_CACHE)"


def test_cache_volume_defaults_to_an_empty_dir(make_spec):
    assert _volumes(make_spec({**ONE_POD, "model": HF}))["model-cache"]["emptyDir"] == {}


def test_cache_bound_becomes_the_runtime_flag(make_spec):
    spec = make_spec({**ONE_POD, "model": {**HF, "cache": {"maxBytes": 1000}}})
    args = runtime_args(spec, 0, ServedModel.desired(spec))
    assert args[args.index("--download-max-bytes") + 1] == "1000"


def test_s3_endpoint_reaches_the_runtime_env(make_spec):
    assert _env(make_spec({**ONE_POD, "model": S3}))["AWS_ENDPOINT_URL_S3"]["value"] == "http://s3.local:7070"


def test_credentials_come_from_the_secret_only(make_spec):
    ref = _env(make_spec({**ONE_POD, "model": S3}))["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "store-keys", "key": "AWS_SECRET_ACCESS_KEY", "optional": True}


def test_pvc_uri_mounts_the_claim_read_only(make_spec):
    spec = make_spec({**ONE_POD, "model": {"name": "m", "uri": "pvc://models/llama/v1"}})
    assert spec.model.volume == {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}


def test_pvc_uri_path_is_inside_the_mount(make_spec):
    spec = make_spec({**ONE_POD, "model": {"name": "m", "uri": "pvc://models/llama/v1"}})
    assert spec.model.path == "/var/lib/shardline/models/llama/v1"


def test_pvc_uri_is_not_fetched(make_spec):
    spec = make_spec({**ONE_POD, "model": {"name": "m", "uri": "pvc://models/llama/v1"}})
    assert "--download-dir" not in runtime_args(spec, 0, ServedModel.desired(spec))


def test_changing_the_hf_revision_keeps_the_restart_hash(make_spec):
    before = make_spec({**ONE_POD, "model": HF}).restart_hash()
    assert make_spec({**ONE_POD, "model": {**HF, "uri": "hf://Org/Name@v3"}}).restart_hash() == before


@pytest.mark.parametrize("model, field", [
    ({"name": "m"}, "set exactly one of spec.model.path and spec.model.uri"),
    ({"name": "m", "path": "/m/v1", "uri": "hf://a/b"}, "set exactly one of"),
    ({"name": "m", "uri": "hf://only-one"}, "spec.model.uri must be hf://ORG/NAME"),
    ({"name": "m", "uri": "gs://bucket/p"}, "spec.model.uri must be"),
    ({"name": "m", "uri": "s3://Bad_Bucket/p"}, "spec.model.uri must be"),
    ({"name": "m", "uri": "pvc://models/../etc"}, "leaves the claim"),
    ({"name": "m", "uri": "hf://a/b", "volume": {"emptyDir": {}}}, "spec.model.volume applies to"),
    ({"name": "m", "uri": "hf://a/b", "s3": {"region": "x"}}, "spec.model.s3 applies to an s3://"),
    ({"name": "m", "uri": "s3://b-1/p", "s3": {"endpoint": "s3.local"}}, "spec.model.s3.endpoint"),
    ({"name": "m", "uri": "pvc://c/p", "credentialsSecretRef": {"name": "k"}},
     "spec.model.credentialsSecretRef applies to"),
    ({"name": "m", "uri": "hf://a/b", "credentialsSecretRef": {"name": "Bad_Name"}},
     "spec.model.credentialsSecretRef.name"),
    ({"name": "m", "uri": "hf://a/b", "cache": {"maxBytes": -1}}, "spec.model.cache.maxBytes"),
])
def test_invalid_model_reference_is_named(make_spec, model, field):
    with pytest.raises(SpecError, match=field.replace(".", r"\.").replace("[", r"\[")):
        make_spec({**ONE_POD, "model": model})


def test_multi_pod_groups_need_a_shared_cache_claim(make_spec):
    with pytest.raises(SpecError, match="spec.model.cache.volume must be a shared"):
        make_spec({**ONE_POD, "model": HF, "parallelism": {"tensor": 2, "gpusPerPod": 1}})


def test_multi_pod_groups_accept_a_shared_cache_claim(make_spec):
    cache = {"volume": {"persistentVolumeClaim": {"claimName": "cache"}}}
    spec = make_spec({**ONE_POD, "model": {**HF, "cache": cache}, "parallelism": {"tensor": 2, "gpusPerPod": 1}})
    assert spec.model.cache_volume == cache["volume"]


def test_changing_the_credentials_secret_changes_the_restart_hash(make_spec):
    before = make_spec({**ONE_POD, "model": S3}).restart_hash()
    other = {**S3, "credentialsSecretRef": {"name": "other-keys"}}
    assert make_spec({**ONE_POD, "model": other}).restart_hash() != before
