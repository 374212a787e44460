"""``shardline-runtime download`` (the staging Job's command) against the Hub double."""

from __future__ import annotations

import json

import pytest

from shardline_runtime import termination_log
from shardline_runtime.cli import main


@pytest.fixture
def record(tmp_path, monkeypatch):
    """Reads the JSON line the command leaves in its termination log."""
    path = tmp_path / "termination-log"
    monkeypatch.setenv("SHARDLINE_TERMINATION_LOG", str(path))
    monkeypatch.setattr(termination_log, "_written", False)

    def read() -> dict:
        return json.loads(path.read_text())

    return read


def _download(tmp_path, uri: str) -> int:
    return main(["download", "--model-path", uri, "--download-dir", str(tmp_path / "cache")])


def test_download_reports_the_resolved_commit(hub, tmp_path, record):
    _download(tmp_path, "hf://shardline/tiny-llama@v1")
    assert record()["resolvedRevision"] == hub.repos["shardline/tiny-llama"].refs["v1"]


def test_download_succeeds_with_exit_0(hub, tmp_path, record):
    assert _download(tmp_path, "hf://shardline/tiny-llama@v1") == 0


def test_download_reports_the_bytes_it_staged(hub, tmp_path, record):
    _download(tmp_path, "hf://shardline/tiny-llama@v1")
    staged = tmp_path / "cache" / record()["cacheKey"]
    assert record()["bytes"] == sum(f.stat().st_size for f in staged.rglob("*") if f.is_file())


def test_second_download_of_a_revision_is_a_cache_hit(hub, tmp_path, record, monkeypatch):
    _download(tmp_path, "hf://shardline/tiny-llama@v1")
    monkeypatch.setattr(termination_log, "_written", False)
    (tmp_path / "termination-log").unlink()
    _download(tmp_path, "hf://shardline/tiny-llama@v1")
    assert record()["cached"] is True


def test_missing_revision_exits_3_so_the_job_is_not_retried(hub, tmp_path, record):
    assert _download(tmp_path, "hf://shardline/tiny-llama@nope") == 3


def test_missing_revision_is_reported_as_not_found(hub, tmp_path, record):
    _download(tmp_path, "hf://shardline/tiny-llama@nope")
    assert record()["reason"] == "NotFound"


def test_local_directory_is_refused_naming_the_flag(tmp_path, record):
    _download(tmp_path, str(tmp_path))
    assert "--model-path" in record()["message"]


def _download_with_draft(tmp_path, uri: str, draft: str) -> int:
    return main(["download", "--model-path", uri, "--draft-model-path", draft,
                 "--download-dir", str(tmp_path / "cache")])


def test_a_draft_is_staged_with_the_model(hub, tmp_path, record, tiny_checkpoint):
    """The staging Job of a deployment with a remote draft fetches both (issue 30)."""
    from pathlib import Path

    from tests.model_sources.conftest import checkpoint_files
    from tests.model_sources.hub_double import HubRepo

    draft = HubRepo()
    commit = draft.commit(checkpoint_files(Path(tiny_checkpoint("llama", seed=3))), ref="v1")
    hub.repos["shardline/tiny-draft"] = draft
    assert _download_with_draft(tmp_path, "hf://shardline/tiny-llama@v1", "hf://shardline/tiny-draft@v1") == 0
    out = record()
    assert out["draftResolvedRevision"] == commit
    assert (tmp_path / "cache" / out["draftCacheKey"] / "config.json").is_file()
    staged = [tmp_path / "cache" / out["cacheKey"], tmp_path / "cache" / out["draftCacheKey"]]
    assert out["bytes"] == sum(f.stat().st_size for d in staged for f in d.rglob("*") if f.is_file())


def test_a_missing_draft_fails_staging_naming_the_draft(hub, tmp_path, record):
    assert _download_with_draft(tmp_path, "hf://shardline/tiny-llama@v1", "hf://shardline/tiny-draft@v1") == 3
    assert record()["reason"] == "NotFound"
    assert record()["message"].startswith("--draft-model-path hf://shardline/tiny-draft@v1: ")
