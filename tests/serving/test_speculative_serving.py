"""A real server with ``--speculative-algorithm NGRAM`` against the shared server without it
(same checkpoint): the same greedy text, stop strings cut at the same place, logprobs per
token, ``n > 1``, and the acceptance metrics on ``/metrics``; STANDALONE and EAGLE at TP=2."""

from __future__ import annotations

import re

import pytest
from serving_server import POOL, start_server

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"
PROMPT = "the model serves tokens the model serves tokens the model serves tokens the model"


@pytest.fixture(scope="module")
def spec_server(serving_checkpoint, checkpoint_dir):
    srv = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", str(POOL),
                       "--served-model-name", MODEL, "--speculative-algorithm", "NGRAM",
                       "--speculative-num-draft-tokens", "4")
    yield srv
    srv.stop()


def _complete(server, **body) -> dict:
    r = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _metric(server, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", server.get("/metrics").text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_greedy_text_equals_the_server_without_speculation(spec_server, server):
    spec = _complete(spec_server, max_tokens=40)["choices"][0]["text"]
    plain = _complete(server, max_tokens=40)["choices"][0]["text"]
    assert spec == plain


def test_stop_string_cuts_where_it_does_without_speculation(spec_server, server):
    text = _complete(server, max_tokens=40)["choices"][0]["text"]
    stop = text.strip()[5:9]
    spec = _complete(spec_server, max_tokens=40, stop=[stop])["choices"][0]
    plain = _complete(server, max_tokens=40, stop=[stop])["choices"][0]
    assert spec["text"] == plain["text"]
    assert spec["finish_reason"] == "stop"


def test_logprobs_come_one_per_token(spec_server):
    choice = _complete(spec_server, max_tokens=16, logprobs=2)["choices"][0]
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["logprobs"]["tokens"])


def test_n_returns_every_choice(spec_server):
    body = _complete(spec_server, max_tokens=8, n=3, temperature=0.8, seed=5)
    assert len(body["choices"]) == 3


def test_metrics_report_the_accept_length(spec_server):
    _complete(spec_server, max_tokens=40)
    assert _metric(spec_server, "shardline:spec_accept_length") >= 1.0
    assert _metric(spec_server, "shardline:spec_verify_steps") > 0


@pytest.fixture(scope="module")
def spec_tp2_server(serving_checkpoint, checkpoint_dir):
    srv = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", str(POOL),
                       "--served-model-name", MODEL, "--speculative-algorithm", "NGRAM", "--tp-size", "2")
    yield srv
    srv.stop()


def test_tp2_greedy_text_equals_the_server_without_speculation(spec_tp2_server, server):
    spec = _complete(spec_tp2_server, max_tokens=40)["choices"][0]["text"]
    plain = _complete(server, max_tokens=40)["choices"][0]["text"]
    assert spec == plain


def test_tp2_sampled_requests_finish_on_every_rank(spec_tp2_server):
    body = _complete(spec_tp2_server, max_tokens=24, n=2, temperature=1.0, seed=3)
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert _metric(spec_tp2_server, "shardline:spec_verify_steps") > 0


@pytest.fixture(scope="module")
def standalone_tp2_server(serving_checkpoint, checkpoint_dir):
    # the target is its own draft: the draft runner is TP-sharded beside it, every draft kept
    srv = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", str(POOL),
                       "--served-model-name", MODEL, "--speculative-algorithm", "STANDALONE",
                       "--speculative-draft-model-path", str(serving_checkpoint), "--tp-size", "2")
    yield srv
    srv.stop()


def test_standalone_tp2_greedy_text_equals_the_server_without_speculation(standalone_tp2_server, server):
    spec = _complete(standalone_tp2_server, max_tokens=40)["choices"][0]["text"]
    plain = _complete(server, max_tokens=40)["choices"][0]["text"]
    assert spec == plain
    assert _metric(standalone_tp2_server, "shardline:spec_accept_length") > 1.0


@pytest.fixture(scope="module")
def eagle_tp2_server(serving_checkpoint, checkpoint_dir, tmp_path_factory):
    # a random EAGLE head: TP-sharded beside the target, fed the target's hidden states
    from shardline_runtime.speculative.eagle_checkpoint import make_eagle_checkpoint

    head = make_eagle_checkpoint(serving_checkpoint, tmp_path_factory.mktemp("eagle-head"))
    srv = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", str(POOL),
                       "--served-model-name", MODEL, "--speculative-algorithm", "EAGLE",
                       "--speculative-draft-model-path", str(head), "--tp-size", "2")
    yield srv
    srv.stop()


def test_eagle_tp2_greedy_text_equals_the_server_without_speculation(eagle_tp2_server, server):
    spec = _complete(eagle_tp2_server, max_tokens=40)["choices"][0]["text"]
    plain = _complete(server, max_tokens=40)["choices"][0]["text"]
    assert spec == plain
    assert _metric(eagle_tp2_server, "shardline:spec_verify_steps") > 0


def test_a_draft_update_on_a_server_without_a_draft_model_is_a_400(server):
    r = server.post("/update_weights_from_disk", {"model_path": "/nowhere", "draft_model_path": "/nowhere-draft"})
    assert r.status_code == 400
    assert "--speculative-algorithm STANDALONE" in r.json()["message"]


def test_server_info_says_why_no_verify_graph_was_captured(spec_server):
    graphs = spec_server.get("/get_server_info").json()["cuda_graphs"]
    assert graphs["verify_batch_sizes"] == [] and graphs["verify_tokens_per_request"] == 0
    assert graphs["draft_batch_sizes"] == []
    assert graphs["speculative_reason"] == "verify: cpu: no CUDA graphs", "NGRAM has no draft model"


def test_an_eagle_server_updates_target_and_head_together_over_http(eagle_tp2_server, server):
    """The route takes ``draft_model_path`` with EAGLE too (issue 30): target and head reload
    together and the server reports the head it serves."""
    head = eagle_tp2_server.args[eagle_tp2_server.args.index("--speculative-draft-model-path") + 1]
    target = eagle_tp2_server.args[eagle_tp2_server.args.index("--model-path") + 1]
    r = eagle_tp2_server.post("/update_weights_from_disk", {"model_path": target, "draft_model_path": head})
    assert r.status_code == 200, r.text
    weights = eagle_tp2_server.get("/get_server_info").json()["weights"]
    assert weights["draft_model_path"] == head and weights["draft_digest"].startswith("sha256:")
    spec = _complete(eagle_tp2_server, max_tokens=24)["choices"][0]["text"]
    assert spec == _complete(server, max_tokens=24)["choices"][0]["text"]
