"""MoE models split over two gloo processes give transformers' logits: tensor parallel (each
rank holds half of every expert's intermediate dimension), expert parallel (each rank holds
half of the experts) and expert parallel with redundant expert slots (replicas)."""

import pytest
import torch

import harness

PROMPTS = [[5, 17, 200, 33, 9, 41, 77, 300], [12, 8, 101, 4, 60]]
STEPS = 3
TOL = 1e-4
LAYOUTS = {"tp2": {}, "ep2": {"ep_size": 2}, "ep2_redundant2": {"ep_size": 2, "ep_num_redundant_experts": 2}}
ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]
# redundant slots are exercised on one architecture
CASES = [(arch, layout) for arch in ARCHS for layout in LAYOUTS if layout != "ep2_redundant2" or arch == "qwen3_moe"]


@pytest.fixture(scope="module")
def results(tiny_checkpoint, tmp_path_factory):
    scenarios = [{"name": f"{arch}-{layout}", "path": str(tiny_checkpoint(arch)), "prompts": PROMPTS,
                  "steps": STEPS, "runner_kwargs": LAYOUTS[layout]} for arch, layout in CASES]
    return harness.run_tp(2, scenarios, tmp_path_factory.mktemp("moe2"))


def transformers_logits(path, prompt, generated):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for step in range(len(generated)):
            tokens = prompt + generated[:step]
            out.append(model(torch.tensor([tokens])).logits[0, -1])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch, layout", CASES)
def test_two_rank_moe_matches_transformers(results, tiny_checkpoint, arch, layout):
    name = f"{arch}-{layout}"
    rank0, rank1 = results[0][name], results[1][name]
    assert rank0["tokens"] == rank1["tokens"]
    for i, prompt in enumerate(PROMPTS):
        generated = [step[i] for step in rank0["tokens"]]
        expect = transformers_logits(tiny_checkpoint(arch), prompt, generated)
        for step, ref in enumerate(expect):
            for rank in (rank0, rank1):
                assert (rank["logits"][step][i] - ref).abs().max() <= TOL, f"{name} prompt {i} step {step}"
