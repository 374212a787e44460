"""API keys on a real server process: every route the app serves is checked, listed from the
app itself (``build_app(...).routes``, including routes left out of the OpenAPI schema), so an
endpoint added later cannot slip through unguarded."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import httpx
import openai
import pytest

from serving_server import start_server
from shardline_runtime.entrypoints.auth import (
    UNAUTHORIZED_MESSAGE,
    access_class,
    accepted_keys,
    guard,
)
from shardline_runtime.server_args import ServerArgs, ServerArgsError

API_KEY = "sk-user-7d1c0e"
ADMIN_KEY = "adm-2b9f44a1"
# The documented table (docs/api.md, "API keys"), written out here: routes are checked against
# it, never against auth.access_class (the code under test). Every other path is a control
# endpoint. test_documented_table_is_the_one_in_the_docs keeps it equal to the docs.
OPEN = ("/health", "/ready", "/metrics")
SERVING = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/generate", "/health_generate")
INFO = ("/v1/models", "/v1/models/{model}", "/get_model_info", "/get_server_info", "/server_info")
REPO = Path(__file__).resolve().parents[2]
# Bodies that make each request succeed once it is let in.
VALID = {
    ("POST", "/v1/chat/completions"): {"model": "tiny-llama", "max_tokens": 2,
                                       "messages": [{"role": "user", "content": "hi"}]},
    ("POST", "/v1/completions"): {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2},
    ("POST", "/generate"): {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    ("POST", "/abort_request"): {"abort_all": True},
    ("POST", "/flush_cache"): None,
}


@pytest.fixture(scope="module")
def guarded(serving_checkpoint, checkpoint_dir):
    """A server with both keys: the admin key as a flag, the API key from the environment."""
    srv = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", "512",
                       "--served-model-name", "tiny-llama", "--admin-api-key", ADMIN_KEY,
                       env={"SHARDLINE_API_KEY": API_KEY})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def routes(guarded, serving_checkpoint):
    """``(method, path)`` of every route of the app the server runs (the handlers are not called)."""
    from shardline_runtime.entrypoints.http_server import build_app

    app = build_app(None, ServerArgs(model_path=str(serving_checkpoint)), None, {})
    # Path parameters ({model_id:path}) get a real value: the served model's name.
    found = sorted({(method, re.sub(r"\{[^}]*\}", "tiny-llama", route.path)) for route in app.routes
                    for method in getattr(route, "methods", None) or () if method != "HEAD"})
    assert ("POST", "/update_weights_from_disk") in found and ("POST", "/v1/chat/completions") in found
    assert ("GET", "/openapi.json") in found and ("GET", "/docs") in found
    return found


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _send(server, method: str, path: str, key: str | None = None, body=None) -> httpx.Response:
    headers = _bearer(key) if key is not None else {}
    return httpx.request(method, server.url + path, headers=headers, json=body, timeout=120)


def documented_class(path: str) -> str:
    """``open``, ``serving``, ``info`` or ``admin`` for a path, from the documented table."""
    if path in OPEN:
        return "open"
    if path in SERVING:
        return "serving"
    if path in INFO or path == "/v1/models/tiny-llama":
        return "info"
    return "admin"


def _right_key(path: str) -> str:
    return API_KEY if documented_class(path) in ("serving", "info") else ADMIN_KEY


def test_documented_table_is_the_one_in_the_docs():
    lines = (REPO / "docs/api.md").read_text().splitlines()
    rows = {line.split("|")[1].strip(): line.split("|")[2] for line in lines if line.startswith("| `--api-key`")
            or line.startswith("| either key") or line.startswith("| none |")}
    assert set(rows) == {"`--api-key` (`SHARDLINE_API_KEY`)", "either key", "none"}, rows
    assert re.findall(r"`(/[^`]*)`", rows["`--api-key` (`SHARDLINE_API_KEY`)"]) == list(SERVING)
    assert re.findall(r"`(/[^`]*)`", rows["either key"]) == list(INFO)
    assert re.findall(r"`(/[^`]*)`", rows["none"]) == list(OPEN)


def test_every_route_is_in_the_documented_class(routes):
    for _, path in routes:
        assert access_class(path) == documented_class(path), path


def _assert_refused(response: httpx.Response, what: str) -> None:
    assert response.status_code == 401, f"{what}: HTTP {response.status_code} {response.text[:200]}"
    error = response.json()["error"]
    # One message for every refusal: it never says which key exists or was close.
    assert error == {"message": UNAUTHORIZED_MESSAGE, "type": "invalid_request_error", "param": None,
                     "code": "invalid_api_key"}, what
    assert response.headers["www-authenticate"] == "Bearer", what


def test_every_guarded_route_refuses_a_request_without_a_key(guarded, routes):
    for method, path in routes:
        if path not in OPEN:
            _assert_refused(_send(guarded, method, path), f"{method} {path} without a key")


def test_every_guarded_route_refuses_a_wrong_key(guarded, routes):
    for method, path in routes:
        if path not in OPEN:
            _assert_refused(_send(guarded, method, path, "not-the-key"), f"{method} {path} with a wrong key")


def test_every_route_lets_its_right_key_in(guarded, routes):
    for method, path in routes:
        # Without a known valid body, a JSON string: endpoints that take a body refuse it (400)
        # instead of acting (pausing generation or releasing memory would spoil later tests).
        body = VALID.get((method, path), "not an object")
        response = _send(guarded, method, path, _right_key(path), body)
        assert response.status_code not in (401, 404, 405), \
            f"{method} {path} with its key: HTTP {response.status_code} {response.text[:200]}"
        if (method, path) in VALID or method == "GET":
            assert response.status_code == 200, f"{method} {path}: HTTP {response.status_code} {response.text[:300]}"


def test_open_endpoints_need_no_key(guarded):
    for path in OPEN:
        assert _send(guarded, "GET", path).status_code == 200, path


def test_admin_key_is_refused_on_serving_endpoints(guarded, routes):
    for method, path in routes:
        if documented_class(path) == "serving":
            _assert_refused(_send(guarded, method, path, ADMIN_KEY, VALID.get((method, path))),
                            f"{method} {path} with the admin key")


def test_api_key_is_refused_on_control_endpoints(guarded, routes):
    control = [(m, p) for m, p in routes if documented_class(p) == "admin"]
    assert ("POST", "/update_weights_from_disk") in control and ("POST", "/flush_cache") in control
    for method, path in control:
        _assert_refused(_send(guarded, method, path, API_KEY, VALID.get((method, path))),
                        f"{method} {path} with the API key")


def test_both_keys_read_server_info(guarded):
    for key in (API_KEY, ADMIN_KEY):
        assert _send(guarded, "GET", "/get_server_info", key).json()["served_model_name"] == "tiny-llama"


def test_unknown_paths_are_refused_before_routing(guarded):
    """A 404 would tell a caller which paths exist; without a key every unlisted path is 401."""
    _assert_refused(_send(guarded, "POST", "/no_such_endpoint"), "unknown path")
    assert _send(guarded, "POST", "/no_such_endpoint", ADMIN_KEY).status_code == 404


def test_openai_client_with_api_key(guarded):
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=API_KEY, max_retries=0)
    out = client.chat.completions.create(model="tiny-llama", max_tokens=3, temperature=0,
                                         messages=[{"role": "user", "content": "hello"}])
    assert out.choices[0].message.content is not None
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    assert client.models.retrieve("tiny-llama").id == "tiny-llama"
    stream = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=4, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert len([chunk for chunk in stream if chunk.choices]) >= 1  # streams pass through the key check
    wrong = openai.OpenAI(base_url=guarded.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.chat.completions.create(model="tiny-llama", max_tokens=3,
                                      messages=[{"role": "user", "content": "hello"}])
    assert caught.value.status_code == 401


@pytest.mark.parametrize("access,api,admin,expected", [
    ("serving", "k", None, ("k",)),
    ("serving", None, "a", None),
    ("serving", "same", "same", ("same",)),  # an admin key equal to the API key opens serving too
    ("info", "k", "a", ("k", "a")),
    ("info", None, "a", None),
    ("admin", "k", "a", ("a",)),
    ("admin", "k", None, ("k",)),  # one key alone guards everything
    ("admin", None, None, None),
    ("open", "k", "a", None),
    ("serving", "old,new", "a", ("old", "new")),  # rotation: both keys open serving meanwhile
    ("admin", "k", "a1, a2", ("a1", "a2")),
])
def test_accepted_keys_table(access, api, admin, expected):
    assert accepted_keys(access, api, admin) == expected


def test_new_paths_are_control_endpoints_by_default():
    for path in ("/update_weights_from_distributed", "/release_memory_occupation", "/load_lora_adapter",
                 "/v1/load_lora_adapter", "/start_expert_distribution_record", "/pause_generation", "/docs",
                 "/v1/modelsx", "/v1"):
        assert access_class(path) == "admin", path
    assert access_class("/health/") == "open"
    assert access_class("/v1/models/org/model-7b") == "info"


def test_keys_from_the_environment_and_flags(monkeypatch):
    monkeypatch.setenv("SHARDLINE_API_KEY", "from-env")
    monkeypatch.setenv("SHARDLINE_ADMIN_API_KEY", "")
    args = ServerArgs.from_cli(["--model-path", "/m"])
    assert (args.api_key, args.admin_api_key) == ("from-env", None)
    args = ServerArgs.from_cli(["--model-path", "/m", "--api-key", "flag", "--admin-api-key", "adm"])
    assert (args.api_key, args.admin_api_key) == ("flag", "adm")
    assert "flag" not in repr(args) and "adm" not in repr(args)


def test_a_key_with_a_space_is_rejected_naming_the_flag():
    for bad in ("two words", "trailing,", ",", "a,,b"):
        with pytest.raises(ServerArgsError, match="--admin-api-key must be one key, or several separated by commas"):
            ServerArgs(model_path="/m", admin_api_key=bad)
    assert ServerArgs(model_path="/m", api_key="old,new").api_key == "old,new"


def test_warning_at_start_without_keys(caplog):
    with caplog.at_level(logging.WARNING, logger="shardline_runtime.entrypoints.auth"):
        guard(lambda *a: None, None, None, 8000)
    text = caplog.text
    assert "no --api-key" in text and "no --admin-api-key" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardline_runtime.entrypoints.auth"):
        guard(lambda *a: None, "k", "a", 8000)
    assert caplog.text == ""
