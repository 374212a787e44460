"""Issue 29, item 5 (runtime side): responses name their weights in headers and body metadata,
and a request pinned to a revision is answered by it or refused with a 503 naming it, never
silently by other weights, also when it waited in the scheduler's queue across an update.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time

import httpx
import pytest
from serving_server import start_server, wait_for_baseline

REVISION = "X-Shardline-Revision"
WEIGHT_VERSION = "X-Shardline-Weight-Version"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fence_server(serving_checkpoint, checkpoint_dir):
    """One running request at a time, so a second one waits in the scheduler's queue."""
    srv = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", "4096",
                       "--revision", "rev-a", "--max-running-requests", "1",
                       "--weight-update-hold-timeout", "600")  # a loaded machine is slow
    yield srv
    srv.stop()


def _generate(server, headers=None, stream=False, timeout: float = 120) -> httpx.Response:
    body = {"text": "pinned", "stream": stream,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    return httpx.post(server.url + "/generate", json=body, headers=headers or {}, timeout=timeout)


def _chat(server, headers=None, stream=False) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": stream}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers or {},
                      timeout=120)


def test_generate_response_names_its_revision_in_a_header(fence_server):
    assert _generate(fence_server).headers[REVISION] == "rev-a"


def test_generate_response_names_its_weight_version_in_a_header(fence_server):
    assert _generate(fence_server).headers[WEIGHT_VERSION] == "default"


def test_generate_body_metadata_names_its_revision(fence_server):
    assert _generate(fence_server).json()["meta_info"]["revision"] == "rev-a"


def test_chat_body_metadata_names_its_revision(fence_server):
    assert _chat(fence_server).json()["metadata"]["revision"] == "rev-a"


def test_chat_stream_names_its_revision_in_a_header(fence_server):
    assert _chat(fence_server, stream=True).headers[REVISION] == "rev-a"


def test_error_responses_name_the_served_revision(fence_server):
    response = httpx.post(fence_server.url + "/generate", json={}, timeout=60)
    assert response.headers[REVISION] == "rev-a"


def test_request_pinned_to_the_served_revision_is_answered(fence_server):
    assert _generate(fence_server, {REVISION: "rev-a"}).status_code == 200


def test_request_pinned_to_another_revision_gets_503(fence_server):
    assert _chat(fence_server, {REVISION: "rev-x"}).status_code == 503


def test_refusal_names_the_pinned_revision(fence_server):
    message = _chat(fence_server, {REVISION: "rev-x"}).json()["error"]["message"]
    assert "revision 'rev-x'" in message


def test_refusal_names_the_served_revision(fence_server):
    message = _generate(fence_server, {REVISION: "rev-x"}).json()["error"]["message"]
    assert "serves revision 'rev-a'" in message


def test_request_pinned_to_another_weight_version_gets_503(fence_server):
    assert _generate(fence_server, {WEIGHT_VERSION: "step-7"}).status_code == 503


def test_pinned_stream_to_another_revision_gets_503_before_its_headers(fence_server):
    assert _generate(fence_server, {REVISION: "rev-x"}, stream=True).status_code == 503


def test_empty_pin_header_is_a_400_naming_it(fence_server):
    response = _generate(fence_server, {REVISION: ""})
    assert response.json()["error"]["param"] == REVISION


def _long_stream(server, done: dict, max_tokens: int = 40) -> None:
    body = {"prompt": "keep going", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as r:
        for _ in r.iter_lines():
            pass
    done["status"] = r.status_code


def _wait_info(server, key: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while server.get("/get_server_info").json()[key] < count:
        assert time.monotonic() < deadline, f"{key} never reached {count}"
        time.sleep(0.02)


def _pinned_long(server, done: dict) -> None:
    body = {"text": "pinned long", "sampling_params": {"max_new_tokens": 1500, "temperature": 0,
                                                        "ignore_eos": True}}
    done["response"] = httpx.post(server.url + "/generate", json=body,
                                  headers={REVISION: "rev-a"}, timeout=600)


def test_pinned_request_queued_across_an_update_is_refused_not_answered_by_new_weights(
    fence_server, serving_checkpoint, serving_checkpoint_b
):
    """The pinned request begins on rev-a, is retracted to the scheduler's queue by
    ``/pause_generation`` (mode retract: an RL loop's pause -> update -> continue), rev-b is
    loaded, and generation continues: its next tokens would come from rev-b, so it is refused."""
    server = fence_server
    done: dict = {}
    pinned = threading.Thread(target=_pinned_long, args=(server, done))
    pinned.start()
    _wait_info(server, "num_running_reqs", 1)
    try:
        assert server.post("/pause_generation", {"mode": "retract"}).status_code == 200
        _wait_info(server, "num_queued_reqs", 1)  # retracted: back in the queue, tokens kept
        update = server.post("/update_weights_from_disk",
                             {"model_path": str(serving_checkpoint_b), "revision": "rev-b"})
        assert update.json()["success"] is True
        assert server.post("/continue_generation", {}).status_code == 200
        pinned.join(600)
        refused = done["response"]
        assert refused.status_code == 503, refused.text
        assert "pinned revision 'rev-a' is not served here" in refused.json()["error"]["message"]
        during = _generate(server, {REVISION: "rev-a"})
        assert during.status_code == 503
    finally:
        server.post("/continue_generation", {})
        pinned.join(600)
        restored = server.post("/update_weights_from_disk",
                               {"model_path": str(serving_checkpoint), "revision": "rev-a"})
        assert restored.json()["success"] is True
        wait_for_baseline(server)


def test_pinned_request_queued_before_an_update_is_answered_by_the_old_weights(
    fence_server, serving_checkpoint, serving_checkpoint_b
):
    """Issue 29 item 4: what arrived before the update request is served before the update
    pauses (here queued behind a running stream, one running request at a time), so a request
    pinned to rev-a is answered by rev-a instead of being held for the update and refused."""
    server = fence_server
    done: dict = {}
    stream = threading.Thread(target=_long_stream, args=(server, done, 150))
    stream.start()
    _wait_info(server, "num_running_reqs", 1)
    with cf.ThreadPoolExecutor(2) as pool:
        pinned = pool.submit(_generate, server, {REVISION: "rev-a"}, timeout=600)
        _wait_info(server, "num_queued_reqs", 1)
        update = pool.submit(server.post, "/update_weights_from_disk",
                             {"model_path": str(serving_checkpoint_b), "revision": "rev-b"})
        answered = pinned.result()
        assert update.result().json()["success"] is True
    stream.join(600)
    try:
        assert answered.status_code == 200, answered.text
        assert answered.headers[REVISION] == "rev-a"
        assert done["status"] == 200
    finally:
        restored = server.post("/update_weights_from_disk",
                               {"model_path": str(serving_checkpoint), "revision": "rev-a"})
        assert restored.json()["success"] is True
        wait_for_baseline(server)


def test_pinned_request_arriving_in_an_updates_admission_window_is_answered_by_the_old_weights(
    fence_server, serving_checkpoint, serving_checkpoint_b
):
    """Issue 23 item 5: an update sent with ``admit_seconds`` (what an operator passes while a
    gateway may still route to the leader) starts staging at once, but a request arriving in
    that window is admitted and answered by the old weights, not held and then refused; the
    update commits after it."""
    server = fence_server
    with cf.ThreadPoolExecutor(2) as pool:
        update = pool.submit(server.post, "/update_weights_from_disk",
                             {"model_path": str(serving_checkpoint_b), "revision": "rev-b",
                              "admit_seconds": 8.0})
        deadline = time.monotonic() + 60
        while server.get("/get_server_info").json()["weights_phase"] != "loading":  # arrived
            assert time.monotonic() < deadline and not update.done(), "the update never began"
            time.sleep(0.02)
        answered = _generate(server, {REVISION: "rev-a"}, timeout=600)
        reply = update.result().json()
    try:
        assert answered.status_code == 200, answered.text
        assert answered.headers[REVISION] == "rev-a"
        assert reply["success"] is True
        assert _generate(server).headers[REVISION] == "rev-b"
    finally:
        restored = server.post("/update_weights_from_disk",
                               {"model_path": str(serving_checkpoint), "revision": "rev-a"})
        assert restored.json()["success"] is True
        wait_for_baseline(server)
