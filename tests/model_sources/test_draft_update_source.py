"""``/update_weights_from_disk`` with a remote ``draft_model_path`` (issue 30): the draft is
fetched and verified like the target before either loads, and a fetch that fails leaves both
on their old weights. A real runtime (STANDALONE speculation) serves from a Hub double."""

from __future__ import annotations

import re
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


TARGET_KEYS = ("model_path", "source_revision", "digest")
DRAFT_KEYS = ("draft_model_path", "draft_source_revision", "draft_digest")
# test id: (request body, HTTP status, message pattern, target ref, draft ref served after it;
# None: what was served before). The cases run in this order on one server.
UPDATES = {
    "a-draft-that-cannot-be-fetched-leaves-target-and-draft-on-the-old-weights": (
        {"model_path": f"hf://{TARGET}@v2", "draft_model_path": f"hf://{DRAFT}@v9"},
        400,
        rf"NotFound: draft_model_path hf://{DRAFT}@v9: .*nothing was loaded",
        None,
        None,
    ),
    "target-and-remote-draft-update-together": (
        {"model_path": f"hf://{TARGET}@v2", "draft_model_path": f"hf://{DRAFT}@v2"},
        200,
        None,
        "v2",
        "v2",
    ),
    "an-update-without-a-draft-keeps-the-draft-it-serves": (
        {"model_path": f"hf://{TARGET}@v1"},
        200,
        None,
        "v1",
        None,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "body, status, message, target_ref, draft_ref", UPDATES.values(), ids=list(UPDATES)
)
def test_an_update_moves_target_and_draft_to_what_it_names_or_neither(
    draft_server, body, status, message, target_ref, draft_ref
):
    server, hub, cache = draft_server
    before = _weights(server)
    reply = server.post("/update_weights_from_disk", {**body, "revision": "b"})
    assert reply.status_code == status, reply.text
    assert reply.json()["success"] is (status == 200)
    if message is not None:
        assert re.match(message, reply.json()["message"]), reply.json()["message"]
    after = _weights(server)
    if target_ref is None:
        assert {k: after[k] for k in TARGET_KEYS} == {k: before[k] for k in TARGET_KEYS}
    else:
        commit = hub.repos[TARGET].refs[target_ref]
        assert after["source_revision"] == commit
        # the bounded cache kept the new target while it fetched the draft
        assert (cache / f"hf--shardline--tiny-llama--{commit}").is_dir()
    if draft_ref is None:
        assert {k: after[k] for k in DRAFT_KEYS} == {k: before[k] for k in DRAFT_KEYS}
    else:
        assert after["draft_model_path"] == f"hf://{DRAFT}@{draft_ref}"
        assert after["draft_source_revision"] == hub.repos[DRAFT].refs[draft_ref]
        assert after["draft_digest"] != before["draft_digest"]
    done = server.post(
        "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    )
    assert done.status_code == 200
