"""ModelConfig parsing and field case L5: RoPE scaling variants match transformers; unknown
types fail at startup with a clear message; both config spellings are read."""

import json
import shutil

import pytest
import torch

import harness
from shardline_runtime.configs.model_config import ModelConfig, ModelConfigError, parse_rope_parameters

TOL = 1e-4
PROMPT = list(range(10, 34))  # 24 tokens: beyond max_position_embeddings=16 in the dynamic case

ROPE_CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn_missing_optional": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_with_betas": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                        "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.2},
}


def _compare_with_transformers(path, context_length=64):
    import transformers

    runner = harness.make_runner(path, context_length=context_length)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    seqs = harness.new_seqs(runner, 1)
    out = harness.extend(runner, seqs, [PROMPT])
    with torch.no_grad():
        first = ref(torch.tensor([PROMPT]), use_cache=True)
    full = first.logits[0]
    assert (out.next_token_logits[0] - full[-1]).abs().max() <= TOL
    nxt = int(full[-1].argmax())
    out = harness.decode(runner, seqs, [nxt])
    # decode against transformers' own KV-cached step (for ``dynamic`` the cached keys keep the
    # frequencies of the step that wrote them, in transformers as here)
    with torch.no_grad():
        expect = ref(torch.tensor([[nxt]]), cache=first.past_key_values, use_cache=True).logits[0, -1]
    assert (out.next_token_logits[0] - expect).abs().max() <= TOL


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_variant_logits_match_transformers(tiny_checkpoint, case):
    max_pos = 16 if case == "dynamic" else 128
    path = tiny_checkpoint("llama", rope_scaling=ROPE_CASES[case], max_position_embeddings=max_pos)
    _compare_with_transformers(path)


def test_legacy_rope_scaling_spelling(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama", seed=3)
    dst = tmp_path / "legacy"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
    cfg["rope_theta"] = 5000.0
    (dst / "config.json").write_text(json.dumps(cfg))
    mc = ModelConfig.from_pretrained(dst)
    assert mc.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    _compare_with_transformers(dst)


def test_transformers5_rope_parameters_spelling(tiny_checkpoint):
    path = tiny_checkpoint("llama", rope_scaling=ROPE_CASES["llama3"], max_position_embeddings=128)
    cfg = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in cfg
    mc = ModelConfig.from_pretrained(path)
    assert mc.rope_parameters["rope_type"] == "llama3"
    assert mc.rope_parameters["original_max_position_embeddings"] == 64


@pytest.mark.parametrize("raw", [
    {"rope_scaling": {"type": "longrope", "short_factor": [1.0]}},
    {"rope_parameters": {"rope_type": "su"}},
])
def test_unknown_rope_type_fails_with_supported_list(raw):
    with pytest.raises(ModelConfigError, match=r"unsupported RoPE type .*supported types: default, linear, dynamic, llama3, yarn"):
        parse_rope_parameters(raw)


def test_unknown_rope_type_fails_at_startup_before_loading(tiny_checkpoint, tmp_path):
    dst = tmp_path / "bad_rope"
    dst.mkdir()
    cfg = json.loads((tiny_checkpoint("llama") / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "ntk-by-parts", "rope_theta": 10000.0}
    (dst / "config.json").write_text(json.dumps(cfg))  # no weights at all: must fail on the config
    with pytest.raises(ModelConfigError, match="ntk-by-parts"):
        harness.make_runner(dst)


def test_rope_type_missing_required_key():
    with pytest.raises(ModelConfigError, match=r"'llama3' needs \['low_freq_factor', 'high_freq_factor'\]"):
        parse_rope_parameters({"max_position_embeddings": 64, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_default_means_no_scaling_and_yarn_defaults_original_positions():
    assert parse_rope_parameters({"rope_theta": 500.0}) == {"rope_type": "default", "rope_theta": 500.0}
    p = parse_rope_parameters({"max_position_embeddings": 77, "rope_scaling": {"type": "yarn", "factor": 2.0}})
    assert p["original_max_position_embeddings"] == 77 and p["rope_type"] == "yarn"


def test_dtype_auto_and_explicit(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    assert ModelConfig.from_pretrained(path).dtype == torch.float32
    assert ModelConfig.from_pretrained(path, dtype="bfloat16").dtype == torch.bfloat16
    cfg = json.loads((path / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    assert ModelConfig.from_dict(cfg, device_type="cuda").dtype == torch.bfloat16
    assert ModelConfig.from_dict(cfg, device_type="cpu").dtype == torch.float32
    cfg.pop("dtype")
    cfg["torch_dtype"] = "float16"
    assert ModelConfig.from_dict(cfg, device_type="cuda").dtype == torch.float16
    with pytest.raises(ModelConfigError, match=r"dtype must be one of \('auto', 'float32'"):
        ModelConfig.from_pretrained(path, dtype="fp8")


def test_unsupported_architecture_is_named(tiny_checkpoint):
    cfg = json.loads((tiny_checkpoint("llama") / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        ModelConfig.from_dict(cfg)


def test_layers_share_one_rotary_table(tiny_checkpoint):
    from shardline_runtime.model_executor.model_runner import ModelRunner
    from shardline_runtime.server_args import ServerArgs

    runner = ModelRunner(ServerArgs(model_path=str(tiny_checkpoint("llama", num_hidden_layers=3)), device="cpu",
                                    max_total_tokens=64, max_running_requests=2))
    ropes = [layer.self_attn.rotary_emb for layer in runner.model.model.layers]
    assert len(ropes) == 3 and all(r is ropes[0] for r in ropes)
    tables = {b.data_ptr() for name, b in runner.model.named_buffers() if name.endswith("cos_cached")}
    assert len(tables) == 1  # one cos table in the whole model
