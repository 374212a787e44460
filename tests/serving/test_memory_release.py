"""Memory saver on CPU: release/resume weights and KV cache, with and without a CPU backup.

Measured on a real server process tree (RSS from /proc): the release must give the memory back
to the OS, and after resume the greedy outputs are the same as before.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from serving_server import start_server

PROMPTS = [[5, 6, 7], list(range(20, 60))]
KV_TOKENS = 8192
pytestmark = pytest.mark.slow


def tree_rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` and all its descendants (bytes)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


@pytest.fixture(scope="module")
def medium_checkpoint(checkpoint_dir):
    """~84 MB of float32 weights, so a release shows clearly in RSS."""
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    path = checkpoint_dir / "medium"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, seed=3, vocab_size=8192, hidden_size=512, intermediate_size=1536,
                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    return path


def outputs(server) -> list[list[int]]:
    body = {"sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    return [server.post("/generate", {**body, "input_ids": p}).json()["output_ids"] for p in PROMPTS]


def release_and_measure(server) -> tuple[int, int]:
    before = tree_rss_bytes(server.proc.pid)
    reply = server.post("/release_memory_occupation", {"tags": ["weights", "kv_cache", "cuda_graph"]})
    assert reply.status_code == 200, reply.text
    time.sleep(0.5)
    return before, tree_rss_bytes(server.proc.pid)


WEIGHT_BYTES = 4 * (8192 * 512 * 2 + 4 * (512 * 512 * 2 + 2 * 512 * 256 + 3 * 512 * 1536) + 9 * 512)
KV_BYTES = KV_TOKENS * 4 * 2 * 4 * 64 * 4


def test_release_without_backup_needs_a_weight_update(medium_checkpoint, checkpoint_dir, capsys):
    server = start_server(medium_checkpoint, checkpoint_dir, "--max-total-tokens", str(KV_TOKENS))
    try:
        expected = outputs(server)
        assert server.post("/release_memory_occupation", {"tags": ["gpu_cache"]}).status_code == 400
        before, released = release_and_measure(server)
        with capsys.disabled():
            print(f"\nRSS without CPU backup: {before / 2**20:.0f} MiB -> {released / 2**20:.0f} MiB released "
                  f"(weights {WEIGHT_BYTES / 2**20:.0f} MiB + KV {KV_BYTES / 2**20:.0f} MiB)")
        assert before - released > 0.8 * (WEIGHT_BYTES + KV_BYTES)
        assert server.get("/ready").status_code == 503
        refused = server.post("/generate", {"input_ids": PROMPTS[0]})
        assert refused.status_code == 503 and "resume_memory_occupation" in refused.json()["error"]["message"]
        assert server.post("/resume_memory_occupation", {}).status_code == 200
        blocked = server.post("/generate", {"input_ids": PROMPTS[0]})
        assert blocked.status_code == 503 and "weight update" in blocked.json()["error"]["message"]
        assert server.get("/ready").status_code == 503
        update = server.post("/update_weights_from_disk", {"model_path": str(medium_checkpoint), "weight_version": "reloaded"})
        assert update.status_code == 200, update.text
        assert server.get("/ready").status_code == 200
        assert outputs(server) == expected
    finally:
        server.stop()


def test_release_with_cpu_backup_resumes_the_same_outputs(medium_checkpoint, checkpoint_dir, capsys):
    server = start_server(medium_checkpoint, checkpoint_dir, "--max-total-tokens", str(KV_TOKENS),
                          "--enable-weights-cpu-backup")
    try:
        expected = outputs(server)
        before, released = release_and_measure(server)
        with capsys.disabled():
            print(f"\nRSS with CPU backup: {before / 2**20:.0f} MiB -> {released / 2**20:.0f} MiB released "
                  f"(on a CPU device the backup is the weights themselves; KV {KV_BYTES / 2**20:.0f} MiB)")
        assert before - released > 0.8 * KV_BYTES
        assert server.post("/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
        still = server.post("/generate", {"input_ids": PROMPTS[0]})
        assert still.status_code == 503 and "weights" in still.json()["error"]["message"]
        assert server.post("/resume_memory_occupation", {}).status_code == 200
        assert server.get("/ready").status_code == 200
        assert outputs(server) == expected
    finally:
        server.stop()


def test_pause_modes_and_release_while_running(server):
    """Release is refused while a request holds KV; retract frees it; continue finishes it."""
    import threading

    result: dict = {}
    body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    worker = threading.Thread(target=lambda: result.update(r=server.post("/generate", body, timeout=600)))
    worker.start()
    deadline = time.monotonic() + 60
    while server.get("/get_server_info").json()["num_running_reqs"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        assert server.post("/pause_generation", {"mode": "in_place"}).status_code == 200
        refused = server.post("/release_memory_occupation", {})
        assert refused.status_code == 400 and "pause_generation" in refused.json()["message"]
        assert server.post("/pause_generation", {"mode": "retract"}).status_code == 200
        deadline = time.monotonic() + 10
        while (info := server.get("/get_server_info").json())["num_running_reqs"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 1
        assert info["generation_paused"] == "retract"
    finally:
        assert server.post("/continue_generation").status_code == 200
    worker.join(600)
    reply = result["r"].json()
    assert reply["meta_info"]["finish_reason"]["type"] == "length" and len(reply["output_ids"]) == 200
