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


# ---- EAGLE-3 (models/llama_eagle3.py) --------------------------------------------------------


def eagle3_tensor_shapes(config: dict, draft_vocab: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor of an EAGLE-3 head of ``config`` (a llama
    ``config.json`` dict) with a draft vocabulary of ``draft_vocab`` ids; ``d2t`` is int64 and
    ``t2d`` bool, the others float."""
    h, vocab = config["hidden_size"], config["vocab_size"]
    layer = {
        k.replace("layers.0.", "midlayer."): v
        for k, v in eagle_tensor_shapes(config).items()
        if k.startswith("layers.0.")
    }
    for proj in ("q", "k", "v"):  # attention reads [norm(embedding), norm(feature)]
        name = f"midlayer.self_attn.{proj}_proj.weight"
        layer[name] = (layer[name][0], 2 * h)
    return {
        "fc.weight": (h, 3 * h),
        **layer,
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (draft_vocab, h),
        "d2t": (draft_vocab,),
        "t2d": (vocab,),
    }


def hot_token_ids(vocab: int, draft_vocab: int, first: list[int]) -> list[int]:
    """``draft_vocab`` target ids, ascending: ``first`` and then the largest others (so draft
    and target ids differ: ``d2t`` is not zero)."""
    rest = [t for t in range(vocab) if t not in set(first)]
    return sorted(first + rest[len(rest) - (draft_vocab - len(first)) :])


def write_eagle3_checkpoint(
    target: str | Path,
    dst: str | Path,
    weights: dict,
    hot_ids: list[int],
    layer_ids: list[int] | None,
    drop: tuple[str, ...] = (),
) -> Path:
    """Write ``weights`` (:func:`eagle3_tensor_shapes`' float names) as an EAGLE-3 head of the
    llama checkpoint ``target`` into ``dst``, its draft vocabulary the target ids ``hot_ids``
    (ascending; ``d2t`` and ``t2d`` are made from them), ``layer_ids`` as
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` (None: not set). ``drop``: tensor names
    left out (to make a broken head)."""
    import torch

    config = json.loads((Path(target) / "config.json").read_text())
    config.update(
        architectures=["LlamaForCausalLMEagle3"],
        num_hidden_layers=1,
        draft_vocab_size=len(hot_ids),
        tie_word_embeddings=False,
    )
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids}
    hot = torch.tensor(hot_ids, dtype=torch.int64)
    t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
    t2d[hot] = True
    tensors = {**weights, "d2t": hot - torch.arange(len(hot_ids)), "t2d": t2d}
    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _save(out, {k: v for k, v in tensors.items() if k not in drop})
    return out


def _save(out: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    for written in out.iterdir():
        written.chmod(written.stat().st_mode | 0o444)


def make_eagle3_checkpoint(
    target: str | Path,
    dst: str | Path,
    seed: int = 0,
    draft_vocab: int = 64,
    layer_ids: list[int] | None = None,
    std: float = 0.1,
    drop: tuple[str, ...] = (),
) -> Path:
    """A randomly initialised EAGLE-3 head of ``target`` (Gaussian weights of ``std``, norms
    at 1) over ``draft_vocab`` target ids (drafts rarely right)."""
    import torch

    config = json.loads((Path(target) / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in eagle3_tensor_shapes(config, draft_vocab).items():
        if name in ("d2t", "t2d"):
            continue
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = std * torch.randn(shape, generator=gen)
    perm = torch.randperm(config["vocab_size"], generator=gen)[:draft_vocab]
    hot = sorted(perm.tolist())
    return write_eagle3_checkpoint(target, dst, weights, hot, layer_ids, drop)


def make_cycle_eagle3_checkpoint(
    target: str | Path,
    dst: str | Path,
    cycle: list[int],
    layer_ids: list[int] | None = None,
    wrong_after: int | None = None,
    draft_vocab: int = 64,
) -> Path:
    """An EAGLE-3 head of a ``make_cycle_checkpoint`` target whose chains continue the cycle.

    Every layer of the cycle target passes its input through (attention and MLP outputs zeroed),
    so each aux state after ``cycle[j]`` is the embedding ``e_j`` (a basis vector). The head:
    ``fc`` averages the three aux states (``e_j``); attention output zeroed; the MLP maps the
    normed state ``sqrt(hidden) e_k`` to ``e_{k+1} - e_k``, so ``f_hat = e_{k+1}`` (one cycle
    step per head pass, also when the chain feeds ``f_hat`` back without ``fc``); ``lm_head``
    reads state ``e_k`` as the draft id of ``cycle[k + 1]``. The draft vocabulary holds the
    cycle and the largest other ids. ``wrong_after=j``: after ``cycle[j]`` the head drafts
    ``cycle[j + 2]`` (drafts there are rejected).

    Raises:
        ValueError: the cycle is longer than the hidden size or the draft vocabulary, or the
            target's intermediate size is smaller than the cycle.
    """
    import torch

    config = json.loads((Path(target) / "config.json").read_text())
    h, inter, n = config["hidden_size"], config["intermediate_size"], len(cycle)
    if n > min(h, draft_vocab, inter):
        raise ValueError(
            f"cycle of {n} tokens exceeds hidden size {h}, draft vocabulary {draft_vocab} or "
            f"intermediate size {inter}"
        )
    shapes = eagle3_tensor_shapes(config, draft_vocab)
    weights = {k: torch.zeros(v) for k, v in shapes.items() if k not in ("d2t", "t2d")}
    for name in weights:
        if name.endswith("norm.weight"):
            weights[name].fill_(1.0)
    for block in range(3):  # fc: the mean of the three aux states
        weights["fc.weight"][:, block * h : (block + 1) * h] = torch.eye(h) / 3
    gate = 20.0  # silu(gate * sqrt(h) * 1) ~ gate * sqrt(h): the active unit passes
    active = torch.nn.functional.silu(torch.tensor(gate * h**0.5))
    hot = hot_token_ids(config["vocab_size"], draft_vocab, list(cycle))
    draft_id = {t: i for i, t in enumerate(hot)}
    for k in range(n):
        weights["midlayer.mlp.gate_proj.weight"][k, k] = gate
        weights["midlayer.mlp.up_proj.weight"][k, k] = h**-0.5
        down = weights["midlayer.mlp.down_proj.weight"]
        down[(k + 1) % n, k] += 1 / active
        down[k, k] -= 1 / active
        step = 2 if k == wrong_after else 1
        weights["lm_head.weight"][draft_id[cycle[(k + step) % n]], k] = 1.0
    return write_eagle3_checkpoint(target, dst, weights, hot, layer_ids)
