"""The trainer weight-sync group: a process group of a trainer (rank 0) and every engine rank.

RL post-training loops (verl, slime, AReaL, OpenRLHF) push new weights into a running engine
from the trainer's own devices (SGLang's ``init_weights_update_group`` /
``update_weights_from_distributed``). The group is separate from the TP group: its own TCP
store at the trainer's ``master_address:master_port``, its own ranks (trainer 0, engine TP rank
``r`` at ``rank_offset + r``), its own backend (gloo on CPU, NCCL on GPU) and its own timeout,
so a dead trainer ends every collective in an error within ``timeout_s`` seconds instead of
hanging, and never disturbs the TP group.

The trainer builds its side with the same function (``rank=0`` hosts the store)::

    group = init_weights_update_group("10.0.0.5", 29600, rank=0, world_size=1 + tp_size,
                                      group_name="sync", backend="nccl")
    broadcast(group, tensor)          # once per tensor, in the order named in the request

It is plain ``torch.distributed`` (``TCPStore`` + ``PrefixStore(group_name)`` +
``ProcessGroupGloo`` / ``ProcessGroupNCCL``), so a trainer may also copy these few lines.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


class WeightSyncGroupError(RuntimeError):
    """The group could not be formed, or a collective on it failed or timed out."""


@dataclass
class WeightSyncGroup:
    """One trainer group as this process sees it."""

    name: str
    rank: int
    world_size: int
    backend: str
    timeout_s: float
    process_group: Any
    store: Any


def init_weights_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    device: torch.device | None = None,
) -> WeightSyncGroup:
    """Join (``rank > 0``) or host (``rank == 0``) a weight-sync group.

    Args:
        master_address, master_port: the TCP store of rank 0 (the trainer).
        rank: this process's rank in ``[0, world_size)``.
        world_size: trainer processes + engine ranks.
        group_name: namespaces the store keys, so several groups can share one store.
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
        timeout_s: rendezvous and per-collective timeout in seconds.
        device: the CUDA device of this rank (``nccl`` only).

    Raises:
        WeightSyncGroupError: bad backend, or the rendezvous failed within ``timeout_s``.
    """
    if backend not in BACKENDS:
        raise WeightSyncGroupError(f"backend must be one of {BACKENDS}, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(
            master_address, master_port, world_size, is_master=rank == 0, timeout=timeout
        )
        prefixed = dist.PrefixStore(f"{group_name}/", store)
        pg: Any  # ProcessGroupGloo or ProcessGroupNCCL (no common typed base with allreduce)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        # One tiny collective proves every member is there before the caller relies on it.
        probe = torch.zeros(1, device=device if backend == "nccl" else "cpu")
        pg.allreduce([probe]).wait(timeout)
    except Exception as exc:  # the store and the backends raise several types
        raise WeightSyncGroupError(
            f"rank {rank}/{world_size} could not join weight-sync group {group_name!r} at "
            f"{master_address}:{master_port} ({backend}) within {timeout_s}s: {exc}"
        ) from exc
    logger.info(
        "joined weight-sync group %r as rank %d/%d (%s)", group_name, rank, world_size, backend
    )
    return WeightSyncGroup(group_name, rank, world_size, backend, timeout_s, pg, store)


def broadcast(group: WeightSyncGroup, tensor: torch.Tensor, src: int = 0) -> None:
    """Broadcast ``tensor`` in place from rank ``src`` of ``group`` (every member calls it).

    Raises:
        WeightSyncGroupError: a member died, or the broadcast did not finish in the group's
            timeout.
    """
    try:
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.timeout = timedelta(seconds=group.timeout_s)
        group.process_group.broadcast([tensor], options).wait(options.timeout)
    except Exception as exc:
        raise WeightSyncGroupError(
            f"broadcast on weight-sync group {group.name!r} failed (the trainer may have died; "
            f"timeout {group.timeout_s}s): {exc}"
        ) from exc


def destroy_weights_update_group(group: WeightSyncGroup) -> None:
    """Release the group's connections (safe on a broken group)."""
    try:
        shutdown = getattr(group.process_group, "shutdown", None)
        if shutdown is not None:
            shutdown()
    except Exception as exc:  # a broken group may fail to shut down cleanly; it is dropped anyway
        logger.warning("weight-sync group %r did not shut down cleanly: %s", group.name, exc)
