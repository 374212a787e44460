"""hf:// models through the real huggingface_hub client against the Hub double."""

from __future__ import annotations

import hashlib

import pytest
from huggingface_hub import get_hf_file_metadata, hf_hub_url

from shardline_runtime.model_loader.checkpoint_files import discover_checkpoint
from shardline_runtime.model_loader.errors import ModelSourceError
from shardline_runtime.model_loader.model_source import fetch_model, parse_model_source
from tests.model_sources.hub_double import git_blob_sha1

REPO = "shardline/tiny-llama"


def _fetch(text: str, download_dir, revision=None):
    return fetch_model(parse_model_source(text), download_dir, revision=revision)


def _data(hub, path: str) -> bytes:
    repo = hub.repos[REPO]
    return repo.commits[repo.refs["main"]][path]


def test_double_answers_lfs_metadata_as_the_client_expects(hub):
    url = hf_hub_url(REPO, "model.safetensors", revision="main", endpoint=hub.endpoint)
    meta = get_hf_file_metadata(url)
    assert meta.etag == hashlib.sha256(_data(hub, "model.safetensors")).hexdigest()


def test_double_redirects_lfs_files_to_another_origin(hub):
    url = hf_hub_url(REPO, "model.safetensors", revision="main", endpoint=hub.endpoint)
    assert get_hf_file_metadata(url).location.startswith(hub.cdn)


def test_double_reports_the_commit_in_x_repo_commit(hub):
    url = hf_hub_url(REPO, "config.json", revision="v1", endpoint=hub.endpoint)
    assert get_hf_file_metadata(url).commit_hash == hub.repos[REPO].refs["main"]


def test_double_gives_small_files_their_git_blob_etag(hub):
    url = hf_hub_url(REPO, "config.json", revision="main", endpoint=hub.endpoint)
    assert get_hf_file_metadata(url).etag == git_blob_sha1(_data(hub, "config.json"))


def test_branch_resolves_to_its_commit(hub, tmp_path):
    fetched = _fetch(f"hf://{REPO}@main", tmp_path)
    assert fetched.revision == hub.repos[REPO].refs["main"]


def test_fetched_directory_is_a_loadable_checkpoint(hub, tmp_path):
    fetched = _fetch(f"hf://{REPO}", tmp_path)
    assert "model.embed_tokens.weight" in discover_checkpoint(fetched.path)


def test_cache_directory_is_keyed_by_commit(hub, tmp_path):
    fetched = _fetch(f"hf://{REPO}@v1", tmp_path)
    assert fetched.path.name == f"hf--shardline--tiny-llama--{hub.repos[REPO].refs['main']}"


def test_lfs_bytes_are_read_through_the_redirect(hub, tmp_path):
    _fetch(f"hf://{REPO}", tmp_path)
    assert any(method == "GET" and path.startswith("/cdn/") for method, path in hub.requests)


def test_bare_repo_id_takes_the_revision_flag(hub, tmp_path):
    fetched = _fetch(REPO, tmp_path, revision="v1")
    assert fetched.revision == hub.repos[REPO].refs["v1"]


def test_second_fetch_of_a_revision_downloads_nothing(hub, tmp_path):
    _fetch(f"hf://{REPO}", tmp_path)
    hub.requests.clear()
    _fetch(f"hf://{REPO}", tmp_path)
    assert not [p for m, p in hub.requests if p.startswith("/cdn/") or "/resolve/" in p]


def test_missing_revision_is_not_found(hub, tmp_path):
    with pytest.raises(ModelSourceError) as err:
        _fetch(f"hf://{REPO}@no-such-branch", tmp_path)
    assert err.value.reason == "NotFound"


def test_missing_repository_is_not_found(hub, tmp_path):
    with pytest.raises(ModelSourceError) as err:
        _fetch("hf://shardline/absent", tmp_path)
    assert err.value.reason == "NotFound"


def test_private_repository_without_token_is_refused(hub, tmp_path):
    hub.repos[REPO].token = "hf_secret"
    with pytest.raises(ModelSourceError) as err:
        _fetch(f"hf://{REPO}", tmp_path)
    assert err.value.reason in ("Unauthorized", "NotFound")


def test_private_repository_with_its_token_is_fetched(hub, tmp_path, monkeypatch):
    hub.repos[REPO].token = "hf_secret"
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert _fetch(f"hf://{REPO}", tmp_path).path.is_dir()


def test_corrupt_lfs_file_fails_the_sha256_check(hub, tmp_path):
    hub.repos[REPO].corrupt.add("model.safetensors")
    with pytest.raises(ModelSourceError) as err:
        _fetch(f"hf://{REPO}", tmp_path)
    assert err.value.reason == "ChecksumMismatch"


def test_corrupt_revision_never_appears_in_the_cache(hub, tmp_path):
    hub.repos[REPO].corrupt.add("model.safetensors")
    with pytest.raises(ModelSourceError):
        _fetch(f"hf://{REPO}", tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == []


def test_fetch_after_a_checksum_failure_succeeds_once_the_bytes_are_right(hub, tmp_path):
    hub.repos[REPO].corrupt.add("model.safetensors")
    with pytest.raises(ModelSourceError):
        _fetch(f"hf://{REPO}", tmp_path)
    hub.repos[REPO].corrupt.clear()
    assert "model.embed_tokens.weight" in discover_checkpoint(_fetch(f"hf://{REPO}", tmp_path).path)
