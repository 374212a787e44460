"""Stage-to-stage messages of pipeline parallelism, over this rank's PP group.

Each rank talks only to its peers with the same ``tp_rank`` in other stages (its PP group), so
the TP ranks of a stage send and receive in parallel. Two kinds of messages:

- Python objects (the scheduler's request messages, the last stage's sampled tokens): pickled into
  a uint8 tensor and sent as its length, then its bytes, over the gloo CPU group (after SGLang's
  ``point_to_point_pyobj``).
- Tensor dicts (``PPProxyTensors``: hidden states and residual): a small header object
  (names, shapes, dtypes) on the CPU group, then each tensor on the device group (NCCL on CUDA,
  gloo on CPU).

Sends are asynchronous (``isend``): the sender goes on with its next micro-batch while the
receiver catches up. :class:`PendingSends` keeps the buffers alive until their send completed.
Receives block. Both ends of a pair must post messages in the same order; the schedulers do
(every stage runs the same loop).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from shardline_runtime.distributed.parallel_state import get_pp_group


class PendingSends:
    """Asynchronous sends still in flight, with the tensors they read from.

    ``add`` keeps them, ``prune`` drops the finished ones, ``wait_all`` blocks for the rest (at
    shutdown, or before a collective that must not overtake them).
    """

    def __init__(self) -> None:
        self.items: list[tuple[Any, list[torch.Tensor]]] = []

    def add(self, works: list[Any], tensors: list[torch.Tensor]) -> None:
        self.items.append((works, tensors))
        self.prune()

    def prune(self) -> None:
        self.items = [
            (works, t) for works, t in self.items if not all(w.is_completed() for w in works)
        ]

    def wait_all(self) -> None:
        for works, _ in self.items:
            for work in works:
                work.wait()
        self.items = []


def _peer(stage: int) -> int:
    group = get_pp_group()
    if not 0 <= stage < group.size or stage == group.rank:
        raise ValueError(
            f"pipeline peer stage must be in [0, {group.size}) and not this stage {group.rank}, got {stage}"
        )
    return group.world_rank_of(stage)


def send_pyobj(obj: Any, dst_stage: int, pending: PendingSends) -> None:
    """Send a picklable ``obj`` to stage ``dst_stage`` (same TP rank), without waiting."""
    group = get_pp_group()
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    dst = _peer(dst_stage)
    works = [
        dist.isend(size, dst, group=group.cpu_group),
        dist.isend(data, dst, group=group.cpu_group),
    ]
    pending.add(works, [size, data])


def recv_pyobj(src_stage: int) -> Any:
    """Receive the next object stage ``src_stage`` sent with :func:`send_pyobj` (blocks)."""
    group = get_pp_group()
    src = _peer(src_stage)
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group.cpu_group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src, group=group.cpu_group)
    return pickle.loads(data.numpy().tobytes())


def send_tensor_dict(
    tensors: dict[str, torch.Tensor], dst_stage: int, pending: PendingSends
) -> None:
    """Send named tensors to stage ``dst_stage``: a header on the CPU group, then each tensor
    (contiguous, on this rank's device) on the device group; without waiting."""
    group = get_pp_group()
    header = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    send_pyobj(header, dst_stage, pending)
    dst = _peer(dst_stage)
    payload = [t.contiguous() for t in tensors.values()]
    works = [dist.isend(t, dst, group=group.device_group) for t in payload]
    pending.add(works, payload)


def recv_tensor_dict(src_stage: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Receive the tensors stage ``src_stage`` sent with :func:`send_tensor_dict` (blocks)."""
    group = get_pp_group()
    header = recv_pyobj(src_stage)
    src = _peer(src_stage)
    out: dict[str, torch.Tensor] = {}
    for name, shape, dtype in header:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src, group=group.device_group)
        out[name] = tensor
    return out
