"""Contract: the runtime's ``/metrics`` serves the Gateway API Inference Extension's model-server
protocol (issue 29, item 1), checked against a real server with LoRA on.

The protocol is ``docs/proposals/003-model-server-protocol/README.md`` in
kubernetes-sigs/gateway-api-inference-extension, read at commit
84436a96b9e6ce2b59ddacd3d04c31b4fbd442de. It lets a server pick its own names but fixes the type,
the labels and the meaning of each metric; the table below is that document's, with the names
Shardline exports (an endpoint picker is pointed at them with its metric-name flags, as
docs/operations.md shows).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from lora_fixtures import make_peft_adapter  # noqa: E402
from serving_server import start_server  # noqa: E402

pytestmark = pytest.mark.slow

# protocol metric -> (Shardline's name, Prometheus type, the labels the protocol names)
PROTOCOL = {
    "TotalQueuedRequests": ("shardline:num_requests_waiting", "gauge", ()),
    "TotalRunningRequests": ("shardline:num_requests_running", "gauge", ()),
    "KVCacheUtilization": ("shardline:kv_cache_usage_perc", "gauge", ()),
    "BlockSize": ("shardline:cache_config_info", "gauge", ("block_size",)),
    "NumGPUBlocks": ("shardline:cache_config_info", "gauge", ("num_gpu_blocks",)),
    "LoRAAdapters": (
        "shardline:lora_requests_info",
        "gauge",
        ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
    ),
}
PROMPT = [5, 17, 200, 33, 9, 41, 77, 300]


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("protocol")
    base = make_tiny_checkpoint(root / "base", arch="llama", seed=0, max_position_embeddings=8192)
    adapters = {n: make_peft_adapter(base, root / n, r=4, seed=s) for n, s in (("a", 1), ("b", 2))}
    srv = start_server(base, root, "--served-model-name", "tiny", "--max-total-tokens", "20000",
                       "--max-running-requests", "1", "--max-loras-per-batch", "2",
                       "--lora-paths", f"a={adapters['a']}", f"b={adapters['b']}")
    yield srv
    srv.stop()


def scrape(srv) -> dict:
    """``/metrics`` as ``{name: (type, [(labels, value), ...])}`` (the model_name label dropped)."""
    out = {}
    for family in text_string_to_metric_families(srv.get("/metrics").text):
        samples = [({k: v for k, v in s.labels.items() if k != "model_name"}, s.value)
                   for s in family.samples if s.name == family.name]
        out[family.name] = (family.type, samples)
    return out


def wait_for(srv, predicate, what: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(srv)
        if predicate(metrics):
            return metrics
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {metrics}"
        time.sleep(0.05)


def only(metrics: dict, name: str) -> tuple[dict, float]:
    (labels, value), = metrics[name][1]
    return labels, value


@pytest.mark.parametrize("metric", sorted(PROTOCOL))
def test_every_protocol_metric_is_exported_with_its_type_and_labels(lora_server, metric):
    name, kind, labels = PROTOCOL[metric]
    metrics = scrape(lora_server)
    assert metrics[name][0] == kind
    assert set(labels) <= set(only(metrics, name)[0])


def test_cache_config_gives_the_pool_in_blocks(lora_server):
    info = lora_server.get("/get_server_info").json()
    labels, value = only(scrape(lora_server), "shardline:cache_config_info")
    assert labels["block_size"] == "1"  # the allocator hands out single token slots
    assert int(labels["num_gpu_blocks"]) == info["max_total_num_tokens"]
    assert value == 1


def test_queue_running_kv_and_adapters_follow_the_requests(lora_server):
    """With one running slot: a streamed request on adapter ``a`` runs, one on ``b`` waits; the
    gauges say so, KV usage is above 0, and the adapter series is newer than before. Closing the
    stream aborts ``a``; then ``b`` runs and everything returns to idle."""
    before = only(scrape(lora_server), "shardline:lora_requests_info")[1]
    body = {"input_ids": PROMPT, "stream": True, "lora_path": "a",
            "sampling_params": {"max_new_tokens": 6000, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(base_url=lora_server.url, timeout=120) as client, \
            client.stream("POST", "/generate", json=body) as running:
        assert running.status_code == 200
        wait_for(lora_server, lambda m: only(m, "shardline:lora_requests_info")[0]["running_lora_adapters"] == "a",
                 "adapter a running")
        waiting = threading.Thread(target=httpx.post, args=(lora_server.url + "/generate",), kwargs={
            "json": {"input_ids": PROMPT, "lora_path": "b",
                     "sampling_params": {"max_new_tokens": 2, "temperature": 0}}, "timeout": 120})
        waiting.start()
        busy = wait_for(lora_server,
                        lambda m: only(m, "shardline:lora_requests_info")[0]["waiting_lora_adapters"] == "b",
                        "adapter b waiting")
    waiting.join(120)
    labels, stamped = only(busy, "shardline:lora_requests_info")
    assert labels["max_lora"] == "2"
    assert stamped > before
    assert only(busy, "shardline:num_requests_running")[1] == 1
    assert only(busy, "shardline:num_requests_waiting")[1] == 1
    assert 0 < only(busy, "shardline:kv_cache_usage_perc")[1] <= 1
    idle = wait_for(lora_server, lambda m: only(m, "shardline:num_requests_running")[1] == 0
                    and only(m, "shardline:lora_requests_info")[0]["running_lora_adapters"] == "", "idle")
    assert only(idle, "shardline:lora_requests_info")[0]["waiting_lora_adapters"] == ""
