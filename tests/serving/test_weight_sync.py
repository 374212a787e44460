"""Weight sync from a trainer process into a TP=2 server (gloo), and update from tensors.

A real trainer process (``weight_sync_trainer.py``) hosts the weight-sync group as rank 0 and
broadcasts checkpoint tensors; the server's two TP ranks join as ranks 1 and 2 and cut their
shards with each parameter's ``weight_loader``. References are cold starts on the same weights.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file, save
from scheduler_harness import greedy, make_scheduler, run_to_completion
from serving_server import REPO, free_port, server_env, start_server

PROMPTS = [[5, 6, 7], list(range(20, 60)), [300, 200, 100, 50, 25, 12]]
GROUP = "sync"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2_server(serving_checkpoint, checkpoint_dir):
    srv = start_server(serving_checkpoint, checkpoint_dir, "--tp-size", "2", "--max-total-tokens", "2048",
                       "--weight-version", "v0", timeout=240)
    yield srv
    srv.stop()


def cold_start_outputs(path) -> list[list[int]]:
    scheduler = make_scheduler(path, max_total_tokens=2048)
    scheduler.process_input_requests([greedy(f"p{i}", p, 12) for i, p in enumerate(PROMPTS)])
    done = run_to_completion(scheduler)
    return [done[f"p{i}"]["ids"] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def expected(serving_checkpoint, serving_checkpoint_b):
    return {"a": cold_start_outputs(serving_checkpoint), "b": cold_start_outputs(serving_checkpoint_b)}


def outputs(server) -> list[list[int]]:
    body = {"sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    return [server.post("/generate", {**body, "input_ids": p}).json()["output_ids"] for p in PROMPTS]


def checkpoint_specs(path) -> list[dict]:
    weights = load_file(str(path / "model.safetensors"))
    return [{"name": n, "source": n, "shape": list(t.shape), "dtype": "float32"} for n, t in weights.items()]


def start_trainer(tmp_path, checkpoint, tensors, die_after=None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    plan = {"port": port, "world_size": 3, "group_name": GROUP, "timeout_s": 20, "checkpoint": str(checkpoint),
            "die_after": die_after, "tensors": tensors}
    plan_path = tmp_path / f"plan-{port}.json"
    plan_path.write_text(json.dumps(plan))
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/serving/weight_sync_trainer.py"), str(plan_path)],
                            env=server_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, port


def sync(server, tmp_path, checkpoint, tensors, die_after=None, declared=None, weight_version=None):
    """Run one trainer round: init the group, update, destroy. Returns (update reply, trainer rc)."""
    trainer, port = start_trainer(tmp_path, checkpoint, tensors, die_after)
    try:
        init = server.post("/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3,
            "group_name": GROUP, "backend": "gloo", "timeout_s": 20})
        if init.status_code != 200:
            trainer.kill()
            raise AssertionError(f"{init.text}\ntrainer: {trainer.communicate()[0]}")
        specs = declared or tensors
        reply = server.post("/update_weights_from_distributed", {
            "names": [s["name"] for s in specs], "dtypes": [s["dtype"] for s in specs],
            "shapes": [s["shape"] for s in specs], "group_name": GROUP, "weight_version": weight_version})
        rc = trainer.wait(30)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    server.post("/destroy_weights_update_group", {"group_name": GROUP})
    return reply, rc


def test_first_outputs_are_the_cold_start_ones(tp2_server, expected):
    assert outputs(tp2_server) == expected["a"]


def test_rejected_name_keeps_old_weights_and_drains_the_trainer(tp2_server, serving_checkpoint_b, tmp_path):
    tensors = checkpoint_specs(serving_checkpoint_b)
    tensors[3] = {**tensors[3], "name": "model.layers.0.self_attn.nope.weight"}
    before = outputs(tp2_server)
    reply, rc = sync(tp2_server, tmp_path, serving_checkpoint_b, tensors, weight_version="bad")
    assert reply.status_code == 400
    assert "model.layers.0.self_attn.nope.weight" in reply.json()["message"]
    assert rc == 0, "the trainer's broadcast must be drained, not left blocked"
    assert outputs(tp2_server) == before
    assert tp2_server.get("/get_server_info").json()["weight_version"] == "v0"


def test_rejected_shape_names_the_parameter(tp2_server, serving_checkpoint_b, tmp_path):
    tensors = checkpoint_specs(serving_checkpoint_b)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors = [t if t["name"] != name else {**t, "source": None, "shape": [t["shape"][0], 3]} for t in tensors]
    before = outputs(tp2_server)
    reply, _ = sync(tp2_server, tmp_path, serving_checkpoint_b, tensors)
    assert reply.status_code == 400
    assert name in reply.json()["message"] and "shape" in reply.json()["message"]
    assert outputs(tp2_server) == before


def test_rejected_dtype_names_the_parameter(tp2_server, serving_checkpoint_b, tmp_path):
    tensors = [{**t, "dtype": "float16"} if i == 0 else t for i, t in enumerate(checkpoint_specs(serving_checkpoint_b))]
    before = outputs(tp2_server)
    reply, _ = sync(tp2_server, tmp_path, serving_checkpoint_b, tensors)
    assert reply.status_code == 400
    assert tensors[0]["name"] in reply.json()["message"] and "dtype" in reply.json()["message"]
    assert outputs(tp2_server) == before


def test_trainer_killed_mid_broadcast_keeps_old_weights(tp2_server, serving_checkpoint_b, tmp_path):
    tensors = checkpoint_specs(serving_checkpoint_b)
    before = outputs(tp2_server)
    started = time.monotonic()
    reply, rc = sync(tp2_server, tmp_path, serving_checkpoint_b, tensors, die_after=5)
    assert rc == -9
    assert reply.status_code == 400, reply.text
    assert "after 5 of" in reply.json()["message"]
    assert time.monotonic() - started < 60, "a dead trainer must end the update within the group timeout"
    assert outputs(tp2_server) == before
    assert tp2_server.get("/ready").status_code == 200


def test_broadcast_update_matches_a_cold_start(tp2_server, serving_checkpoint_b, expected, tmp_path):
    reply, rc = sync(tp2_server, tmp_path, serving_checkpoint_b, checkpoint_specs(serving_checkpoint_b),
                     weight_version="step-1")
    assert reply.status_code == 200, reply.text
    assert rc == 0
    assert outputs(tp2_server) == expected["b"]
    checkpoint = load_file(str(serving_checkpoint_b / "model.safetensors"))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                 "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
        got = tp2_server.post("/get_weights_by_name", {"name": name, "truncate_size": 5}).json()
        assert got == checkpoint[name][:5].tolist(), name  # SGLang's answer: the bare list
    info = tp2_server.get("/get_server_info").json()
    assert info["weight_version"] == "step-1"
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}
    assert tp2_server.post("/generate", body).json()["meta_info"]["weight_version"] == "step-1"
    assert 'shardline:weight_version_info{model_name=' in tp2_server.get("/metrics").text
    assert 'weight_version="step-1"' in tp2_server.get("/metrics").text


def test_get_weights_by_name_of_an_unknown_name_is_400_naming_it(tp2_server):
    reply = tp2_server.post("/get_weights_by_name", {"name": "model.nope.weight"})
    assert reply.status_code == 400, reply.text
    assert "model.nope.weight" in reply.json()["message"]


def test_update_from_tensor_in_buckets(tp2_server, serving_checkpoint, serving_checkpoint_b, expected):
    """Bucket 1 as the raw safetensors body (options in the query), bucket 2 as SGLang's base64 JSON.
    The server is first moved to rev-b in one update, so the buckets must change the answers
    whatever ran before."""
    import httpx

    other = load_file(str(serving_checkpoint_b / "model.safetensors"))
    reply = tp2_server.post("/update_weights_from_tensor",
                            {"serialized_named_tensors": base64.b64encode(save(other)).decode()})
    assert reply.status_code == 200, reply.text
    assert outputs(tp2_server) == expected["b"]
    weights = load_file(str(serving_checkpoint / "model.safetensors"))
    names = sorted(weights)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    reply = httpx.post(tp2_server.url + "/update_weights_from_tensor?flush_cache=false",
                       content=save({n: weights[n] for n in first}),
                       headers={"content-type": "application/octet-stream"}, timeout=120)
    assert reply.status_code == 200, reply.text
    data = base64.b64encode(save({n: weights[n] for n in second})).decode()
    reply = tp2_server.post("/update_weights_from_tensor", {"serialized_named_tensors": data, "weight_version": "a-again"})
    assert reply.status_code == 200, reply.text
    assert outputs(tp2_server) == expected["a"]
    assert tp2_server.get("/get_server_info").json()["weight_version"] == "a-again"
    bad = tp2_server.post("/update_weights_from_tensor", {"serialized_named_tensors": "not base64!"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "serialized_named_tensors"
