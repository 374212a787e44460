"""Weight sync from a trainer written for SGLang (``sglang_style_trainer.py``: SGLang's
``init_custom_process_group`` and one ``torch.distributed.broadcast`` per tensor, no Shardline
code) into a real server, at TP=1 and TP=2 (gloo). The reference is a cold start on the same
checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file
from serving_server import REPO, free_port, server_env, start_server
from test_weight_sync import cold_start_outputs, outputs

GROUP = "weight_update_group"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(request, serving_checkpoint, checkpoint_dir):
    srv = start_server(serving_checkpoint, checkpoint_dir, "--tp-size", str(request.param),
                       "--max-total-tokens", "2048", timeout=240)
    srv.tp_size = request.param
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def expected_b(serving_checkpoint_b):
    return cold_start_outputs(serving_checkpoint_b)


def test_sglang_style_trainer_updates_the_weights(server, serving_checkpoint_b, expected_b, tmp_path):
    weights = load_file(str(serving_checkpoint_b / "model.safetensors"))
    tensors = [{"name": n, "shape": list(t.shape), "dtype": "float32"} for n, t in weights.items()]
    port, world_size = free_port(), 1 + server.tp_size
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"port": port, "world_size": world_size, "group_name": GROUP, "timeout_s": 30,
                                "checkpoint": str(serving_checkpoint_b), "tensors": tensors}))
    trainer = subprocess.Popen([sys.executable, str(REPO / "tests/serving/sglang_style_trainer.py"), str(plan)],
                               env=server_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        init = server.post("/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world_size,
            "group_name": GROUP, "backend": "gloo", "timeout_s": 30}, timeout=60)
        assert init.status_code == 200, init.text
        reply = server.post("/update_weights_from_distributed", {
            "names": [t["name"] for t in tensors], "dtypes": [t["dtype"] for t in tensors],
            "shapes": [t["shape"] for t in tensors], "group_name": GROUP, "load_format": None,
            "flush_cache": True}, timeout=60)  # every field SGLang's client sends
        log = trainer.communicate(timeout=60)[0]
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    server.post("/destroy_weights_update_group", {"group_name": GROUP})
    assert reply.status_code == 200, reply.text
    assert trainer.returncode == 0, log
    assert outputs(server) == expected_b
