"""Write a random PEFT-format LoRA adapter for a checkpoint (demos and the cluster tests).

The files are what ``peft``'s ``save_pretrained`` writes for a LoRA on the seven projections:
``adapter_config.json`` and ``adapter_model.safetensors`` with
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``
(A: (r, in_features), B: (out_features, r)). Both A and B are random (PEFT starts B at zero),
so the adapter visibly changes the base model's answers.

Usage::

    python -m shardline_runtime.lora.tiny_adapter OUT_DIR --base CHECKPOINT_DIR [--rank 4] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def write_tiny_adapter(
    out_dir: str | Path, base: str | Path, rank: int = 4, seed: int = 1, scale: float = 0.5
) -> Path:
    """Write an adapter of rank ``rank`` for the dense decoder checkpoint at ``base`` (its
    ``config.json`` gives the shapes); values ~ N(0, scale / sqrt(fan_in)). Returns ``out_dir``."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(base) / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = (
        cfg["num_attention_heads"] * head_dim,
        cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim,
    )
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * (
                scale / fan_in**0.5
            )
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * (
                scale / rank**0.5
            )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(MODULES),
        "base_model_name_or_path": str(base),
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--base", required=True, help="checkpoint directory the adapter is for")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    print(write_tiny_adapter(args.out_dir, args.base, args.rank, args.seed))


if __name__ == "__main__":
    main()
