"""Weights that arrive while serving without a checkpoint on disk, and reading them back.

After SGLang's ``ModelRunner.update_weights_from_tensor`` / ``update_weights_from_distributed``
/ ``get_weights_by_name``, with Shardline's all-or-nothing rule (DESIGN 2.4):

1. **Check** every declared ``(name, dtype, shape)`` against the running model before any live
   weight changes: the name must be a checkpoint tensor of this architecture
   (``checkpoint_shapes``, read from the built model), the shape its full (unsharded) checkpoint shape, the dtype the
   model's dtype. The first problem is named.
2. **Receive** every tensor into a staging buffer (full tensors of this call; the caller bounds
   the extra memory by sending buckets). A distributed update still drains the broadcast after
   a failed check, so the trainer is never left blocked; a broken broadcast (dead trainer) ends
   within the group's timeout.
3. **Agree**: ``all_reduce_min`` of a success flag over every rank of every pipeline stage. Any failure on any rank
   leaves every rank on its old weights.
4. **Load** through each parameter's ``weight_loader``, so every rank cuts its own TP shard,
   copying into the existing storage (same addresses: captured graphs stay valid). A pipeline
   stage loads the tensors of its own layers (``stage_weights``) and skips the others.

Names are checkpoint (HuggingFace) names, as a trainer's ``model.named_parameters()`` gives them:
``model.layers.0.self_attn.q_proj.weight``, not the fused ``qkv_proj``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch

from shardline_runtime.distributed import all_gather_pyobj_world, all_reduce_min_int
from shardline_runtime.layers.parameter import weight_loader_of
from shardline_runtime.model_executor.kv_cache_dtype import (
    is_kv_scale_name,
    scales_of_named,
    update_kv_scales,
)
from shardline_runtime.model_executor.weight_staging import WeightUpdateError
from shardline_runtime.models.llama import LlamaForCausalLM
from shardline_runtime.models.weight_loading import full_checkpoint_shapes

logger = logging.getLogger(__name__)

MAX_TRUNCATE_SIZE = 1 << 16
MAX_RETURNED_ELEMENTS = 1 << 20  # about 20 MB of JSON


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16`` (floating dtypes only).

    Raises:
        WeightUpdateError: not a floating-point torch dtype.
    """
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise WeightUpdateError(
            f"dtype {name!r} is not a floating-point torch dtype (e.g. 'bfloat16', 'float32')"
        )
    return dtype


def _resolve(model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter], name: str):
    """Checkpoint ``name`` -> (parameter, extra ``weight_loader`` arguments); None for names the
    loader skips. The same mapping as ``models/weight_loading.py: load_named_weights``: MoE expert
    tensors first (``(expert_id, shard_id)``), then fused q/k/v and gate/up (``shard_id``)."""
    if any(name.endswith(i) for i in model.ignored_checkpoint_names()):
        return None
    target = name
    args: tuple = ()
    for fragment, fused, expert_id, sid in model.expert_params_mapping():
        if fragment in name:
            target, args = name.replace(fragment, fused), (expert_id, sid)
            break
    else:
        for fragment, stacked, stacked_id in model.stacked_params_mapping:
            if fragment in name:
                target, args = name.replace(fragment, stacked), (stacked_id,)
                break
    if target not in params:
        raise WeightUpdateError(f"parameter {name}: no such parameter in the serving model")
    return params[target], args


def check_specs(
    model: LlamaForCausalLM,
    dtype: torch.dtype,
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
) -> None:
    """Check declared ``(name, dtype, full shape)`` triples against the running model.

    Raises:
        WeightUpdateError: naming the first unknown or repeated parameter, wrong shape or dtype.
    """
    shapes = full_checkpoint_shapes(model)
    ignored = model.ignored_checkpoint_names()
    seen: set[str] = set()
    for name, got_dtype, shape in specs:
        if name in seen:
            raise WeightUpdateError(f"parameter {name} is given twice")
        seen.add(name)
        want = shapes.get(name)
        if want is None and not any(name.endswith(i) for i in ignored):
            raise WeightUpdateError(f"parameter {name}: no such parameter in the serving model")
        if want is not None and tuple(shape) != tuple(want):
            raise WeightUpdateError(
                f"parameter {name}: shape {tuple(shape)} given, the serving model has {tuple(want)}"
            )
        if got_dtype != dtype and not is_kv_scale_name(name):  # scales: any float dtype
            raise WeightUpdateError(
                f"parameter {name}: dtype {got_dtype} given, the serving model uses {dtype}"
            )


def checked_kv_scales(named: list[tuple[str, torch.Tensor]]) -> dict[int, dict[str, float]]:
    """The KV scales (``*.k_scale`` / ``*.v_scale``) among ``named``, checked before anything
    is loaded. Raises WeightUpdateError naming a scale that is not one positive finite value."""
    try:
        return scales_of_named(named)
    except ValueError as exc:
        raise WeightUpdateError(str(exc)) from None


@torch.no_grad()
def load_named_tensors(
    model: LlamaForCausalLM,
    named: Iterable[tuple[str, torch.Tensor]],
    kv_cache_dtype: torch.dtype | None = None,
) -> list[str]:
    """Load full tensors into their parameters through ``weight_loader`` (each rank its shard);
    KV scales (``*.k_scale`` / ``*.v_scale``, checked by :func:`checked_kv_scales`) go to this
    stage's attention layers when the cache (``kv_cache_dtype``) is fp8.

    Unlike a checkpoint load, a subset of the parameters is fine. Returns the names loaded.
    """
    params = dict(model.named_parameters())
    loaded = []
    scales = []
    for name, tensor in model.stage_weights(named):
        if is_kv_scale_name(name):
            scales.append((name, tensor))
            loaded.append(name)
            continue
        resolved = _resolve(model, params, name)
        if resolved is None:
            continue
        param, args = resolved
        weight_loader_of(param)(param, tensor, *args)
        loaded.append(name)
    if kv_cache_dtype is not None:
        update_kv_scales(model, scales_of_named(scales), kv_cache_dtype)
    if params and next(iter(params.values())).device.type == "cuda":
        torch.cuda.synchronize()
    return loaded


def _agree(reason: str, what: str) -> tuple[bool, str]:
    ok = all_reduce_min_int(0 if reason else 1) == 1
    if ok:
        return True, ""
    return (
        False,
        f"{what} failed; old weights kept. {reason or 'rejected on another tensor-parallel rank or pipeline stage (see its log)'}",
    )


def update_weights_from_safetensors(model_runner: Any, data: bytes) -> tuple[bool, str, list[str]]:
    """All-or-nothing load of the full tensors in ``data`` (the bytes of a safetensors file,
    checkpoint names) on every TP rank (each rank calls it with the same bytes).

    Returns:
        ``(success, message, names loaded)``; on failure no live weight changed on any rank.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    reason = ""
    named: list[tuple[str, torch.Tensor]] = []
    try:
        try:
            named = list(load(data).items())
        except (SafetensorError, ValueError, OSError) as exc:
            raise WeightUpdateError(
                f"serialized_named_tensors is not a valid safetensors file: {exc}"
            ) from None
        if not named:
            raise WeightUpdateError("serialized_named_tensors holds no tensor")
        check_specs(
            model_runner.model, model_runner.dtype, [(n, t.dtype, tuple(t.shape)) for n, t in named]
        )
        checked_kv_scales(named)
    except WeightUpdateError as exc:
        reason = str(exc)
    ok, message = _agree(reason, "update_weights_from_tensor")
    if not ok:
        return False, message, []
    loaded = load_named_tensors(model_runner.model, named, model_runner.kv_cache_dtype)
    return True, f"loaded {len(loaded)} tensors on tp rank {model_runner.tp_rank}", loaded


def _drainable(
    model: LlamaForCausalLM, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]
) -> bool:
    """Whether every declared shape can be received: no negative dimension, and no more
    elements than the largest checkpoint tensor (so draining a rejected update is bounded)."""
    largest = max((math.prod(s) for s in full_checkpoint_shapes(model).values()), default=0)
    return all(min(shape, default=0) >= 0 and math.prod(shape) <= largest for _, _, shape in specs)


def update_weights_from_distributed(
    model_runner: Any,
    group: Any,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    refused: str = "",
) -> tuple[bool, str, list[str], bool]:
    """Receive ``names`` from the trainer (rank 0 of ``group``), one broadcast each, then load.

    Every TP rank calls it together; the trainer broadcasts the tensors in ``names`` order.
    With ``refused`` (why the update may not run, e.g. paused in place) the tensors are still
    received when the declared specs are valid, then discarded.

    Returns:
        ``(success, message, names loaded, group_broken)``; ``group_broken`` when a broadcast
        failed (the caller drops the group; the trainer must init a new one).
    """
    from shardline_runtime.distributed.weight_sync_group import WeightSyncGroupError, broadcast

    reason = refused
    specs = None
    try:
        if not len(names) == len(dtypes) == len(shapes):
            raise WeightUpdateError(
                f"names, dtypes and shapes must have the same length, got {len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        specs = [
            (n, parse_dtype(d), tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes)
        ]
        check_specs(model_runner.model, model_runner.dtype, specs)
    except WeightUpdateError as exc:
        reason = reason or str(exc)
    staged: list[tuple[str, torch.Tensor]] = []
    broken = False
    if specs is not None and not _drainable(model_runner.model, specs):
        # A negative or larger-than-any-parameter shape cannot be received (it would crash or
        # exhaust memory): refuse without receiving; the trainer's broadcast then times out.
        reason = reason or "shapes: a declared shape is negative or larger than any parameter"
        specs = None
    if specs is not None:  # drain the broadcast even after a failed check: the trainer sends anyway
        device = model_runner.device if group.backend == "nccl" else torch.device("cpu")
        try:
            for name, dtype, shape in specs:
                buf = torch.empty(shape, dtype=dtype, device=device)
                broadcast(group, buf)
                staged.append((name, buf))
        except WeightSyncGroupError as exc:
            broken = True
            reason = reason or f"after {len(staged)} of {len(specs)} tensors: {exc}"
    if not reason:
        try:
            checked_kv_scales(staged)
        except WeightUpdateError as exc:
            reason = str(exc)
    ok, message = _agree(reason, "update_weights_from_distributed")
    if not ok:
        return False, message, [], broken
    loaded = load_named_tensors(model_runner.model, staged, model_runner.kv_cache_dtype)
    return (
        True,
        f"received and loaded {len(loaded)} tensors on tp rank {model_runner.tp_rank}",
        loaded,
        False,
    )


@torch.no_grad()
def get_weights_by_name(model_runner: Any, name: str, truncate_size: int = 100) -> list:
    """The first ``truncate_size`` rows of checkpoint tensor ``name`` as the full (unsharded)
    tensor, gathered from every rank (each rank calls it; with pipeline parallelism the ranks of
    the stage that holds ``name`` contribute). Values as Python floats.

    Each rank finds which full-tensor elements its shard holds by running the parameter's own
    ``weight_loader`` on a tensor of element indices, so the inverse of every sharding layout
    (column, row, fused q/k/v, replicated KV heads, vocab padding) comes for free.

    Raises:
        WeightUpdateError: unknown ``name``, ``truncate_size`` outside [1, 65536], or more than
            2**20 values asked for.
    """
    if not 1 <= truncate_size <= MAX_TRUNCATE_SIZE:
        raise WeightUpdateError(
            f"truncate_size must be in [1, {MAX_TRUNCATE_SIZE}], got {truncate_size}"
        )
    model = model_runner.model
    shapes = full_checkpoint_shapes(model)
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        name = "model.embed_tokens.weight"  # tied: the head is the embedding
    if name not in shapes:
        raise WeightUpdateError(f"parameter {name}: no such parameter in the serving model")
    full_shape = shapes[name]
    held = [n for n, _ in model.stage_weights([(name, None)])]  # [] on a stage without it
    row = 1
    for size in full_shape[1:]:
        row *= size
    limit = min(truncate_size, full_shape[0]) * row
    if limit > MAX_RETURNED_ELEMENTS:
        raise WeightUpdateError(
            f"truncate_size {truncate_size} of {name} (rows of {row} values) would return {limit} values; "
            f"ask for at most {max(1, MAX_RETURNED_ELEMENTS // row)} rows"
        )
    positions, values = [], []
    resolved = _resolve(model, dict(model.named_parameters()), held[0]) if held else None
    if resolved is not None:
        param, args = resolved
        where = torch.zeros(param.shape, dtype=torch.int64)
        # the loader reads its layer's attributes (checkpoint shapes, shard layout) off the target
        vars(where).update(vars(param))
        index = torch.arange(1, row * full_shape[0] + 1, dtype=torch.int64).view(full_shape)
        weight_loader_of(param)(where, index, *args)
        mine = (where > 0) & (where <= limit)
        positions = (where[mine] - 1).tolist()
        values = param.data.detach().cpu().float()[mine].tolist()
    out = torch.zeros(limit, dtype=torch.float64)
    for pos, val in all_gather_pyobj_world((positions, values)):
        out[torch.tensor(pos, dtype=torch.int64)] = torch.tensor(val, dtype=torch.float64)
    return out.view((limit // row,) + tuple(full_shape[1:])).tolist()
