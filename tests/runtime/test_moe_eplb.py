"""EPLB over two gloo ranks (expert parallel 2, two redundant slots): after a rebalance on a
skewed workload the greedy outputs are unchanged and the measured per-rank load imbalance
(max / mean tokens per rank) drops; an in-place weight update afterwards fills the re-placed
slots (logits equal transformers on the new checkpoint). The placement algorithm itself is
checked on hand-made loads."""

import pytest
import torch
import torch.multiprocessing as mp

import harness
import moe_worker
from shardline_runtime.layers.moe.eplb_algorithm import (
    balanced_packing, expected_physical_counts, rank_imbalance, rebalance_experts, replicate_experts,
)


def test_replicas_go_to_the_hottest_experts():
    phy2log, count = replicate_experts(torch.tensor([[100.0, 10.0, 1.0, 1.0]]), 6)
    assert phy2log.tolist() == [[0, 1, 2, 3, 0, 0]]
    assert count.tolist() == [[3, 1, 1, 1]]


def test_packing_fills_every_rank_evenly():
    pack = balanced_packing(torch.tensor([[9.0, 8.0, 2.0, 1.0]]), 2)
    assert sorted(pack[0].tolist()) == [0, 0, 1, 1]
    assert pack[0, 0] != pack[0, 1]  # the two heaviest are split


def test_rebalance_lowers_expected_imbalance_of_a_skewed_load():
    load = torch.tensor([[500.0, 300.0, 20.0, 10.0, 10.0, 5.0, 5.0, 1.0]])
    default = torch.arange(10).unsqueeze(0) % 8
    placement = rebalance_experts(load, 10, 2)
    assert sorted(set(placement[0].tolist())) == list(range(8))
    before = rank_imbalance(expected_physical_counts(load, default), 2)
    after = rank_imbalance(expected_physical_counts(load, placement), 2)
    assert after < before
    assert after == pytest.approx(1.0, abs=0.05)


@pytest.fixture(scope="module")
def eplb_ranks(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("eplb")
    path, new_path = tiny_checkpoint("qwen3_moe"), tiny_checkpoint("qwen3_moe", seed=1)
    ctx = mp.spawn(moe_worker.eplb_worker, args=(harness.free_port(), str(path), str(new_path), str(out)),
                   nprocs=2, join=False)
    for p in ctx.processes:
        p.join(300)
    codes = [p.exitcode for p in ctx.processes]
    for p in ctx.processes:
        if p.exitcode is None:  # hung: do not leave it running
            p.kill()
            p.join()
    assert codes == [0, 0], codes
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
def test_rebalance_keeps_greedy_outputs(eplb_ranks):
    for rank in eplb_ranks:
        assert rank["rebalance"][0], rank["rebalance"][1]
        assert rank["tokens_after"] == rank["tokens_before"]


@pytest.mark.slow
def test_rebalance_lowers_measured_imbalance(eplb_ranks):
    rank0 = eplb_ranks[0]
    print(f"measured imbalance (max/mean tokens per EP rank): before {rank0['imbalance_before']:.3f}, "
          f"after {rank0['imbalance_after']:.3f}; expected after {rank0['rebalance'][3]:.3f}")
    assert rank0["imbalance_after"] < rank0["imbalance_before"]
    assert eplb_ranks[1]["placement"] == rank0["placement"]


@pytest.mark.slow
def test_weight_update_after_rebalance_fills_replaced_slots(eplb_ranks, tiny_checkpoint):
    from test_moe_models import ref_logits, reference

    ref = reference(tiny_checkpoint("qwen3_moe", seed=1))
    for rank in eplb_ranks:
        assert rank["update"][0], rank["update"][1]
        for i, prompt in enumerate(moe_worker.PROMPTS):
            assert (rank["logits_new"][i] - ref_logits(ref, prompt)[-1]).abs().max() <= 1e-4
