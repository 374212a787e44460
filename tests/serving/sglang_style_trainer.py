"""A trainer built the way RL frameworks written for SGLang build theirs (verl, slime, OpenRLHF).

    python sglang_style_trainer.py PLAN.json

It does not use Shardline's code. The group is formed as SGLang's ``init_custom_process_group``
(python/sglang/srt/utils) forms it, which verl and OpenRLHF copy: a ``tcp://addr:port``
rendezvous (rank 0 hosts the store), ``PrefixStore(group_name, store)`` with no trailing slash,
a process group on that store through ``torch.distributed``'s own group constructor, and no
other collective; then one ``torch.distributed.broadcast`` per tensor from rank 0, in the
order the ``/update_weights_from_distributed`` request names them.

``PLAN.json``: ``{"port", "world_size", "group_name", "timeout_s", "checkpoint",
"tensors": [{"name", "shape", "dtype"}]}``; each tensor is the checkpoint's tensor ``name`` cast
to ``dtype``. Prints ``joined``, then ``done`` (flushed, for the test to follow).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)


def custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                         timeout: timedelta):
    """A process group outside the default one, formed as SGLang's ``init_custom_process_group``."""
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def main(plan_path: str) -> None:
    with open(plan_path, encoding="utf-8") as f:
        plan = json.load(f)
    weights = load_file(os.path.join(plan["checkpoint"], "model.safetensors"))
    group = custom_process_group("gloo", f"tcp://127.0.0.1:{plan['port']}", plan["world_size"], 0,
                                 plan["group_name"], timedelta(seconds=plan["timeout_s"]))
    print("joined", flush=True)
    for spec in plan["tensors"]:
        tensor = weights[spec["name"]].to(getattr(torch, spec["dtype"])).contiguous()
        dist.broadcast(tensor, src=0, group=group)
    print("done", flush=True)
    # Leave without the interpreter's teardown: destroying a live gloo group there can abort
    # ("terminate called without an active exception") after every broadcast has completed.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
