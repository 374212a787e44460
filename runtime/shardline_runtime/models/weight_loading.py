"""Checkpoint tensors -> model parameters, checking every parameter is written exactly once.

Stacked parameters (``qkv_proj``, ``gate_up_proj``) count as written when each of their shards
(q, k, v / 0, 1) was loaded once.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardline_runtime.layers.linear import ShardShapeError
from shardline_runtime.layers.parameter import (
    checkpoint_shapes_of,
    loadable_dtype_problem,
    weight_loader_of,
)
from shardline_runtime.model_loader.errors import CheckpointError

if TYPE_CHECKING:
    from shardline_runtime.models.llama import LlamaForCausalLM


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params_mapping: Iterable[tuple[str, str, object]],
    ignored: Iterable[str] = (),
    expert_params_mapping: Iterable[tuple[str, str, int, str]] = (),
) -> None:
    """Copy ``weights`` (checkpoint name, full tensor) into ``model`` via each ``weight_loader``.

    ``expert_params_mapping`` rows ``(checkpoint fragment, parameter fragment, expert_id,
    shard_id)`` (e.g. ``(".experts.3.gate_proj.", ".experts.w13_", 3, "w1")``) are tried before
    the stacked mapping and call ``weight_loader(param, tensor, expert_id, shard_id)``.

    Raises:
        CheckpointError: a name matches no parameter, a (parameter, shard) is written twice, a
            shape is wrong, or a parameter is never written; the message names it.
    """
    params = dict(model.named_parameters(remove_duplicate=True))
    ignored = tuple(ignored)
    expert_params_mapping = tuple(expert_params_mapping)
    expected: dict[str, set] = {name: {None} for name in params}
    for name in params:
        for _, stacked, _ in stacked_params_mapping:
            if stacked in name:
                expected[name] = {s for _, st, s in stacked_params_mapping if st == stacked}
        for _, fused, _, _ in expert_params_mapping:
            if fused in name:
                expected[name] = {(e, s) for _, f, e, s in expert_params_mapping if f == fused}
        if not checkpoint_shapes_of(params[name]):  # an online FP8 scale: the weight writes it
            expected[name] = set()
    written: dict[str, set] = {name: set() for name in params}
    for ckpt_name, tensor in weights:
        if any(ckpt_name.endswith(i) for i in ignored):
            continue
        target = ckpt_name
        shard_id: Any = None  # None, "q"/"k"/"v", an index, or (expert_id, "w1"|"w2"|"w3")
        for fragment, fused, expert_id, sid in expert_params_mapping:
            if fragment in ckpt_name:
                target, shard_id = ckpt_name.replace(fragment, fused), (expert_id, sid)
                break
        else:
            for fragment, stacked, stacked_id in stacked_params_mapping:
                if fragment in ckpt_name:
                    target, shard_id = ckpt_name.replace(fragment, stacked), stacked_id
                    break
        if target not in params:
            raise CheckpointError(
                f"unexpected parameter {ckpt_name!r} in the checkpoint (no such parameter in {type(model).__name__})"
            )
        if shard_id in written[target]:
            raise CheckpointError(
                f"parameter {ckpt_name!r} is written twice (it appears in more than one shard)"
            )
        param = params[target]
        problem = loadable_dtype_problem(param, tensor.dtype)
        if problem is not None:
            raise CheckpointError(f"parameter {ckpt_name!r} has {problem}")
        try:
            loader = weight_loader_of(param)
            if shard_id is None:
                loader(param, tensor)
            elif isinstance(shard_id, tuple):
                loader(param, tensor, *shard_id)
            else:
                loader(param, tensor, shard_id)
        except ShardShapeError as e:
            raise CheckpointError(f"parameter {ckpt_name!r}: {e}") from None
        written[target].add(shard_id)
    for name in params:
        missing = expected[name] - written[name]
        if missing:
            what = name if missing == {None} else f"{name} (shards {sorted(map(str, missing))})"
            raise CheckpointError(f"parameter {what} was never written: the checkpoint lacks it")


def checkpoint_shapes(model: LlamaForCausalLM) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> full shape of every tensor (see :func:`checkpoint_tensors`)."""
    return {name: shape for name, (shape, _) in checkpoint_tensors(model).items()}


def checkpoint_tensors(model: LlamaForCausalLM) -> dict[str, tuple[tuple[int, ...], nn.Parameter]]:
    """Checkpoint name -> (full (unsharded) shape, the parameter it loads into) of every tensor a
    checkpoint of ``model`` holds, read from the built module: each parameter's ``checkpoint_shapes`` (declared by its layer
    next to its ``weight_loader``: shard id -> full shape), named back through the model's
    ``expert_params_mapping`` / ``stacked_params_mapping`` and ``to_checkpoint_name``. A tied
    LM head is the embedding parameter, so it is listed once, as the embedding.

    Raises:
        AttributeError: a parameter whose layer declares no ``checkpoint_shapes``.
    """
    stacked = tuple(model.stacked_params_mapping)
    experts = tuple(model.expert_params_mapping())
    shapes: dict[str, tuple[tuple[int, ...], nn.Parameter]] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        for shard_id, shape in checkpoint_shapes_of(param).items():
            if shard_id is None:
                ckpt = name
            elif isinstance(shard_id, tuple):
                ckpt = next(
                    name.replace(fused, fragment)
                    for fragment, fused, e, s in experts
                    if fused in name and (e, s) == shard_id
                )
            else:
                ckpt = next(
                    name.replace(st, fragment)
                    for fragment, st, s in stacked
                    if st in name and s == shard_id
                )
            shapes[model.to_checkpoint_name(ckpt)] = (tuple(shape), param)
    return shapes


_FULL_SHAPES: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[int, ...]]] = (
    weakref.WeakKeyDictionary()
)


def full_checkpoint_shapes(model: LlamaForCausalLM) -> dict[str, tuple[int, ...]]:
    """:func:`checkpoint_shapes` of the whole model, also when ``model`` is one pipeline stage.

    A stage builds only its own layers (and embedding / norm / LM head), but a checkpoint, a
    trainer's tensors and ``get_weights_by_name`` name every tensor of the model; the full set
    comes from the same class built with the same config on the ``meta`` device (no memory),
    once per model instance.
    """
    stage = getattr(model, "stage", None)
    if stage is None or (stage.is_first and stage.is_last):
        return checkpoint_shapes(model)
    cached = _FULL_SHAPES.get(model)
    if cached is None:
        with torch.device("meta"):
            whole = type(model)(model.config)
        cached = _FULL_SHAPES[model] = checkpoint_shapes(whole)
    return cached
