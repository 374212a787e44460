"""Every call the operator makes to a group leader during a rollout, against a real runtime that
has both keys set (``--admin-api-key`` and ``--api-key``), through the operator's own client.

The operator hands its client the admin token and the deployment's API key (from the same Secret
the pods read). Control endpoints take the admin token; the canary gate calls serving endpoints
(``/health_generate``, ``/v1/completions``), which take only the API key. A gate sent the admin
token there is refused with 401, so every canary rollout of a deployment with ``spec.auth``
would roll back.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from serving_server import start_server
from shardline_operator.runtime_client import HttpLeaderClient
from shardline_operator.spec import VerifySpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lora"))
from lora_fixtures import make_peft_adapter  # noqa: E402

API_KEY = "sk-user-41f0"
ADMIN_TOKEN = "adm-token-93ce"


@pytest.fixture(scope="module")
def leader(serving_checkpoint, checkpoint_dir, tmp_path_factory):
    """A runtime with both keys and LoRA on, as the operator starts one with ``spec.auth`` and
    ``spec.loraAdapters``; yields ``(url, adapter path)``."""
    adapter = make_peft_adapter(serving_checkpoint, tmp_path_factory.mktemp("keys-lora") / "a", seed=3)
    srv = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", "1024",
                       "--served-model-name", "tiny-llama", "--revision", "rev-a", "--enable-lora",
                       "--max-loras-per-batch", "2", "--max-lora-rank", "8",
                       env={"SHARDLINE_API_KEY": API_KEY, "SHARDLINE_ADMIN_API_KEY": ADMIN_TOKEN})
    yield srv.url, adapter
    srv.stop()


@pytest.fixture
def client():
    http = HttpLeaderClient()
    yield http.with_token(ADMIN_TOKEN, API_KEY)
    http.close()


def _wait(client, key: str, timeout: float = 300.0) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state, message = client.poll(key)
        if state != "pending":
            return state, message
        time.sleep(0.1)
    raise AssertionError(f"update {key} not finished after {timeout} s")


def test_server_info_is_read_with_the_keys(leader, client):
    url, _ = leader
    info = client.server_info(url)
    assert info is not None, "GET /get_server_info refused or unreachable"
    assert info["weights_revision"] == "rev-a"


def test_canary_gate_passes_with_the_api_key(leader, client):
    url, _ = leader
    passed, message = client.verify(url, VerifySpec(prompt="hello", max_tokens=2, max_latency_seconds=60))
    assert passed, message


def test_canary_gate_without_verify_prompt_passes(leader, client):
    url, _ = leader
    passed, message = client.verify(url, None)
    assert passed, message


def test_canary_gate_fails_on_its_latency_bound_not_on_the_key(leader, client):
    url, _ = leader
    passed, message = client.verify(url, VerifySpec(prompt="hello", max_tokens=2, max_latency_seconds=1e-6))
    assert not passed
    assert "over maxLatencySeconds" in message, message


def test_canary_gate_with_a_wrong_api_key_fails_with_401(leader):
    url, _ = leader
    wrong = HttpLeaderClient().with_token(ADMIN_TOKEN, "sk-not-the-key")
    passed, message = wrong.verify(url, None)
    assert not passed
    assert "HTTP 401" in message, message


def test_lora_adapters_load_list_and_unload_with_the_admin_token(leader, client):
    url, adapter = leader
    ok, message = client.load_lora_adapter(url, "canary-a", str(adapter))
    assert ok, message
    assert client.lora_adapters(url) == {"canary-a": str(adapter)}
    ok, message = client.unload_lora_adapter(url, "canary-a")
    assert ok, message
    assert client.lora_adapters(url) == {}


def test_weight_update_runs_with_the_admin_token(leader, client, serving_checkpoint_b):
    url, _ = leader
    client.start_update("g0", url, {"model_path": str(serving_checkpoint_b), "revision": "rev-b"}, 300)
    state, message = _wait(client, "g0")
    assert state == "success", message
    assert client.server_info(url)["weights_revision"] == "rev-b"
    # the return-to-routing check began as the update succeeded, with the API key (else 401)
    passed, early = client.verify(url, None)
    assert passed and "as the update ended" in early, early
    passed, gate = client.verify(url, VerifySpec(prompt="hello", max_tokens=2, max_latency_seconds=60))
    assert passed, gate
