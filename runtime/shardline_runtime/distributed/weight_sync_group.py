"""The trainer weight-sync group: a process group of a trainer (rank 0) and every engine rank.

RL post-training loops (verl, slime, AReaL, OpenRLHF) push new weights into a running engine
from the trainer's own devices (SGLang's ``init_weights_update_group`` /
``update_weights_from_distributed``). The group is separate from the TP group: its own TCP
store at the trainer's ``master_address:master_port``, its own ranks (trainer 0, engine TP rank
``r`` at ``rank_offset + r``), its own backend (gloo on CPU, NCCL on GPU) and its own timeout,
so a dead trainer ends every collective in an error within ``timeout_s`` seconds instead of
hanging, and never disturbs the TP group.

The group is formed exactly as SGLang's ``init_custom_process_group``
(python/sglang/srt/utils) forms it, which verl, slime and OpenRLHF use on the trainer's side: a
``tcp://master_address:master_port`` rendezvous whose rank 0 hosts the store,
``PrefixStore(group_name, store)``, a process group on that store with no other collective,
then one broadcast per tensor from rank 0. So a trainer written for SGLang joins unchanged
(tested with such a trainer, gloo, TP=1 and TP=2: ``tests/serving/test_weight_sync_sglang_trainer.py``).
A trainer may also build its side with this function (``rank=0`` hosts the store)::

    group = init_weights_update_group("10.0.0.5", 29600, rank=0, world_size=1 + tp_size,
                                      group_name="sync", backend="nccl")
    broadcast(group, tensor)          # once per tensor, in the order named in the request
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
) -> WeightSyncGroup:
    """Join (``rank > 0``) or host (``rank == 0``) a weight-sync group.

    Args:
        master_address, master_port: the TCP store of rank 0 (the trainer).
        rank: this process's rank in ``[0, world_size)``.
        world_size: trainer processes + engine ranks.
        group_name: namespaces the store keys, so several groups can share one store.
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
        timeout_s: rendezvous and per-collective timeout in seconds.

    Raises:
        WeightSyncGroupError: bad backend, or the rendezvous failed within ``timeout_s``.
    """
    if backend not in BACKENDS:
        raise WeightSyncGroupError(f"backend must be one of {BACKENDS}, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    try:
        # SGLang's init_custom_process_group: a tcp:// rendezvous (rank 0 hosts the store), then
        # PrefixStore(group_name) with no trailing slash.
        store, _, _ = next(
            dist.rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout)
        )
        store.set_timeout(timeout)
        group_store = dist.PrefixStore(group_name, store)
        # torch's own group constructor (which SGLang calls) nests two more prefixes:
        # "{group_name}/" for the group and "{device}/" for its backend ("cpu/" for gloo, whose
        # first device is the CPU; "cuda/" for NCCL). Built here directly, so the group is not
        # registered in torch's global group table (a name can be used again after destroy)
        # and is never split from this rank's default NCCL group, which the trainer is not in.
        backend_store = dist.PrefixStore(
            "cpu/" if backend == "gloo" else "cuda/",
            dist.PrefixStore(f"{group_name}/", group_store),
        )
        pg: Any  # ProcessGroupGloo or ProcessGroupNCCL (no common typed base with broadcast)
        if backend == "gloo":
            # Connects to every member before it returns (a full mesh over the store).
            pg = dist.ProcessGroupGloo(backend_store, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(backend_store, rank, world_size, options)
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
