"""Parsing of model references and ``shardline-runtime serve`` with a remote --model-path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardline_runtime.cli import fetch_model_args, main
from shardline_runtime.model_loader.errors import ModelSourceError
from shardline_runtime.model_loader.model_source import parse_model_source
from shardline_runtime.model_loader.revision_cache import SOURCE_FILE
from shardline_runtime.server_args import ServerArgs
from tests.model_sources.conftest import checkpoint_files
from tests.model_sources.hub_double import HubDouble, HubRepo
from tests.serving.serving_server import start_server


def test_hf_reference_carries_its_revision():
    assert parse_model_source("hf://Org/Name@v1.2").revision == "v1.2"


def test_bare_repo_id_without_a_local_directory_is_a_hub_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_model_source("Org/Name").scheme == "hf"


def test_existing_local_directory_wins_over_a_repo_id(tmp_path, monkeypatch):
    (tmp_path / "Org" / "Name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_model_source("Org/Name").scheme == "local"


def test_s3_reference_splits_bucket_and_prefix():
    assert parse_model_source("s3://models/llama/v2/").prefix == "llama/v2"


@pytest.mark.parametrize(
    "text",
    ["hf://only-one-part", "hf://a/b/c", "hf://Org/Name@", "s3://Bucket_Upper/p", "s3://models",
     "gs://bucket/p"],
)
def test_malformed_reference_names_the_flag(text):
    with pytest.raises(ModelSourceError, match="--model-path"):
        parse_model_source(text)


def test_serve_with_a_malformed_reference_exits_2(tmp_path, capsys):
    code = main(["serve", "--model-path", "hf://only-one-part", "--download-dir", str(tmp_path)])
    assert code == 2


def test_serve_with_a_missing_revision_exits_1_naming_it(hub, tmp_path, capsys):
    args = ["serve", "--model-path", "hf://shardline/tiny-llama@nope", "--download-dir", str(tmp_path)]
    assert main(args) == 1
    assert "revision not found" in capsys.readouterr().err


def test_fetched_args_serve_the_name_the_user_gave(hub, tmp_path):
    args = ServerArgs(model_path="shardline/tiny-llama", download_dir=str(tmp_path))
    assert fetch_model_args(args).model_name == "shardline/tiny-llama"


def test_fetched_args_report_the_resolved_commit(hub, tmp_path):
    args = ServerArgs(model_path="hf://shardline/tiny-llama@v1", download_dir=str(tmp_path))
    assert fetch_model_args(args).revision == hub.repos["shardline/tiny-llama"].refs["v1"]


def test_a_hub_draft_is_fetched_like_the_model(hub, tmp_path):
    args = ServerArgs(model_path="hf://shardline/tiny-llama@v1", download_dir=str(tmp_path),
                      speculative_algorithm="STANDALONE", speculative_draft_model_path="hf://shardline/tiny-llama@v1")
    fetched = fetch_model_args(args)
    draft = Path(fetched.speculative_draft_model_path)
    assert checkpoint_files(draft) == checkpoint_files(Path(fetched.model_path))


def test_an_s3_draft_is_fetched_into_the_download_dir(s3, tmp_path, tiny_checkpoint):
    _, bucket = s3
    args = ServerArgs(model_path=str(tiny_checkpoint("llama")), download_dir=str(tmp_path),
                      speculative_algorithm="STANDALONE", speculative_draft_model_path=f"s3://{bucket}/tiny/v1")
    draft = Path(fetch_model_args(args).speculative_draft_model_path)
    fetched = {name: data for name, data in checkpoint_files(draft).items() if name != SOURCE_FILE}
    assert fetched == checkpoint_files(Path(tiny_checkpoint("llama")))


def test_an_s3_draft_records_the_source_it_was_verified_against(s3, tmp_path, tiny_checkpoint):
    _, bucket = s3
    args = ServerArgs(model_path=str(tiny_checkpoint("llama")), download_dir=str(tmp_path),
                      speculative_algorithm="STANDALONE", speculative_draft_model_path=f"s3://{bucket}/tiny/v1")
    draft = Path(fetch_model_args(args).speculative_draft_model_path)
    assert json.loads((draft / SOURCE_FILE).read_text())["uri"] == f"s3://{bucket}/tiny/v1"


def test_a_malformed_draft_reference_names_the_draft_flag(tmp_path):
    args = ServerArgs(model_path="/m", download_dir=str(tmp_path),
                      speculative_algorithm="STANDALONE", speculative_draft_model_path="hf://only-one-part")
    with pytest.raises(ModelSourceError, match="--speculative-draft-model-path"):
        fetch_model_args(args)


def test_unsupported_load_format_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--model-path", "/m", "--load-format", "gguf"])
    assert "--load-format" in capsys.readouterr().err


@pytest.fixture(scope="module")
def hub_server(tiny_checkpoint, tmp_path_factory):
    """A runtime serving ``hf://shardline/tiny-llama@v1`` from a Hub double that also holds a
    second checkpoint on branch ``v2``, its cache bounded to 1 byte (every revision not kept is
    evicted). Yields ``(server, hub, cache directory)``."""
    root = tmp_path_factory.mktemp("hub-server")
    with HubDouble() as hub:
        repo = HubRepo()
        repo.commit(checkpoint_files(Path(tiny_checkpoint("llama"))), ref="v1")
        repo.commit(checkpoint_files(Path(tiny_checkpoint("llama", seed=1))), ref="v2")
        hub.repos["shardline/tiny-llama"] = repo
        server = start_server(
            "hf://shardline/tiny-llama@v1", root, "--download-dir", str(root / "models"),
            "--max-total-tokens", "512", "--download-max-bytes", "1", env={"HF_ENDPOINT": hub.endpoint},
        )
        try:
            yield server, hub, root / "models"
        finally:
            server.stop()


@pytest.mark.slow
def test_runtime_serves_a_hub_model_under_its_repository_name(hub_server):
    server, _, _ = hub_server
    assert [m["id"] for m in server.get("/v1/models").json()["data"]] == ["shardline/tiny-llama"]


@pytest.mark.slow
def test_server_info_reports_the_commit_it_serves(hub_server):
    server, hub, _ = hub_server
    info = server.get("/get_server_info").json()
    assert info["weights"]["source_revision"] == hub.repos["shardline/tiny-llama"].refs["v1"]


@pytest.mark.slow
def test_update_to_a_missing_revision_is_refused_naming_it(hub_server):
    server, _, _ = hub_server
    reply = server.post("/update_weights_from_disk", {"model_path": "hf://shardline/tiny-llama@v9"})
    assert reply.json()["message"].startswith("NotFound:")


@pytest.mark.slow
def test_update_to_a_hub_revision_succeeds(hub_server):
    server, _, _ = hub_server
    reply = server.post("/update_weights_from_disk", {"model_path": "hf://shardline/tiny-llama@v2"})
    assert reply.json()["success"] is True


@pytest.mark.slow
def test_served_model_path_is_the_reference_not_the_cache_directory(hub_server):
    server, _, _ = hub_server
    info = server.get("/get_server_info").json()
    assert info["weights"]["model_path"].startswith("hf://shardline/tiny-llama@")


@pytest.mark.slow
def test_an_update_keeps_the_revision_it_replaces_in_a_bounded_cache(hub_server):
    server, hub, cache = hub_server
    server.post("/update_weights_from_disk", {"model_path": "hf://shardline/tiny-llama@v2"})
    server.post("/update_weights_from_disk", {"model_path": "hf://shardline/tiny-llama@v1"})
    v2 = hub.repos["shardline/tiny-llama"].refs["v2"]
    assert (cache / f"hf--shardline--tiny-llama--{v2}").is_dir()


@pytest.mark.slow
def test_update_after_the_branch_moved_reports_the_commit_it_loaded(hub_server, tiny_checkpoint):
    server, hub, _ = hub_server
    repo = hub.repos["shardline/tiny-llama"]
    # v2 was loaded (cached) above; the branch then moves before the next update.
    moved = repo.commit(checkpoint_files(Path(tiny_checkpoint("llama", seed=2))), ref="v2")
    server.post("/update_weights_from_disk", {"model_path": "hf://shardline/tiny-llama@v2"})
    assert server.get("/get_server_info").json()["weights_source_revision"] == moved
