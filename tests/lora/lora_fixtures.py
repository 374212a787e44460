"""PEFT adapters on the tiny checkpoints, made with the real ``peft`` package."""

from __future__ import annotations

from pathlib import Path

import torch


def make_peft_adapter(base_path, out_dir, r: int = 4, alpha: int = 8, seed: int = 1,
                      target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                      use_rslora: bool = False) -> Path:
    """Save a LoRA of ``base_path`` with random (non-zero) A and B to ``out_dir``."""
    import peft
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), init_lora_weights=False,
                          use_rslora=use_rslora, lora_dropout=0.0)
    lora = peft.get_peft_model(model, cfg)
    with torch.no_grad():  # peft's random init makes B small; widen it so deltas are visible
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.mul_(4.0)
    lora.save_pretrained(str(out_dir))
    return Path(out_dir)


def peft_logits(base_path, adapter_path, prompt: list[int]) -> torch.Tensor:
    """Logits (len(prompt), vocab) of transformers + peft with the adapter applied."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    lora = peft.PeftModel.from_pretrained(model, str(adapter_path)).eval()
    with torch.no_grad():
        return lora(torch.tensor([prompt])).logits[0]
