"""Mixture-of-experts models at TP 1: logits equal transformers' for Qwen3-MoE, Qwen2-MoE
(shared expert) and Mixtral through extend, cached-prefix extend and decode; config variants
(renormalised top-k, dense layers between sparse ones); the router and the grouped expert
computation against plain formulas; bad expert layouts refused before loading."""

import json

import pytest
import torch

import harness
from shardline_runtime.configs.model_config import ModelConfig, ModelConfigError

MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]
TOL = 1e-4
PROMPT = [5, 17, 200, 33, 9, 41, 77, 300, 12, 8, 101]


def reference(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def ref_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]  # (T, vocab)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_extend_prefix_and_decode_match_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    runner = harness.make_runner(path)
    ref = reference(path)
    seqs = harness.new_seqs(runner, 2)
    first = harness.extend(runner, seqs, [PROMPT[:6], PROMPT[:3]])
    second = harness.extend(runner, seqs, [PROMPT[6:], PROMPT[3:5]])
    assert (first.next_token_logits[0] - ref_logits(ref, PROMPT[:6])[-1]).abs().max() <= TOL
    assert (second.next_token_logits[0] - ref_logits(ref, PROMPT)[-1]).abs().max() <= TOL
    assert (second.next_token_logits[1] - ref_logits(ref, PROMPT[:5])[-1]).abs().max() <= TOL
    out = harness.decode(runner, seqs, [42, 7])
    assert (out.next_token_logits[0] - ref_logits(ref, PROMPT + [42])[-1]).abs().max() <= TOL
    assert (out.next_token_logits[1] - ref_logits(ref, PROMPT[:5] + [7])[-1]).abs().max() <= TOL


@pytest.mark.parametrize("arch, overrides", [
    ("qwen3_moe", {"norm_topk_prob": True, "num_experts_per_tok": 3}),
    ("qwen2_moe", {"num_hidden_layers": 3, "decoder_sparse_step": 2, "mlp_only_layers": [2]}),
])
def test_moe_config_variants_match_transformers(tiny_checkpoint, arch, overrides):
    path = tiny_checkpoint(arch, seed=3, **overrides)
    runner = harness.make_runner(path)
    out = harness.extend(runner, harness.new_seqs(runner, 1), [PROMPT])
    assert (out.next_token_logits[0] - ref_logits(reference(path), PROMPT)[-1]).abs().max() <= TOL


def test_sparse_step_and_dense_layers_are_read_from_config(tiny_checkpoint):
    path = tiny_checkpoint("qwen2_moe", seed=3, num_hidden_layers=3, decoder_sparse_step=2, mlp_only_layers=[2])
    config = ModelConfig.from_pretrained(path)
    assert config.moe_layers == (False, True, False)
    assert (config.num_experts, config.num_experts_per_tok, config.shared_expert_intermediate_size) == (8, 2, 48)


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_grouped_experts_equal_per_pair_formula(impl):
    from shardline_runtime.layers.moe import moe_compute

    if impl == "grouped_mm" and not moe_compute.HAS_GROUPED_MM:
        pytest.skip("torch._grouped_mm is not in this torch")
    forward = moe_compute.grouped_experts_forward if impl == "loop" else moe_compute.grouped_mm_experts_forward

    torch.manual_seed(0)
    x, w13, w2 = torch.randn(5, 8), torch.randn(3, 8, 8), torch.randn(3, 8, 4)
    ids = torch.tensor([[0, 2], [1, -1], [-1, -1], [2, 0], [2, 2]])  # expert 1 once, a token twice on 2
    weights = torch.rand(5, 2)
    expect = torch.zeros(5, 8)
    for t in range(5):
        for k in range(2):
            e = int(ids[t, k])
            if e >= 0:
                gate, up = (w13[e] @ x[t]).split(4)
                expect[t] += weights[t, k] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    assert torch.allclose(forward(x, w13, w2, weights, ids), expect, rtol=1e-5, atol=1e-5)
    assert forward(x, w13, w2, weights, torch.full((5, 2), -1)).abs().max() == 0  # nothing local


def test_router_renormalises_only_when_asked():
    from shardline_runtime.layers.moe.router import select_experts

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[0, 1]]
    assert torch.allclose(w[0], probs[:2])
    w, _ = select_experts(logits, 2, renormalize=True)
    assert torch.allclose(w.sum(), torch.tensor(1.0))


def test_impossible_expert_layout_refused_before_loading(tiny_checkpoint, tmp_path):
    cfg = json.loads((tiny_checkpoint("qwen3_moe") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # no weights: refusal must come first
    with pytest.raises(ModelConfigError, match=r"8 \+ ep_num_redundant_experts 1 = 9 is not divisible by ep_size 2"):
        harness.make_runner(tmp_path, tp_size=2, ep_size=2, ep_num_redundant_experts=1,
                            dist_init_addr="127.0.0.1:1")


def test_ep_size_that_does_not_divide_tp_size_is_refused_by_the_config(tiny_checkpoint):
    config = ModelConfig.from_pretrained(tiny_checkpoint("qwen3_moe"))
    with pytest.raises(ModelConfigError, match="ep_size 3 must divide tp_size 2"):
        config.check_ep_size(2, 3, 0)


def test_ep_size_that_does_not_divide_tp_size_is_refused_by_the_arguments(tiny_checkpoint):
    # the runner can no longer be asked for it: ServerArgs refuses it first, naming the flags
    from shardline_runtime.server_args import ServerArgs, ServerArgsError

    with pytest.raises(ServerArgsError, match=r"--ep-size \(3\) must divide --tp-size \(2\)"):
        ServerArgs(model_path=str(tiny_checkpoint("qwen3_moe")), tp_size=2, ep_size=3)


def test_dense_model_refuses_expert_parallelism(tiny_checkpoint):
    with pytest.raises(ModelConfigError, match="need a mixture-of-experts model"):
        harness.make_runner(tiny_checkpoint("llama"), ep_size=1, ep_num_redundant_experts=2)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_cuda_moe_with_graphs_matches_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    runner = harness.make_runner(path, device="cuda", disable_cuda_graph=False, cuda_graph_max_bs=8)
    assert runner.graphs.decode is not None
    ref = reference(path)
    seqs = harness.new_seqs(runner, 2)
    out = harness.extend(runner, seqs, [PROMPT, PROMPT[:4]])
    assert (out.next_token_logits[0].cpu() - ref_logits(ref, PROMPT)[-1]).abs().max() <= 1e-3
    out = harness.decode(runner, seqs, [42, 7])  # replays a captured graph with the Triton kernel
    assert (out.next_token_logits[0].cpu() - ref_logits(ref, PROMPT + [42])[-1]).abs().max() <= 1e-3
    assert (out.next_token_logits[1].cpu() - ref_logits(ref, PROMPT[:4] + [7])[-1]).abs().max() <= 1e-3
