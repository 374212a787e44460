"""Body of one rank of the two-rank EPLB scenario (spawned by ``test_moe_eplb.py``).

Expert parallel 2 with 2 redundant slots: greedy outputs, a record of a skewed workload, a
rebalance, the same workload recorded again, greedy outputs again, then an in-place weight
update to another checkpoint (which must load into the re-placed slots)."""

from __future__ import annotations

import os

import torch

import harness

PROMPTS = [[5, 17, 200, 33, 9, 41, 77, 300], [12, 8, 101, 4, 60], [3, 3, 90, 91]]
# A skewed workload: few distinct tokens, so a few experts take most of the load.
SKEWED = [[7] * 10, [7, 9] * 5, [9] * 10, [7, 7, 9, 11] * 2]


def measured_imbalance(manager, workload: list[list[int]], runner) -> tuple[float, list]:
    from shardline_runtime.layers.moe.eplb_algorithm import rank_imbalance

    manager.recorder.start("stat")
    harness.greedy_generate(runner, workload, 3)
    manager.recorder.stop()
    counts = manager.recorder.physical_counts()[manager.layer_ids]
    return rank_imbalance(counts, 2), counts.tolist()


def eplb_worker(rank: int, port: int, path: str, new_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    runner = harness.make_runner(path, tp_rank=rank, tp_size=2, dist_init_addr=f"127.0.0.1:{port}",
                                 ep_size=2, ep_num_redundant_experts=2)
    manager = runner.eplb_manager
    res = {"tokens_before": harness.greedy_generate(runner, PROMPTS, 4)}
    res["imbalance_before"], res["counts_before"] = measured_imbalance(manager, SKEWED, runner)
    result = manager.rebalance()
    res["rebalance"] = (result.success, result.message, result.imbalance_before, result.imbalance_after_expected)
    res["placement"] = [layer.physical_to_logical_map.tolist() for layer in manager.layers]
    res["imbalance_after"], res["counts_after"] = measured_imbalance(manager, SKEWED, runner)
    res["tokens_after"] = harness.greedy_generate(runner, PROMPTS, 4)
    ok, message = runner.update_weights_from_disk(new_path)
    res["update"] = (ok, message)
    seqs = harness.new_seqs(runner, len(PROMPTS))
    res["logits_new"] = harness.extend(runner, seqs, PROMPTS).next_token_logits.clone()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    from shardline_runtime.distributed import destroy_distributed_environment

    destroy_distributed_environment()
