"""A new user's attacks on weight sync, memory release and the MoE recorder/EPLB endpoints.

One real server (tiny Qwen3-MoE, TP 1, two redundant expert slots, CPU weight backup). Each test
is a bug found by attacking it:

- a misspelt field (``tag`` for ``tags``) was ignored, so the default (every tag, weights too)
  was released; unknown fields of these admin bodies are now 400 naming the field;
- a negative or huge declared shape in ``/update_weights_from_distributed`` crashed the
  scheduler (``torch.empty`` of the declared shape) and the server exited;
- a trainer update refused before it ran (paused ``in_place``, weights released) left the
  trainer's broadcast blocked until its timeout;
- ``/rebalance_experts`` while the weights were released answered an internal ``IndexError``;
- after a rebalance the record's physical counts were read with the new placement, so
  ``logical_count`` (and the next rebalance) misattributed the load;
- two file dumps in one millisecond overwrote each other.
"""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from serving_server import free_port, start_server

SKEWED = [[7] * 12, [7, 9] * 6, [9] * 12]
OTHER = [[300] * 12, [301, 450] * 6]


@pytest.fixture(scope="module")
def moe_server(checkpoint_dir):
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    path = checkpoint_dir / "qwen3-moe-attacks"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, arch="qwen3_moe", seed=0)
    srv = start_server(path, checkpoint_dir, "--ep-num-redundant-experts", "2", "--enable-weights-cpu-backup",
                       "--max-total-tokens", "1024", "--device", "cpu", timeout=240)
    yield srv
    srv.stop()


def _generate(server, ids, n=2) -> list[int]:
    out = server.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}})
    assert out.status_code == 200, out.text
    return out.json()["output_ids"]


def _state(server) -> dict:
    info = server.get("/get_server_info").json()
    return {k: info[k] for k in ("generation_paused", "memory_blocked", "weight_version")}


@pytest.mark.parametrize("path,body,param", [
    ("/release_memory_occupation", {"tag": ["kv_cache"]}, "tag"),
    ("/resume_memory_occupation", {"tag": ["kv_cache"]}, "tag"),
    ("/pause_generation", {"mdoe": "retract"}, "mdoe"),
    ("/get_weights_by_name", {"name": "model.norm.weight", "truncate": 2}, "truncate"),
    ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                                          "weight_verison": "v9"}, "weight_verison"),
])
def test_unknown_fields_of_admin_bodies_are_400_and_change_nothing(moe_server, path, body, param):
    before = _state(moe_server)
    try:
        out = moe_server.post(path, body)
        assert out.status_code == 400, out.text
        err = out.json()["error"]
        assert err["param"] == param and param in err["message"] and "allowed fields" in err["message"], err
        assert _state(moe_server) == before
    finally:  # undo what the bug did, so the other tests see a serving server
        moe_server.post("/resume_memory_occupation", {})
        moe_server.post("/continue_generation")
    _generate(moe_server, [5, 6, 7])


def test_unknown_query_parameter_of_raw_tensor_update_is_400(moe_server):
    out = httpx.post(moe_server.url + "/update_weights_from_tensor?weight_verison=v9", content=b"x",
                     headers={"content-type": "application/octet-stream"}, timeout=60)
    assert out.status_code == 400 and out.json()["error"]["param"] == "weight_verison", out.text


class _CreatesAFile:
    """Unpickling this creates ``path``: the proof that request bytes were unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("body,param", [
    ({"load_format": None, "flush_cache": True}, "serialized_named_tensors"),  # SGLang's HTTP body
    ({"load_format": "direct"}, "serialized_named_tensors"),
])
def test_sglang_pickled_tensor_list_is_400_naming_the_field_and_never_unpickled(moe_server, tmp_path, body, param):
    import base64
    import pickle

    marker = tmp_path / "unpickled"
    payload = base64.b64encode(pickle.dumps([("model.norm.weight", _CreatesAFile(marker))])).decode()
    before = _state(moe_server)
    out = moe_server.post("/update_weights_from_tensor", {"serialized_named_tensors": [payload], **body})
    assert out.status_code == 400, out.text
    err = out.json()["error"]
    assert err["param"] == param, err
    assert "safetensors" in err["message"], err
    assert "docs/api.md" in err["message"], err
    assert not marker.exists(), "the request's pickle was executed"
    assert _state(moe_server) == before


@pytest.mark.parametrize("load_format", [None, "direct", "flattened_bucket"])
def test_pickle_load_formats_are_400_naming_load_format(moe_server, tmp_path, load_format):
    import base64
    import pickle

    marker = tmp_path / "unpickled"
    payload = base64.b64encode(pickle.dumps(_CreatesAFile(marker))).decode()
    out = moe_server.post("/update_weights_from_tensor",
                          {"serialized_named_tensors": payload, "load_format": load_format})
    assert out.status_code == 400, out.text
    assert out.json()["error"]["param"] == "load_format", out.text
    assert not marker.exists(), "the request's pickle was executed"


def _join_group(server, name: str):
    """The test process as the trainer (rank 0) of weight-sync group ``name`` with the server."""
    from shardline_runtime.distributed.weight_sync_group import init_weights_update_group

    port, reply = free_port(), {}
    caller = threading.Thread(target=lambda: reply.update(init=server.post("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "world_size": 2, "group_name": name,
        "backend": "gloo", "timeout_s": 10})))
    caller.start()
    group = init_weights_update_group("127.0.0.1", port, 0, 2, name, "gloo", 10)
    caller.join()
    assert reply["init"].status_code == 200, reply["init"].text
    return group


def test_bad_declared_shapes_are_400_and_the_server_lives(moe_server):
    from shardline_runtime.distributed.weight_sync_group import destroy_weights_update_group

    group = _join_group(moe_server, "attack")
    try:
        update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "group_name": "attack"}
        out = moe_server.post("/update_weights_from_distributed", {**update, "shapes": [[-1, 64]]})
        assert out.status_code == 400 and out.json()["error"]["param"] == "shapes", out.text
        # non-negative but far larger than any parameter: refused without allocating it
        out = moe_server.post("/update_weights_from_distributed", {**update, "shapes": [[1 << 40]]})
        assert out.status_code == 400 and "model.norm.weight" in out.json()["message"], out.text
        assert moe_server.get("/health").status_code == 200
        _generate(moe_server, [5, 6, 7])
        assert moe_server.post("/destroy_weights_update_group", {"group_name": "attack"}).status_code == 200
        again = moe_server.post("/destroy_weights_update_group", {"group_name": "attack"})
        assert again.status_code == 400 and "attack" in again.json()["message"]
    finally:
        destroy_weights_update_group(group)


def test_a_refused_trainer_update_still_drains_the_broadcast(moe_server):
    """Paused ``in_place`` with a request holding KV, an update is refused; the trainer's
    broadcast must still complete (docs: the trainer is never left blocked)."""
    from shardline_runtime.distributed.weight_sync_group import broadcast, destroy_weights_update_group

    group = _join_group(moe_server, "refused")
    long = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    done = {}
    runner = threading.Thread(target=lambda: done.update(r=moe_server.post("/generate", long)))
    runner.start()
    try:
        while moe_server.get("/get_server_info").json()["num_running_reqs"] == 0:
            assert runner.is_alive()
        assert moe_server.post("/pause_generation", {"mode": "in_place"}).status_code == 200
        reply = {}
        caller = threading.Thread(target=lambda: reply.update(r=moe_server.post("/update_weights_from_distributed", {
            "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "refused"})))
        caller.start()
        broadcast(group, torch.ones(64))  # raises WeightSyncGroupError after 10 s if nobody receives
        caller.join()
        assert reply["r"].status_code == 400 and "in_place" in reply["r"].json()["message"], reply["r"].text
    finally:
        moe_server.post("/pause_generation", {"mode": "abort"})  # end the long request now
        moe_server.post("/continue_generation")
        runner.join()
        moe_server.post("/destroy_weights_update_group", {"group_name": "refused"})
        destroy_weights_update_group(group)
    assert done["r"].status_code == 200, done["r"].text


def test_rebalance_while_weights_are_released_is_a_clear_400(moe_server):
    assert moe_server.post("/start_expert_distribution_record").status_code == 200
    for ids in SKEWED:
        _generate(moe_server, ids)
    assert moe_server.post("/pause_generation", {"mode": "abort"}).status_code == 200
    try:
        assert moe_server.post("/release_memory_occupation", {"tags": ["weights"]}).status_code == 200
        out = moe_server.post("/rebalance_experts")
        assert out.status_code == 400 and "resume_memory_occupation" in out.json()["message"], out.text
    finally:
        assert moe_server.post("/resume_memory_occupation", {}).status_code == 200
        assert moe_server.post("/continue_generation").status_code == 200
    assert moe_server.post("/rebalance_experts").status_code == 200
    moe_server.post("/stop_expert_distribution_record")


def _record(server, workload) -> dict:
    assert server.post("/flush_cache").status_code == 200  # every prompt token goes through the experts
    for ids in workload:
        _generate(server, ids)
    return server.post("/dump_expert_distribution_record").json()


def test_a_rebalance_never_misattributes_the_recorded_load(moe_server):
    assert moe_server.post("/start_expert_distribution_record", {"mode": "stat"}).status_code == 200
    _record(moe_server, OTHER)
    assert moe_server.post("/rebalance_experts").status_code == 200  # placement P1, from OTHER's load
    right_after = moe_server.post("/dump_expert_distribution_record").json()
    # documented: the record restarts after a rebalance (its slots now hold other experts)
    assert right_after["num_forward_passes"] == 0 and not any(map(any, right_after["logical_count"])), right_after
    first = _record(moe_server, SKEWED)
    assert moe_server.post("/rebalance_experts").status_code == 200  # placement P2, from SKEWED's load
    second = _record(moe_server, SKEWED)
    assert second["physical_to_logical_map"] != first["physical_to_logical_map"]  # the slots did move
    # the same traffic routes to the same logical experts, whatever the placement
    assert second["logical_count"] == first["logical_count"]
    moe_server.post("/stop_expert_distribution_record")


def test_file_dumps_in_one_millisecond_do_not_overwrite(tmp_path):
    from shardline_runtime.layers.moe.recorder import ExpertDistributionRecorder

    recorder = ExpertDistributionRecorder(2, 4, dump_dir=str(tmp_path))
    placement = torch.arange(4).repeat(2, 1)
    paths = {recorder.dump(placement, 4, to_file=True)["path"] for _ in range(30)}
    assert len(paths) == 30 and len(list(tmp_path.iterdir())) == 30


@pytest.mark.slow
def test_sigterm_while_paused_answers_the_held_requests(serving_checkpoint, checkpoint_dir):
    """Requests held by ``/pause_generation`` get an answer at SIGTERM (503, or a stream that
    ends with an abort and ``[DONE]``), and the process exits 0 promptly: they were left to the
    listener's close (500 / a cut stream after the graceful-shutdown timeout)."""
    import signal
    import time

    srv = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", "1024", "--drain-timeout", "2")
    replies: dict = {}

    def send(stream: bool) -> None:
        body = {"prompt": "hi", "max_tokens": 4, "stream": stream}
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                replies[stream] = (r.status_code, r.read().decode())
        except httpx.HTTPError as exc:
            replies[stream] = ("error", repr(exc))

    try:
        assert srv.post("/pause_generation", {"mode": "abort"}).status_code == 200
        senders = [threading.Thread(target=send, args=(s,)) for s in (False, True)]
        for t in senders:
            t.start()
        deadline = time.monotonic() + 60
        while srv.get("/get_server_info").json()["num_held_reqs"] < 2:  # both held by the pause
            assert time.monotonic() < deadline, "the two requests were never held by the pause"
            time.sleep(0.05)
        started = time.monotonic()
        assert srv.stop(signal.SIGTERM, timeout=60) == 0
        for t in senders:
            t.join(30)
        assert time.monotonic() - started < 20
    finally:
        srv.stop()
    status, text = replies[False]
    assert status == 503 and "shutting down" in text, replies
    status, text = replies[True]
    assert status == 503 or (status == 200 and text.rstrip().endswith("data: [DONE]")), replies
