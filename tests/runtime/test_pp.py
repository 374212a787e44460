"""Pipeline parallelism: the layer split, per-stage models and KV pools, and pp=2 (gloo processes
on CPU) giving the tokens and logits of pp=1 through the real scheduler loop, with micro-batches
in flight or one batch at a time, chunked prefill, the prefix cache, retraction, aborts and
all-or-nothing weight updates; pp=2 x tp=2 (four processes) gives the tokens of tp=1."""

from __future__ import annotations

import multiprocessing as mp

import pp_harness
import pytest
import torch

from shardline_runtime.configs.pipeline_stage import (
    PipelineLayoutError,
    PipelineStage,
    layer_partition,
)
from shardline_runtime.managers.io_struct import (
    AbortReq,
    ContinueGenerationReqInput,
    GetWeightsByNameReqInput,
    PauseGenerationReqInput,
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
)

TOL = 1e-4  # as tests/runtime/test_tp.py
PROMPTS = [[5, 17, 200, 33, 9, 41, 77, 300], [12, 8, 101, 4, 60], [7, 7, 7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
FORCED = [[1, 2, 3, 4], [9, 8, 7, 6], [40, 41, 42, 43]]
SHARED = list(range(30, 44))  # a 14-token prefix for the chunked-prefill / prefix-cache case


def requests(tag: str = "p", n: int = 12) -> list:
    return [pp_harness.greedy(f"{tag}{i}", p, n) for i, p in enumerate(PROMPTS)]


# ---- the split and the stage's model: no processes ------------------------------------------------

@pytest.mark.parametrize("layers, pp, expected", [(2, 2, [1, 1]), (3, 2, [2, 1]), (7, 3, [2, 3, 2]), (10, 4, [2, 3, 3, 2])])
def test_even_split_gives_the_remainder_to_the_stages_before_the_last(layers, pp, expected):
    assert layer_partition(layers, pp) == expected


def test_stage_ranges_are_contiguous_and_cover_every_layer():
    stages = [PipelineStage.for_rank(7, r, 3, (1, 4, 2)) for r in range(3)]
    assert [(s.start_layer, s.end_layer) for s in stages] == [(0, 1), (1, 5), (5, 7)]
    assert [(s.is_first, s.is_last) for s in stages] == [(True, False), (False, False), (False, True)]


@pytest.mark.parametrize("partition, message", [
    ((1, 1), "summing to the model's 3 layers"),
    ((3, 0), "at least one layer each"),
    ((1, 1, 1), "must give 2 stages"),
])
def test_bad_layer_partition_names_the_flag(partition, message):
    with pytest.raises(PipelineLayoutError, match=f"--pp-layer-partition .*{message}"):
        layer_partition(3, 2, partition)


def test_model_with_fewer_layers_than_stages_fails_before_the_rendezvous(tiny_checkpoint):
    import harness

    path = tiny_checkpoint("llama", num_hidden_layers=1)
    # an address nothing listens on: the error must come before any attempt to join
    with pytest.raises(PipelineLayoutError, match="the model has 1 layers but --pp-size is 2"):
        harness.make_runner(path, pp_rank=1, pp_size=2, dist_init_addr="127.0.0.1:1")


def test_fewer_layers_than_stages_reaches_the_termination_log(tiny_checkpoint, tmp_path, monkeypatch):
    from shardline_runtime.managers.scheduler_process import run_scheduler_process
    from shardline_runtime.server_args import ServerArgs

    log = tmp_path / "termination-log"
    monkeypatch.setenv("SHARDLINE_TERMINATION_LOG", str(log))
    args = ServerArgs(model_path=str(tiny_checkpoint("llama", num_hidden_layers=1)), pp_size=2, device="cpu",
                      dist_init_addr="127.0.0.1:1", max_total_tokens=256)
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_scheduler_process, args=(args, 0, None, None, writer))
    proc.start()
    writer.close()
    assert reader.poll(120), "the scheduler process reported nothing"
    report = reader.recv()
    proc.join(60)
    assert proc.exitcode == 1
    assert report["status"] == "error"
    assert "[tp 0 pp 0] PipelineLayoutError: the model has 1 layers but --pp-size is 2" in log.read_text()


@pytest.mark.parametrize("pp_size, partition, message", [
    (1000, (), "the model has 2 layers but --pp-size is 1000"),
    (2, (1, 2), "--pp-layer-partition 1,2 must give 2 stages"),
])
def test_launcher_rejects_a_bad_layer_split_before_spawning_any_rank(
        tiny_checkpoint, tmp_path, monkeypatch, pp_size, partition, message):
    """--pp-size 1000 on a 2-layer model must not start 1000 scheduler processes to find out."""
    from shardline_runtime import launch
    from shardline_runtime.launch import free_port, launch_server
    from shardline_runtime.server_args import ServerArgs

    def spawned(*_):
        raise AssertionError("scheduler processes were spawned for a layer split that cannot work")

    log = tmp_path / "termination-log"
    monkeypatch.setenv("SHARDLINE_TERMINATION_LOG", str(log))
    monkeypatch.setattr(launch, "_spawn_schedulers", spawned)
    monkeypatch.setattr("shardline_runtime.termination_log._written", False)  # one line per process
    args = ServerArgs(model_path=str(tiny_checkpoint("llama")), pp_size=pp_size, pp_layer_partition=partition,
                      device="cpu", port=free_port())
    assert launch_server(args) == 1
    assert log.read_text().startswith(f"PipelineLayoutError: {message}")


def test_stage_model_holds_only_its_layers_and_loads_only_its_weights(tiny_checkpoint):
    from safetensors.torch import load_file

    from shardline_runtime.configs.model_config import ModelConfig
    from shardline_runtime.model_loader.loader import load_model

    path = tiny_checkpoint("llama", num_hidden_layers=3, tie_word_embeddings=True)
    config = ModelConfig.from_pretrained(str(path), dtype="float32", device_type="cpu")
    first = load_model(config, str(path), torch.device("cpu"), stage=PipelineStage.for_rank(3, 0, 2))
    last = load_model(config, str(path), torch.device("cpu"), stage=PipelineStage.for_rank(3, 1, 2))
    first_names = {n for n, _ in first.named_parameters()}
    last_names = {n for n, _ in last.named_parameters()}
    assert {n.split(".")[2] for n in first_names if n.startswith("model.layers.")} == {"0", "1"}
    assert {n.split(".")[2] for n in last_names if n.startswith("model.layers.")} == {"2"}
    assert "model.embed_tokens.weight" in first_names and "lm_head.weight" not in first_names
    assert "model.norm.weight" in last_names and "model.embed_tokens.weight" not in last_names
    # tied, first != last: the last stage's own LM head holds the embedding's weights
    embed = load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(last.lm_head.weight, embed)


def test_server_args_pipeline_flags():
    from shardline_runtime.server_args import ServerArgs, ServerArgsError

    args = ServerArgs.from_cli(["--model-path", "/m", "--tp-size", "2", "--pp-size", "2", "--pp-layer-partition", "3,5",
                                "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "h:1"])
    assert (args.pp_size, args.pp_layer_partition, args.world_size, args.tp_size_per_node) == (2, (3, 5), 4, 2)
    with pytest.raises(ServerArgsError, match="--pp-layer-partition gives 3 stages but --pp-size is 2"):
        ServerArgs(model_path="/m", pp_size=2, pp_layer_partition="1,1,1")
    with pytest.raises(ServerArgsError, match=r"--tp-size x --pp-size \(1 x 3 = 3\) must be divisible by --nnodes \(2\)"):
        ServerArgs(model_path="/m", pp_size=3, nnodes=2, dist_init_addr="h:1")
    with pytest.raises(ServerArgsError, match="comma-separated layer counts"):
        ServerArgs(model_path="/m", pp_size=2, pp_layer_partition="a,b")


def test_max_running_requests_counts_every_micro_batch_slot(tiny_checkpoint):
    """--max-running-requests caps the requests of all slots together, not of each slot (one
    process with two micro-batch slots: the admission rule of a pp=2 stage, without the stages)."""
    scheduler = pp_harness.make_scheduler(tiny_checkpoint("llama"), loop_size=2, max_running_requests=1)
    step, peak = scheduler.pipeline.step, []

    def counted_step():
        step()
        peak.append(len({id(r) for b in scheduler.planner.running_batches() for r in b.reqs if not r.finished()}))

    scheduler.pipeline.step = counted_step
    outputs = pp_harness.drive(scheduler, [requests(n=4)])
    assert max(peak) == 1
    assert sorted(len(ids) for ids in outputs.values()) == [4, 4, 4]


def test_node_ranks_map_to_stage_and_tp_rank():
    from shardline_runtime.distributed import rank_layout, tp_ranks_of_node

    # tp 2 x pp 2 over 2 pods: pod 0 is stage 0, pod 1 stage 1
    assert [rank_layout(r, 2) for r in tp_ranks_of_node(2, 2, 1, pp_size=2)] == [(1, 0), (1, 1)]
    # tp 4 x pp 2 over 4 pods of 2 GPUs: pod 3 holds tp ranks 2, 3 of stage 1
    assert [rank_layout(r, 4) for r in tp_ranks_of_node(4, 4, 3, pp_size=2)] == [(1, 2), (1, 3)]


# ---- pp=2 over gloo against pp=1 ---------------------------------------------------------------

def _scenarios(tiny_checkpoint, bad_update_path=None) -> tuple[list[dict], dict]:
    llama, qwen3 = tiny_checkpoint("llama"), tiny_checkpoint("qwen3")
    three, tied = tiny_checkpoint("llama", num_hidden_layers=3), tiny_checkpoint("llama", tie_word_embeddings=True)
    seed1 = tiny_checkpoint("llama", seed=1)
    moe = tiny_checkpoint("qwen3_moe")
    tied_seed1 = tiny_checkpoint("llama", seed=1, tie_word_embeddings=True)
    chunked = [[pp_harness.greedy("a", SHARED + [1, 2], 8), pp_harness.greedy("b", SHARED[:9] + [3] * 9, 8)],
               [pp_harness.greedy("c", SHARED + [5, 6, 7], 8)]]
    tight = dict(max_total_tokens=72)
    two = dict(max_running_requests=2)  # the third request goes to the second micro-batch slot
    many = [pp_harness.greedy(f"r{i}", p, 24) for i, p in enumerate(PROMPTS + PROMPTS[:1])]
    scenarios = [
        dict(name="llama", path=str(llama), forced=FORCED, prompts=PROMPTS, feeds=[requests()], overrides=two),
        dict(name="llama_one_batch_at_a_time", path=str(llama), loop_size=1, feeds=[requests()], overrides=two),
        dict(name="qwen3", path=str(qwen3), forced=FORCED, prompts=PROMPTS, feeds=[requests()]),
        dict(name="three_layers", path=str(three), feeds=[requests()]),
        dict(name="moe", path=str(moe), feeds=[requests()]),
        dict(name="tied", path=str(tied), forced=FORCED, prompts=PROMPTS, feeds=[requests()]),
        dict(name="chunked_prefix", path=str(llama), overrides=dict(chunked_prefill_size=4), feeds=chunked),
        dict(name="retract", path=str(llama), overrides=tight, feeds=[many]),
        dict(name="abort", path=str(llama), feeds=[(3, [pp_harness.greedy("long", PROMPTS[0], 200)] + requests("s", 6)),
                                                   [AbortReq("long", {"type": "abort"})]]),
        dict(name="update", path=str(llama), feeds=[requests("before"), [UpdateWeightsFromDiskReqInput(str(seed1))],
                                                    requests("after")]),
        dict(name="update_tensor", path=str(tied), feeds=[
            [UpdateWeightsFromTensorReqInput((tied_seed1 / "model.safetensors").read_bytes())], requests("t"),
            [GetWeightsByNameReqInput("model.layers.1.mlp.down_proj.weight", 2)], [GetWeightsByNameReqInput("lm_head.weight", 2)]]),
        dict(name="pause_update_continue", path=str(llama), feeds=[
            (4, requests("q", 30)), (2, [PauseGenerationReqInput("retract")]),
            (2, [UpdateWeightsFromDiskReqInput(str(seed1))]), [ContinueGenerationReqInput()]]),
        dict(name="update_rejected", path=str(llama), fail_update_stage=1,
             feeds=[[UpdateWeightsFromDiskReqInput(str(seed1))], requests("kept")]),
    ]
    references = {
        "llama": (llama, two, [requests()]), "qwen3": (qwen3, {}, [requests()]), "three_layers": (three, {}, [requests()]), "moe": (moe, {}, [requests()]),
        "tied": (tied, {}, [requests()]), "chunked_prefix": (llama, dict(chunked_prefill_size=4), chunked),
        "retract": (llama, tight, [many]), "seed1": (seed1, {}, [requests()]), "short": (llama, {}, [requests("s", 6)]),
        "tied_seed1": (tied_seed1, {}, [requests("t")]),
    }
    return scenarios, references


def _reference(path, overrides, feeds, forced=False):
    scheduler = pp_harness.make_scheduler(path, **overrides)
    logits = pp_harness.forced_logits(scheduler.worker, PROMPTS, FORCED) if forced else None
    pp_harness.drive(scheduler, feeds)
    return pp_harness.captured(scheduler), logits


@pytest.fixture(scope="module")
def pp2(tiny_checkpoint, tmp_path_factory):
    scenarios, refs = _scenarios(tiny_checkpoint)
    ranks = pp_harness.run_pp(1, 2, scenarios, tmp_path_factory.mktemp("pp2"))
    reference = {name: _reference(p, o, f, forced=name in ("llama", "qwen3", "tied")) for name, (p, o, f) in refs.items()}
    return ranks, reference


def _ids(outputs: dict, tag: str) -> list[list[int]]:
    return [outputs[f"{tag}{i}"]["ids"] for i in range(len(PROMPTS))]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen3", "tied"])
def test_pp2_matches_pp1_tokens_and_logits(pp2, name):
    ranks, reference = pp2
    expected, expected_logits = reference[name]
    assert _ids(ranks[0][name]["outputs"], "p") == _ids(expected, "p")
    assert ranks[0][name]["logits"] is None  # the first stage has no LM head
    for got, want in zip(ranks[1][name]["logits"], expected_logits, strict=True):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "three_layers", "tied", "chunked_prefix", "retract", "update"])
def test_every_rank_appends_the_last_stages_tokens_and_frees_all_kv(pp2, name):
    ranks, _ = pp2
    assert ranks[0][name]["tokens"] == ranks[1][name]["tokens"]
    assert [rank[name]["kv_leaked"] for rank in ranks] == [0, 0]


@pytest.mark.slow
def test_micro_batches_in_flight_equal_one_batch_at_a_time(pp2):
    ranks, reference = pp2
    assert _ids(ranks[0]["llama"]["outputs"], "p") == _ids(ranks[0]["llama_one_batch_at_a_time"]["outputs"], "p")
    assert _ids(ranks[0]["llama_one_batch_at_a_time"]["outputs"], "p") == _ids(reference["llama"][0], "p")
    assert ranks[0]["llama"]["max_busy_slots"] == 2  # requests decoded in both slots at once
    assert ranks[0]["llama_one_batch_at_a_time"]["max_busy_slots"] == 1


@pytest.mark.slow
def test_moe_model_pp2_matches_pp1(pp2):
    ranks, reference = pp2
    assert _ids(ranks[0]["moe"]["outputs"], "p") == _ids(reference["moe"][0], "p")


@pytest.mark.slow
def test_three_layers_split_two_and_one_with_kv_for_own_layers(pp2):
    ranks, reference = pp2
    stages = [rank["three_layers"]["stage"] for rank in ranks]
    assert [(s.start_layer, s.end_layer) for s in stages] == [(0, 2), (2, 3)]
    assert [rank["three_layers"]["kv_layers"] for rank in ranks] == [2, 1]
    assert _ids(ranks[0]["three_layers"]["outputs"], "p") == _ids(reference["three_layers"][0], "p")


@pytest.mark.slow
def test_tied_embeddings_last_stage_head_is_the_embedding(pp2, tiny_checkpoint):
    from safetensors.torch import load_file

    ranks, _ = pp2
    embed = load_file(str(tiny_checkpoint("llama", tie_word_embeddings=True) / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(ranks[1]["tied"]["lm_head"], embed)
    assert "model.embed_tokens.weight" not in ranks[1]["tied"]["params"]


@pytest.mark.slow
def test_chunked_prefill_and_prefix_cache_with_pp2(pp2):
    ranks, reference = pp2
    got, want = ranks[0]["chunked_prefix"]["outputs"], reference["chunked_prefix"][0]
    assert [got[r]["ids"] for r in "abc"] == [want[r]["ids"] for r in "abc"]
    assert got["c"]["cached"] >= 14  # c's shared prefix came from the cache (a finished first)


@pytest.mark.slow
def test_retraction_with_pp2_continues_exactly(pp2):
    ranks, reference = pp2
    got, want = ranks[0]["retract"]["outputs"], reference["retract"][0]
    assert ranks[0]["retract"]["retractions"] > 0
    assert {r: got[r]["ids"] for r in want} == {r: want[r]["ids"] for r in want}


@pytest.mark.slow
def test_abort_with_micro_batches_in_flight(pp2):
    ranks, reference = pp2
    got = ranks[0]["abort"]["outputs"]
    assert got["long"]["finish"]["type"] == "abort"
    assert len(got["long"]["ids"]) < 200
    assert _ids(got, "s") == _ids(reference["short"][0], "s")
    assert [rank["abort"]["kv_leaked"] for rank in ranks] == [0, 0]


@pytest.mark.slow
def test_weight_update_in_place_with_pp2(pp2):
    ranks, reference = pp2
    got = ranks[0]["update"]["outputs"]
    assert got["_replies"][0][0] is True, got["_replies"]
    assert _ids(got, "before") == _ids(reference["llama"][0], "p")
    assert _ids(got, "after") == _ids(reference["seed1"][0], "p")


@pytest.mark.slow
def test_weights_from_tensors_and_read_back_across_stages(pp2, tiny_checkpoint):
    from safetensors.torch import load_file

    ranks, reference = pp2
    got = ranks[0]["update_tensor"]["outputs"]
    (ok, _, _), (_, _, layer1), (_, _, head) = got["_replies"]
    assert ok is True
    assert _ids(got, "t") == _ids(reference["tied_seed1"][0], "t")
    weights = load_file(str(tiny_checkpoint("llama", seed=1, tie_word_embeddings=True) / "model.safetensors"))
    # layer 1 lives on stage 1 and the tied head on both ends: rank 0 answers with stage 1's values
    assert torch.allclose(torch.tensor(layer1, dtype=torch.float64), weights["model.layers.1.mlp.down_proj.weight"][:2].double())
    assert torch.allclose(torch.tensor(head, dtype=torch.float64), weights["model.embed_tokens.weight"][:2].double())


@pytest.mark.slow
def test_pause_retract_update_continue_with_requests_in_flight(pp2):
    """An RL loop's pause (retract) -> update -> continue while micro-batches are in flight: the
    update waits for them, runs on both stages, and every request then finishes."""
    ranks, _ = pp2
    got = ranks[0]["pause_update_continue"]["outputs"]
    assert [reply[0] for reply in got["_replies"]] == [True, True, True], got["_replies"]
    assert [len(ids) for ids in _ids(got, "q")] == [30, 30, 30]
    assert ranks[0]["pause_update_continue"]["retractions"] > 0
    assert ranks[0]["pause_update_continue"]["tokens"] == ranks[1]["pause_update_continue"]["tokens"]
    assert [rank["pause_update_continue"]["kv_leaked"] for rank in ranks] == [0, 0]


@pytest.mark.slow
def test_weight_update_rejected_on_one_stage_keeps_old_weights_on_every_stage(pp2):
    ranks, reference = pp2
    got = ranks[0]["update_rejected"]["outputs"]
    ok, message, _ = got["_replies"][0]
    assert ok is False and "another tensor-parallel rank or pipeline stage" in message
    assert _ids(got, "kept") == _ids(reference["llama"][0], "p")


@pytest.fixture(scope="module")
def pp2_graphs(tiny_checkpoint, tmp_path_factory):
    """pp=2 with each stage's decode graphs on the CPU static-buffer path, and pp=1 eager."""
    llama = tiny_checkpoint("llama")
    scenario = dict(name="graphs", path=str(llama), forced=FORCED, prompts=PROMPTS, feeds=[requests()],
                    static_graphs=True)
    ranks = pp_harness.run_pp(1, 2, [scenario], tmp_path_factory.mktemp("pp2g"))
    return ranks, _reference(llama, {}, [requests()], forced=True)


@pytest.mark.slow
def test_pp2_each_stage_replays_its_decode_graph_path(pp2_graphs):
    ranks, _ = pp2_graphs
    assert [bool(rank["graphs"]["replayed"]) for rank in ranks] == [True, True]


@pytest.mark.slow
def test_pp2_decode_graph_path_gives_the_pp1_eager_tokens(pp2_graphs):
    ranks, (expected, _) = pp2_graphs
    assert _ids(ranks[0]["graphs"]["outputs"], "p") == _ids(expected, "p")


@pytest.mark.slow
def test_pp2_decode_graph_path_gives_the_pp1_eager_logits(pp2_graphs):
    ranks, (_, expected_logits) = pp2_graphs
    got = ranks[1]["graphs"]["logits"]
    assert max(float((g - w).abs().max()) for g, w in zip(got, expected_logits, strict=True)) <= TOL


@pytest.mark.slow
def test_pp2_tp2_four_processes_match_tp1(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    scenarios = [dict(name="l", path=str(path), forced=FORCED, prompts=PROMPTS, feeds=[requests()])]
    ranks = pp_harness.run_pp(2, 2, scenarios, tmp_path)
    expected, logits = _reference(path, {}, [requests()], forced=True)
    assert _ids(ranks[0]["l"]["outputs"], "p") == _ids(expected, "p")
    assert all(rank["l"]["tokens"] == ranks[0]["l"]["tokens"] for rank in ranks)
    for rank in ranks[2:]:  # both TP ranks of the last stage
        for got, want in zip(rank["l"]["logits"], logits, strict=True):
            assert (got - want).abs().max() <= TOL


def test_a_loop_with_more_slots_than_the_host_id_ring_keeps_every_slots_ids(tiny_checkpoint):
    """One process, five micro-batch slots (more than ``HOST_ID_RING``): a slot's result is
    processed four steps after it was sampled, after four other slots sampled; its greedy ids must
    be what it sampled, as with one slot (a ring would have handed its buffer to a later step)."""
    from shardline_runtime.layers.sampler import HOST_ID_RING

    llama, loop = tiny_checkpoint("llama"), HOST_ID_RING + 1
    staggered = [(1, [pp_harness.greedy(f"s{i}", PROMPTS[i % 3] + [i], 6)]) for i in range(loop)]
    wide = pp_harness.make_scheduler(llama, loop_size=loop)
    assert wide.worker.model_runner.sampler.host_ids is None
    got = pp_harness.drive(wide, staggered + [[]])
    assert wide.max_busy_slots == loop  # every slot held a batch at once
    want = pp_harness.drive(pp_harness.make_scheduler(llama), [[r for _, [r] in staggered]])
    assert got == want
