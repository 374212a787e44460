"""Tiny EAGLE head checkpoints for a tiny llama target, in the public format the runtime loads
(``models/llama_eagle.py``): ``config.json`` is the target's with ``architectures:
["LlamaForCausalLMEagle"]`` and ``num_hidden_layers: 1``; ``model.safetensors`` holds
``fc.weight`` (hidden, 2 * hidden), ``fc.bias`` (hidden) and ``layers.0.*`` (a Llama block
without ``input_layernorm``). Used by the speculative-decoding tests and ``bench/speculative.py``.
"""

from __future__ import annotations

import json
from pathlib import Path


def eagle_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor of a one-layer EAGLE head of ``config``
    (a llama ``config.json`` dict)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    layer = "layers.0."
    return {
        "fc.weight": (h, 2 * h),
        "fc.bias": (h,),
        layer + "self_attn.q_proj.weight": (heads * head_dim, h),
        layer + "self_attn.k_proj.weight": (kv_heads * head_dim, h),
        layer + "self_attn.v_proj.weight": (kv_heads * head_dim, h),
        layer + "self_attn.o_proj.weight": (h, heads * head_dim),
        layer + "mlp.gate_proj.weight": (inter, h),
        layer + "mlp.up_proj.weight": (inter, h),
        layer + "mlp.down_proj.weight": (h, inter),
        layer + "post_attention_layernorm.weight": (h,),
    }


def write_eagle_checkpoint(target: str | Path, dst: str | Path, weights: dict) -> Path:
    """Write ``weights`` (name -> float32 tensor, :func:`eagle_tensor_shapes`' names) as an
    EAGLE head of the llama checkpoint ``target`` into ``dst``; files readable by all users."""
    from safetensors.torch import save_file

    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(target) / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.contiguous() for k, v in weights.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for written in out.iterdir():
        written.chmod(written.stat().st_mode | 0o444)
    return out


def random_eagle_weights(target: str | Path, seed: int = 0, std: float = 0.1) -> dict:
    """A head of Gaussian weights (``std``), norms at 1, for ``target``'s config."""
    import torch

    config = json.loads((Path(target) / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in eagle_tensor_shapes(config).items():
        if name.endswith("layernorm.weight"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = std * torch.randn(shape, generator=gen)
    return weights


def make_eagle_checkpoint(target: str | Path, dst: str | Path, seed: int = 0) -> Path:
    """A randomly initialised EAGLE head of ``target`` (drafts rarely right)."""
    return write_eagle_checkpoint(target, dst, random_eagle_weights(target, seed))


def make_cycle_eagle_checkpoint(
    target: str | Path,
    dst: str | Path,
    cycle: list[int],
    read: str = "features",
    wrong_after: int | None = None,
) -> Path:
    """An EAGLE head of a ``make_cycle_checkpoint`` target that predicts the cycle's next
    feature, so its drafts continue the cycle as the target's argmax does.

    The cycle target's feature after ``cycle[j]`` is ``sqrt(hidden) * e_j`` (e_j a basis
    vector) and its embedding of ``cycle[j]`` is ``e_j``. The head's attention and MLP outputs
    are zeroed, so its predicted feature is ``fc``'s output: with ``read="features"`` a
    permutation of the input feature (``e_j -> e_{j+1}``, exercising the target's states and
    the chain's own predicted ones), with ``read="embedding"`` ``sqrt(hidden)`` times the input
    token's embedding. ``wrong_after=j``: after ``cycle[j]`` the head predicts ``cycle[j + 2]``
    (drafts there are rejected).

    Raises:
        ValueError: ``read`` is neither, or the cycle is longer than the hidden size.
    """
    import torch

    if read not in ("features", "embedding"):
        raise ValueError(f"read must be 'features' or 'embedding', got {read!r}")
    weights = random_eagle_weights(target)
    hidden = weights["fc.bias"].shape[0]
    if len(cycle) > hidden:
        raise ValueError(f"cycle of {len(cycle)} tokens exceeds hidden size {hidden}")
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight", "fc.bias"):
        weights[name].zero_()
    fc = torch.zeros(hidden, 2 * hidden)
    n = len(cycle)
    for j in range(n):
        if read == "features":  # the feature after cycle[j] predicts cycle[j + 1]'s
            step = 2 if j == wrong_after else 1
            fc[(j + step) % n, hidden + j] = 1.0
        else:  # the input token is cycle[j + 1]; its feature is sqrt(hidden) e_{j+1}
            fc[j, j] = hidden**0.5
    weights["fc.weight"] = fc
    return write_eagle_checkpoint(target, dst, weights)
