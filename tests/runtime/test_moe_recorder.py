"""The expert-distribution recorder counts, per layer, the experts transformers' router picks
(top-k of ``output_router_logits``) on the same prompts, in ``stat`` and ``per_pass`` modes;
it records nothing when stopped; dumps go to JSON or a file; a TP1 rebalance with redundant
slots keeps greedy outputs; an in-place weight update works for an MoE model."""

import json

import pytest
import torch

import harness
from shardline_runtime.layers.moe.recorder import RecorderError

PROMPTS = [[5, 17, 200, 33, 9, 41, 77, 300, 12], [12, 8, 101, 4, 60], [7, 7, 7, 7]]


def transformers_expert_counts(path, prompts, top_k=2):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    counts = None
    with torch.no_grad():
        for prompt in prompts:
            router_logits = model(torch.tensor([prompt]), output_router_logits=True).router_logits  # per layer (T, E)
            per_layer = torch.stack([
                torch.bincount(torch.softmax(r.float(), -1).topk(top_k, -1).indices.reshape(-1), minlength=r.shape[-1])
                for r in router_logits
            ])
            counts = per_layer if counts is None else counts + per_layer
    return counts  # (layers, E)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_stat_record_equals_transformers_router_top_k(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    runner = harness.make_runner(path)
    recorder = runner.eplb_manager.recorder
    recorder.start("stat")
    harness.extend(runner, harness.new_seqs(runner, len(PROMPTS)), PROMPTS)
    recorder.stop()
    dump = runner.eplb_manager.dump()
    assert dump["mode"] == "stat"
    assert torch.equal(torch.tensor(dump["logical_count"]), transformers_expert_counts(path, PROMPTS))


def test_per_pass_record_has_one_entry_per_forward_pass(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    runner = harness.make_runner(path)
    runner.eplb_manager.recorder.start("per_pass")
    seqs = harness.new_seqs(runner, 2)
    harness.extend(runner, seqs, PROMPTS[:2])
    harness.decode(runner, seqs, [3, 4])
    dump = runner.eplb_manager.dump()
    passes = torch.tensor(dump["physical_count"])  # (pass, layer, physical)
    assert dump["num_forward_passes"] == 2
    assert passes[0].sum(-1).tolist() == [2 * (9 + 5)] * 2  # every prompt token, top-2, each layer
    assert passes[1].sum(-1).tolist() == [2 * 2] * 2  # one decode token per request


def test_nothing_is_recorded_while_stopped(tiny_checkpoint):
    runner = harness.make_runner(tiny_checkpoint("qwen3_moe"))
    manager = runner.eplb_manager
    harness.extend(runner, harness.new_seqs(runner, 1), PROMPTS[:1])
    assert manager.recorder.recording is False
    assert sum(map(sum, manager.dump()["logical_count"])) == 0


def test_dump_to_file_needs_a_directory(tiny_checkpoint, tmp_path):
    runner = harness.make_runner(tiny_checkpoint("qwen3_moe"))
    with pytest.raises(RecorderError, match="--expert-distribution-recorder-dir"):
        runner.eplb_manager.dump(to_file=True)
    runner = harness.make_runner(tiny_checkpoint("qwen3_moe"), expert_distribution_recorder_dir=str(tmp_path))
    runner.eplb_manager.recorder.start()
    harness.extend(runner, harness.new_seqs(runner, 1), PROMPTS[:1])
    path = runner.eplb_manager.dump(to_file=True)["path"]
    assert sum(json.load(open(path))["logical_count"][0]) == 2 * len(PROMPTS[0])


def test_unknown_mode_is_refused_with_allowed_values(tiny_checkpoint):
    runner = harness.make_runner(tiny_checkpoint("qwen3_moe"))
    with pytest.raises(RecorderError, match=r"mode must be one of \('stat', 'per_pass'\), got 'hourly'"):
        runner.eplb_manager.recorder.start("hourly")


def test_rebalance_with_redundant_slots_keeps_greedy_outputs_at_tp1(tiny_checkpoint):
    runner = harness.make_runner(tiny_checkpoint("mixtral"), ep_num_redundant_experts=2)
    before = harness.greedy_generate(runner, PROMPTS, 4)
    manager = runner.eplb_manager
    assert manager.rebalance().success is False  # nothing recorded yet: refused, placement kept
    manager.recorder.start()
    harness.greedy_generate(runner, [[7, 7, 7, 7, 7, 7]] * 3, 2)
    result = manager.rebalance()
    assert result.success, result.message
    assert harness.greedy_generate(runner, PROMPTS, 4) == before


def test_in_place_weight_update_of_moe_model(tiny_checkpoint):
    from test_moe_models import ref_logits, reference

    old, new = tiny_checkpoint("qwen2_moe"), tiny_checkpoint("qwen2_moe", seed=1)
    runner = harness.make_runner(old)
    ptr = runner.model.model.layers[0].mlp.experts.w13_weight.data_ptr()
    ok, message = runner.update_weights_from_disk(str(new))
    assert ok, message
    assert runner.model.model.layers[0].mlp.experts.w13_weight.data_ptr() == ptr
    out = harness.extend(runner, harness.new_seqs(runner, 1), PROMPTS[:1])
    assert (out.next_token_logits[0] - ref_logits(reference(new), PROMPTS[0])[-1]).abs().max() <= 1e-4


def test_periodic_rebalance_runs_every_n_passes_and_keeps_outputs(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    plain = harness.greedy_generate(harness.make_runner(path, ep_num_redundant_experts=2), PROMPTS, 5)
    runner = harness.make_runner(path, ep_num_redundant_experts=2, eplb_rebalance_num_iterations=3)
    assert harness.greedy_generate(runner, PROMPTS, 5) == plain  # 5 passes: one rebalance after the third
    result = runner.eplb_manager.last_result
    assert result is not None and result.success, result
    assert runner.eplb_manager.passes_since_rebalance == 2


def test_invalid_placement_leaves_weights_and_maps_untouched(tiny_checkpoint):
    from shardline_runtime.layers.moe.expert_rebalance import RebalanceError, rebalance_in_place

    runner = harness.make_runner(tiny_checkpoint("qwen3_moe"), ep_num_redundant_experts=2)
    layers = runner.eplb_manager.layers
    before = [(layer.w13_weight.clone(), layer.physical_to_logical_map.clone()) for layer in layers]
    bad = torch.stack([layer.physical_to_logical_map.clone() for layer in layers])
    bad[0] = 0  # every slot of layer 0 holds expert 0: experts 1..7 would have no replica
    with pytest.raises(RebalanceError, match="MoE layer 0: logical expert 0 has 10 replicas"):
        rebalance_in_place(runner.model, bad)
    for layer, (w13, p2l) in zip(layers, before):
        assert torch.equal(layer.w13_weight, w13)
        assert torch.equal(layer.physical_to_logical_map, p2l)


def test_weight_update_to_other_expert_count_is_refused_and_old_weights_serve(tiny_checkpoint):
    runner = harness.make_runner(tiny_checkpoint("qwen3_moe"))
    before = harness.greedy_generate(runner, PROMPTS[:1], 3)
    ok, message = runner.update_weights_from_disk(str(tiny_checkpoint("qwen3_moe", num_experts=4)))
    assert not ok
    assert "mlp.gate.weight" in message and "(8, 64)" in message and "(4, 64)" in message
    assert harness.greedy_generate(runner, PROMPTS[:1], 3) == before
