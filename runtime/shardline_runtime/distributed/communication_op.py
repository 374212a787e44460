"""Collectives of the TP group (and, for agreement, of the whole world); each is a no-op on a
group of one rank.

Layers call these in their ``forward`` so communication stays visible where it happens. Sources
are given as group ranks; torch.distributed wants world ranks, so each call maps them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardline_runtime.distributed.parallel_state import get_tp_group, get_world_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP ranks (in place; returns ``x``)."""
    group = get_tp_group()
    if group.size == 1:
        return x
    dist.all_reduce(x, group=group.device_group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's ``x`` along ``dim`` in rank order: shape[dim] grows tp_size times."""
    group = get_tp_group()
    if group.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.device_group)
    return torch.cat(parts, dim=dim)


def broadcast_pyobj(obj: Any, src: int = 0) -> Any:
    """Send a picklable object from TP rank ``src`` to all ranks over the CPU (gloo) group.

    Every rank must call it; ranks other than ``src`` pass anything (ignored) and receive
    ``src``'s object.
    """
    group = get_tp_group()
    if group.size == 1:
        return obj
    box = [obj if group.rank == src else None]
    dist.broadcast_object_list(box, src=group.world_rank_of(src), group=group.cpu_group)
    return box[0]


def broadcast_pyobj_world(obj: Any) -> Any:
    """Send a picklable object from world rank 0 to every rank of every pipeline stage."""
    group = get_world_group()
    if group.size == 1:
        return obj
    box = [obj if group.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group.cpu_group)
    return box[0]


def all_gather_pyobj(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank (CPU group)."""
    group = get_tp_group()
    if group.size == 1:
        return [obj]
    out: list[Any] = [None] * group.size
    dist.all_gather_object(out, obj, group=group.cpu_group)
    return out


def all_gather_pyobj_world(obj: Any) -> list[Any]:
    """Every world rank's picklable ``obj`` (all stages, all TP ranks), in world rank order."""
    group = get_world_group()
    if group.size == 1:
        return [obj]
    out: list[Any] = [None] * group.size
    dist.all_gather_object(out, obj, group=group.cpu_group)
    return out


def all_reduce_min_int(value: int) -> int:
    """Minimum of an integer over every rank of the world: all TP ranks of all pipeline stages
    (CPU group), so an agreement (a weight update, a KV pool size) holds for the whole model."""
    group = get_world_group()
    if group.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return int(t.item())


def barrier() -> None:
    """Wait for every rank of the world (CPU group)."""
    group = get_world_group()
    if group.size > 1:
        dist.barrier(group=group.cpu_group)
