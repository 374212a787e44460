"""Process groups of this process: the world, its tensor-parallel (TP) and pipeline (PP) groups.

One world per model replica: ``tp_size * pp_size`` ranks (data parallelism is separate worlds).
Ranks are laid out as SGLang lays them out: ``world_rank = pp_rank * tp_size + tp_rank``, so a
TP group is ``tp_size`` consecutive ranks (one pipeline stage) and a PP group is the ranks with
the same ``tp_rank``, one per stage (``tp_rank, tp_rank + tp_size, ...``). Backends: NCCL on CUDA,
gloo on CPU; a gloo "CPU group" is always there for Python objects (``broadcast_pyobj``, the
stage-to-stage messages) and small control collectives. With a world of 1 no process group is
created and every collective is a no-op.

Rendezvous is TCP at ``dist_init_addr`` (``host:port`` of TP rank 0). In Kubernetes the rank-0
name is a headless-Service DNS record that may not resolve until that pod exists, so we retry
resolution until ``timeout_s``. Every collective carries ``timeout_s``: a dead peer ends in an
error, not a hang.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class DistributedInitError(RuntimeError):
    """The process groups could not be formed (names the address, rank and what failed)."""


@dataclass
class GroupCoordinator:
    """This process's place in one group (the world, its TP group or its PP group).

    Attributes:
        rank: this process's rank inside the group, in [0, size).
        size: ranks in the group.
        ranks: world rank of each group rank (``ranks[rank]`` is this process's world rank).
        device: this process's device.
        device_group: the group for tensors on ``device`` (NCCL on CUDA, gloo on CPU).
        cpu_group: a gloo group over the same ranks, for Python objects and CPU tensors.
    """

    rank: int = 0
    size: int = 1
    ranks: tuple[int, ...] = (0,)
    device: torch.device = torch.device("cpu")
    device_group: Any = None
    cpu_group: Any = None

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.size - 1

    @property
    def first_rank(self) -> int:
        """World rank of group rank 0."""
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        """World rank of the group's last rank."""
        return self.ranks[-1]

    def world_rank_of(self, group_rank: int) -> int:
        """World rank of ``group_rank`` (the source or destination torch.distributed expects)."""
        return self.ranks[group_rank]


TensorParallelGroup = GroupCoordinator  # the TP group's type, by its older name

_TP = GroupCoordinator()
_PP = GroupCoordinator()
_WORLD = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    """The pipeline group: this TP rank's peer in every stage (``rank`` is the ``pp_rank``)."""
    return _PP


def get_world_group() -> GroupCoordinator:
    return _WORLD


def get_pipeline_model_parallel_rank() -> int:
    return _PP.rank


def get_pipeline_model_parallel_world_size() -> int:
    return _PP.size


def rank_layout(world_rank: int, tp_size: int) -> tuple[int, int]:
    """``(pp_rank, tp_rank)`` of ``world_rank`` (``world_rank = pp_rank * tp_size + tp_rank``)."""
    return divmod(world_rank, tp_size)


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def get_tensor_model_parallel_world_size() -> int:
    return _TP.size


def tp_ranks_of_node(tp_size: int, nnodes: int, node_rank: int, pp_size: int = 1) -> range:
    """The world ranks a node runs (one process per local GPU): ``node_rank * n .. + n`` with
    ``n = tp_size * pp_size / nnodes``; :func:`rank_layout` gives each one's (pp_rank, tp_rank).
    A node holds whole TP groups (stages) when ``nnodes`` divides ``pp_size``, else a slice of one.

    Raises:
        ValueError: ``tp_size * pp_size`` not divisible by ``nnodes`` or ``node_rank`` out of range.
    """
    world = tp_size * pp_size
    if nnodes < 1 or world % nnodes:
        raise ValueError(f"tp_size * pp_size = {world} must be divisible by nnodes {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in [0, {nnodes}), got {node_rank}")
    per_node = world // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def split_host_port(addr: str) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:port"`` for IPv6) -> (host, port).

    Raises:
        ValueError: not ``HOST:PORT`` with a port in [1, 65535].
    """
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"dist_init_addr must be HOST:PORT with PORT in [1, 65535], got {addr!r}")
    return host, int(port)


def wait_for_host(host: str, timeout_s: float, interval_s: float = 1.0) -> None:
    """Retry DNS resolution of ``host`` until it resolves or ``timeout_s`` passes.

    Raises:
        DistributedInitError: still unresolvable after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.getaddrinfo(host, None)
            return
        except socket.gaierror as e:
            if time.monotonic() >= deadline:
                raise DistributedInitError(
                    f"rendezvous host {host!r} did not resolve within {timeout_s}s: {e}"
                ) from None
            logger.info("waiting for rendezvous host %s to resolve (%s)", host, e)
            time.sleep(interval_s)


def init_distributed_environment(
    tp_rank: int,
    tp_size: int,
    device: torch.device,
    dist_init_addr: str | None = None,
    timeout_s: float = 600,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> GroupCoordinator:
    """Join (or, for a world of 1, skip) the world and form its TP and PP groups.

    Args:
        tp_rank: this process's rank in [0, tp_size) within its stage.
        tp_size: ranks per pipeline stage.
        device: ``cuda:<i>`` -> NCCL device groups; ``cpu`` -> gloo.
        dist_init_addr: ``host:port`` of world rank 0 (required when the world is larger than 1).
        timeout_s: rendezvous and per-collective timeout in seconds.
        pp_rank: this process's pipeline stage in [0, pp_size).
        pp_size: pipeline stages.

    Returns:
        The TP group (``get_pp_group()`` / ``get_world_group()`` give the others).

    Raises:
        DistributedInitError: missing address, unresolvable host, rendezvous failure, or an
            already initialised world of another size.
    """
    global _TP, _PP, _WORLD
    world_size, world_rank = tp_size * pp_size, pp_rank * tp_size + tp_rank
    if world_size == 1:
        _TP = GroupCoordinator(device=device)
        _PP = GroupCoordinator(device=device)
        _WORLD = GroupCoordinator(device=device)
        return _TP
    where = f"rank {world_rank}/{world_size} (tp {tp_rank}/{tp_size}, pp {pp_rank}/{pp_size})"
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != world_rank:
            raise DistributedInitError(
                f"torch.distributed is already initialised as rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"asked for {where}"
            )
    else:
        if not dist_init_addr:
            raise DistributedInitError(
                f"a world of {world_size} ranks needs dist_init_addr HOST:PORT of rank 0"
            )
        host, port = split_host_port(dist_init_addr)
        wait_for_host(host, timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        url_host = f"[{host}]" if ":" in host else host
        try:
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://{url_host}:{port}",
                world_size=world_size,
                rank=world_rank,
                timeout=timedelta(seconds=timeout_s),
                device_id=device if backend == "nccl" else None,
            )
        except Exception as e:  # the store raises several types; report one with context
            raise DistributedInitError(
                f"{where} failed to join the group at {dist_init_addr} ({backend}): {e}"
            ) from e
    backend = dist.get_backend()
    timeout = timedelta(seconds=timeout_s)

    def make(ranks: list[int]) -> tuple[Any, Any]:
        """(device group, CPU group) over ``ranks``; every rank creates every group, in order.
        A group of one rank has none (its collectives are no-ops)."""
        if len(ranks) == 1:
            return None, None
        device_group: Any
        if len(ranks) == world_size:
            device_group = dist.group.WORLD
        else:
            device_group = dist.new_group(ranks, backend=backend, timeout=timeout)
        cpu_group = (
            device_group
            if backend == "gloo"
            else dist.new_group(ranks, backend="gloo", timeout=timeout)
        )
        return device_group, cpu_group

    world_groups = make(list(range(world_size)))
    _WORLD = GroupCoordinator(
        world_rank, world_size, tuple(range(world_size)), device, *world_groups
    )
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        groups = make(ranks)
        if stage == pp_rank:
            _TP = GroupCoordinator(tp_rank, tp_size, tuple(ranks), device, *groups)
    for column in range(tp_size):
        ranks = list(range(column, world_size, tp_size))
        groups = make(ranks)
        if column == tp_rank:
            _PP = GroupCoordinator(pp_rank, pp_size, tuple(ranks), device, *groups)
    logger.info(
        "[%s] joined a world of %d (%s): tp %d, pp %d", where, world_size, backend, tp_size, pp_size
    )
    return _TP


def destroy_distributed_environment() -> None:
    """Leave the process group (if any) and reset to a world of 1."""
    global _TP, _PP, _WORLD
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP, _PP, _WORLD = GroupCoordinator(), GroupCoordinator(), GroupCoordinator()
