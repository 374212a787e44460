"""``/update_weights_from_disk`` with a remote ``draft_model_path`` (issue 30): the draft is
fetched and verified like the target before either loads, and a fetch that fails leaves both
on their old weights. A real runtime (STANDALONE speculation) serves from a Hub double."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.model_sources.conftest import checkpoint_files
from tests.model_sources.hub_double import HubDouble, HubRepo
from tests.serving.serving_server import start_server

TARGET, DRAFT = "shardline/tiny-llama", "shardline/tiny-draft"


@pytest.fixture(scope="module")
def draft_server(tiny_checkpoint, tmp_path_factory):
    """A runtime serving ``hf://TARGET@v1`` with the draft ``hf://DRAFT@v1`` (both fetched at
    start), each repository holding a second checkpoint on ``v2``; the cache is bounded to 1
    byte, so every revision not kept is evicted. Yields ``(server, hub, cache directory)``."""
    root = tmp_path_factory.mktemp("draft-server")
    with HubDouble() as hub:
        for name, seeds in ((TARGET, (0, 1)), (DRAFT, (3, 4))):
            repo = HubRepo()
            for ref, seed in zip(("v1", "v2"), seeds):
                repo.commit(checkpoint_files(Path(tiny_checkpoint("llama", seed=seed))), ref=ref)
            hub.repos[name] = repo
        server = start_server(
            f"hf://{TARGET}@v1",
            root,
            "--download-dir",
            str(root / "models"),
            "--download-max-bytes",
            "1",
            "--max-total-tokens",
            "512",
            "--speculative-algorithm",
            "STANDALONE",
            "--speculative-draft-model-path",
            f"hf://{DRAFT}@v1",
            env={"HF_ENDPOINT": hub.endpoint},
        )
        try:
            yield server, hub, root / "models"
        finally:
            server.stop()


def _weights(server) -> dict:
    return server.get("/get_server_info").json()["weights"]


@pytest.mark.slow
def test_the_draft_is_reported_as_the_reference_it_was_fetched_from(draft_server):
    server, hub, _ = draft_server
    weights = _weights(server)
    assert weights["draft_model_path"] == f"hf://{DRAFT}@v1"
    assert weights["draft_source_revision"] == hub.repos[DRAFT].refs["v1"]
    assert (
        weights["draft_digest"].startswith("sha256:")
        and weights["draft_digest"] != weights["digest"]
    )


@pytest.mark.slow
def test_a_draft_that_cannot_be_fetched_leaves_target_and_draft_on_the_old_weights(draft_server):
    server, hub, _ = draft_server
    before = _weights(server)
    reply = server.post(
        "/update_weights_from_disk",
        {
            "model_path": f"hf://{TARGET}@v2",
            "draft_model_path": f"hf://{DRAFT}@v9",
            "revision": "b",
        },
    )
    assert reply.status_code == 400
    body = reply.json()
    assert body["success"] is False
    assert body["message"].startswith(f"NotFound: draft_model_path hf://{DRAFT}@v9:")
    assert "nothing was loaded" in body["message"]
    after = _weights(server)
    keys = (
        "model_path",
        "source_revision",
        "digest",
        "draft_model_path",
        "draft_source_revision",
        "draft_digest",
    )
    assert {k: after[k] for k in keys} == {k: before[k] for k in keys}
    assert after["source_revision"] == hub.repos[TARGET].refs["v1"]


@pytest.mark.slow
def test_target_and_remote_draft_update_together(draft_server):
    server, hub, cache = draft_server
    before = _weights(server)
    reply = server.post(
        "/update_weights_from_disk",
        {
            "model_path": f"hf://{TARGET}@v2",
            "draft_model_path": f"hf://{DRAFT}@v2",
            "revision": "b",
        },
    )
    assert reply.status_code == 200, reply.text
    after = _weights(server)
    assert after["source_revision"] == hub.repos[TARGET].refs["v2"]
    assert after["draft_model_path"] == f"hf://{DRAFT}@v2"
    assert after["draft_source_revision"] == hub.repos[DRAFT].refs["v2"]
    assert after["draft_digest"] != before["draft_digest"]
    # the bounded cache kept the new target while it fetched the new draft
    v2 = hub.repos[TARGET].refs["v2"]
    assert (cache / f"hf--shardline--tiny-llama--{v2}").is_dir()
    done = server.post(
        "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    )
    assert done.status_code == 200


@pytest.mark.slow
def test_an_update_without_a_draft_keeps_the_draft_it_serves(draft_server):
    server, _, _ = draft_server
    before = _weights(server)
    reply = server.post(
        "/update_weights_from_disk", {"model_path": f"hf://{TARGET}@v1", "revision": "a"}
    )
    assert reply.status_code == 200, reply.text
    after = _weights(server)
    assert after["draft_digest"] == before["draft_digest"]
    assert after["draft_model_path"] == before["draft_model_path"]
