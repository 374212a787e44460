"""Mixture-of-experts fields of ``config.json``, read into :class:`ModelConfig`.

Each MoE model class names its spelling in its ``moe_fields`` (``models/``); the supported
architectures spell the same things differently:

| field (ours)                   | Qwen3-MoE / Qwen2-MoE              | Mixtral                      |
|--------------------------------|------------------------------------|------------------------------|
| ``num_experts``                | ``num_experts`` (or ``num_local_experts``) | ``num_local_experts``        |
| ``num_experts_per_tok``        | ``num_experts_per_tok``            | ``num_experts_per_tok``      |
| ``moe_intermediate_size``      | ``moe_intermediate_size``          | ``intermediate_size``        |
| ``norm_topk_prob``             | ``norm_topk_prob`` (default False) | always True (transformers)   |
| ``shared_expert_intermediate_size`` | Qwen2-MoE only                | 0                            |
| ``moe_layers`` (per layer)     | not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` | every layer |
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def qwen_moe_fields(cfg: dict, layers: int, shared_expert: bool) -> dict[str, Any]:
    """Qwen3-MoE / Qwen2-MoE spelling (``shared_expert``: Qwen2-MoE's shared expert)."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_dense = set(cfg.get("mlp_only_layers") or [])
    return dict(
        num_experts=cfg.get("num_experts") or cfg.get("num_local_experts"),  # transformers 5
        num_experts_per_tok=cfg.get("num_experts_per_tok"),
        moe_intermediate_size=cfg.get("moe_intermediate_size"),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=(
            int(cfg.get("shared_expert_intermediate_size") or 0) if shared_expert else 0
        ),
        moe_layers=tuple(i not in only_dense and (i + 1) % step == 0 for i in range(layers)),
    )


def mixtral_moe_fields(cfg: dict, layers: int) -> dict[str, Any]:
    """Mixtral spelling: every layer sparse, weights always renormalised."""
    return dict(
        num_experts=cfg.get("num_local_experts"),
        num_experts_per_tok=cfg.get("num_experts_per_tok"),
        moe_intermediate_size=cfg.get("intermediate_size"),
        norm_topk_prob=True,
        shared_expert_intermediate_size=0,
        moe_layers=(True,) * layers,
    )


def checked_moe_fields(fields: dict[str, Any], arch: str, path: Path) -> dict[str, Any]:
    """The MoE keyword arguments of ``ModelConfig`` from a model class's ``moe_fields`` (empty
    for dense models), with the counts checked and made ints.

    Raises:
        ValueError: ``num_experts_per_tok`` outside ``[1, num_experts]`` or a missing expert
            count (the caller wraps it into ``ModelConfigError``).
    """
    if not fields:
        return {}
    experts, inter = fields["num_experts"], fields["moe_intermediate_size"]
    if not experts or int(experts) < 1 or not inter:
        raise ValueError(
            f"{path}: a {arch} config needs a positive expert count and expert intermediate size"
        )
    top_k = int(fields["num_experts_per_tok"] or 0)
    if not 1 <= top_k <= int(experts):
        raise ValueError(f"{path}: num_experts_per_tok must be in [1, {experts}], got {top_k}")
    return {
        **fields,
        "num_experts": int(experts),
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(inter),
    }


def moe_parallel_problem(
    num_experts: int,
    moe_intermediate_size: int,
    tp_size: int,
    ep_size: int,
    num_redundant_experts: int = 0,
) -> str | None:
    """Why ``(tp_size, ep_size)`` cannot split these experts, or None.

    Experts are split over ``ep_size`` ranks; each expert's intermediate dimension over the
    ``tp_size / ep_size`` ranks of its expert-parallel slot (SGLang's ``moe_tp_size``).
    """
    if ep_size < 1 or tp_size % ep_size:
        return f"ep_size {ep_size} must divide tp_size {tp_size}"
    if num_redundant_experts < 0:
        return f"ep_num_redundant_experts must be >= 0, got {num_redundant_experts}"
    physical = num_experts + num_redundant_experts
    if physical % ep_size:
        return (
            f"num_experts {num_experts} + ep_num_redundant_experts {num_redundant_experts} = {physical} "
            f"is not divisible by ep_size {ep_size}"
        )
    moe_tp = tp_size // ep_size
    if moe_intermediate_size % moe_tp:
        return f"expert intermediate size {moe_intermediate_size} is not divisible by tp_size / ep_size = {moe_tp}"
    return None
