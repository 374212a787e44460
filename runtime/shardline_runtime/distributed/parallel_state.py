"""Tensor-parallel process group of this process: rendezvous, rank/size, device and CPU groups.

One TP group per process group world (world size = ``tp_size``; data parallelism is separate
TP groups, i.e. separate worlds). Backends: NCCL on CUDA, gloo on CPU; a gloo "CPU group" is
always there for Python objects (``broadcast_pyobj``) and small control collectives. With
``tp_size == 1`` no process group is created and every collective is a no-op.

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
    """The TP group could not be formed (names the address, rank and what failed)."""


@dataclass
class TensorParallelGroup:
    """This process's place in its TP group."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")
    device_group: Any = None
    cpu_group: Any = None


_TP = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def get_tensor_model_parallel_world_size() -> int:
    return _TP.size


def tp_ranks_of_node(tp_size: int, nnodes: int, node_rank: int) -> range:
    """The TP ranks a node runs (one process per local GPU): ``node_rank * n .. + n``.

    Raises:
        ValueError: ``tp_size`` not divisible by ``nnodes`` or ``node_rank`` out of range.
    """
    if nnodes < 1 or tp_size % nnodes:
        raise ValueError(f"tp_size {tp_size} must be divisible by nnodes {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in [0, {nnodes}), got {node_rank}")
    per_node = tp_size // nnodes
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
                raise DistributedInitError(f"rendezvous host {host!r} did not resolve within {timeout_s}s: {e}") from None
            logger.info("waiting for rendezvous host %s to resolve (%s)", host, e)
            time.sleep(interval_s)


def init_distributed_environment(
    tp_rank: int,
    tp_size: int,
    device: torch.device,
    dist_init_addr: str | None = None,
    timeout_s: float = 600,
) -> TensorParallelGroup:
    """Join (or, at ``tp_size == 1``, skip) the TP process group.

    Args:
        tp_rank: this process's rank in [0, tp_size).
        tp_size: world size of the group.
        device: ``cuda:<i>`` -> NCCL device group; ``cpu`` -> gloo.
        dist_init_addr: ``host:port`` of rank 0 (required when ``tp_size > 1``).
        timeout_s: rendezvous and per-collective timeout in seconds.

    Raises:
        DistributedInitError: missing address, unresolvable host, rendezvous failure, or an
            already initialised world of another size.
    """
    global _TP
    if tp_size == 1:
        _TP = TensorParallelGroup(rank=0, size=1, device=device)
        return _TP
    if dist.is_initialized():
        if dist.get_world_size() != tp_size or dist.get_rank() != tp_rank:
            raise DistributedInitError(
                f"torch.distributed is already initialised as rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"asked for rank {tp_rank}/{tp_size}"
            )
    else:
        if not dist_init_addr:
            raise DistributedInitError(f"tp_size {tp_size} needs dist_init_addr HOST:PORT of TP rank 0")
        host, port = split_host_port(dist_init_addr)
        wait_for_host(host, timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        url_host = f"[{host}]" if ":" in host else host
        try:
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://{url_host}:{port}",
                world_size=tp_size,
                rank=tp_rank,
                timeout=timedelta(seconds=timeout_s),
                device_id=device if backend == "nccl" else None,
            )
        except Exception as e:  # the store raises several types; report one with context
            raise DistributedInitError(
                f"rank {tp_rank}/{tp_size} failed to join the TP group at {dist_init_addr} ({backend}): {e}"
            ) from e
    backend = dist.get_backend()
    cpu_group: Any = dist.group.WORLD
    if backend != "gloo":
        cpu_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    _TP = TensorParallelGroup(rank=tp_rank, size=tp_size, device=device, device_group=dist.group.WORLD, cpu_group=cpu_group)
    logger.info("[tp %d] joined TP group of %d (%s)", tp_rank, tp_size, backend)
    return _TP


def destroy_distributed_environment() -> None:
    """Leave the process group (if any) and reset to ``tp_size == 1``."""
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = TensorParallelGroup()
