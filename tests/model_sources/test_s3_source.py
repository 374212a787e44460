"""s3:// models through boto3 against a real S3 server (versitygw, built once: slow)."""

from __future__ import annotations

import pytest

from shardline_runtime.model_loader.checkpoint_files import discover_checkpoint
from shardline_runtime.model_loader.errors import ModelSourceError
from shardline_runtime.model_loader.model_source import fetch_model, parse_model_source
from shardline_runtime.model_loader.revision_cache import PARTIAL
from shardline_runtime.model_loader.s3_source import file_etag, s3_client

# The server is a Go build on a cold machine (measured: 23 min wall on a busy 2-core host).
pytestmark = pytest.mark.slow


def _fetch(bucket: str, download_dir, prefix: str = "tiny/v1"):
    return fetch_model(parse_model_source(f"s3://{bucket}/{prefix}"), download_dir)


def test_fetched_prefix_is_a_loadable_checkpoint(s3, tmp_path):
    _, bucket = s3
    assert "model.embed_tokens.weight" in discover_checkpoint(_fetch(bucket, tmp_path).path)


def test_revision_is_the_digest_of_the_listing(s3, tmp_path):
    _, bucket = s3
    assert _fetch(bucket, tmp_path).revision.startswith("etags-")


def test_changed_object_is_a_new_revision(s3, tmp_path):
    _, bucket = s3
    before = _fetch(bucket, tmp_path).revision
    s3_client().put_object(Bucket=bucket, Key="tiny/v1/generation_config.json", Body=b"{}")
    assert _fetch(bucket, tmp_path).revision != before


def test_missing_prefix_is_not_found(s3, tmp_path):
    _, bucket = s3
    with pytest.raises(ModelSourceError) as err:
        _fetch(bucket, tmp_path, prefix="tiny/v9")
    assert err.value.reason == "NotFound"


def test_missing_bucket_is_not_found(s3, tmp_path):
    with pytest.raises(ModelSourceError) as err:
        _fetch("no-such-bucket", tmp_path)
    assert err.value.reason == "NotFound"


def test_wrong_secret_is_unauthorized(s3, tmp_path, monkeypatch):
    _, bucket = s3
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(ModelSourceError) as err:
        _fetch(bucket, tmp_path)
    assert err.value.reason == "Unauthorized"


def test_corrupt_object_fails_the_etag_check(s3, tmp_path):
    server, bucket = s3
    stored = server.object_path(bucket, "tiny/v1/model.safetensors")
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0xFF
    stored.write_bytes(bytes(data))
    with pytest.raises(ModelSourceError) as err:
        _fetch(bucket, tmp_path)
    assert err.value.reason == "ChecksumMismatch"


def test_multipart_etag_is_verified(s3, tmp_path):
    _, bucket = s3
    client = s3_client()
    key = "tiny/v1/model.safetensors"
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    part = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=body)
    done = {"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]}
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload=done)
    fetched = _fetch(bucket, tmp_path)
    listed = client.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')
    assert file_etag(fetched.path / "model.safetensors", len(body)) == listed


def test_interrupted_download_resumes_from_the_partial_file(s3, tmp_path):
    _, bucket = s3
    client = s3_client()
    body = client.get_object(Bucket=bucket, Key="tiny/v1/model.safetensors")["Body"].read()
    first = _fetch(bucket, tmp_path / "a")
    partial = tmp_path / "b" / PARTIAL / first.path.name
    partial.mkdir(parents=True)
    (partial / "model.safetensors.incomplete").write_bytes(body[: len(body) // 2])
    resumed = _fetch(bucket, tmp_path / "b")
    assert (resumed.path / "model.safetensors").read_bytes() == body
