"""A stand-in trainer process: hosts a weight-sync group as rank 0 and broadcasts tensors.

    python weight_sync_trainer.py PLAN.json

``PLAN.json``: ``{"port", "world_size", "group_name", "timeout_s", "checkpoint", "die_after",
"tensors": [{"name", "source", "shape", "dtype"}]}``. Each tensor is the checkpoint's ``source``
tensor (cast to ``dtype``), or zeros of ``shape`` when ``source`` is null. With ``die_after: n``
the process SIGKILLs itself after broadcasting ``n`` tensors (a trainer dying mid-broadcast).
Prints ``joined``, then ``sent <i>`` per tensor, then ``done`` (flushed, for the test to follow).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
from safetensors.torch import load_file

from shardline_runtime.distributed.weight_sync_group import broadcast, init_weights_update_group


def main(plan_path: str) -> None:
    with open(plan_path, encoding="utf-8") as f:
        plan = json.load(f)
    weights = load_file(os.path.join(plan["checkpoint"], "model.safetensors"))
    group = init_weights_update_group("127.0.0.1", plan["port"], 0, plan["world_size"], plan["group_name"],
                                      "gloo", plan["timeout_s"])
    print("joined", flush=True)
    for i, spec in enumerate(plan["tensors"]):
        if plan.get("die_after") is not None and i == plan["die_after"]:
            os.kill(os.getpid(), signal.SIGKILL)
        dtype = getattr(torch, spec["dtype"])
        tensor = weights[spec["source"]].to(dtype) if spec["source"] else torch.zeros(spec["shape"], dtype=dtype)
        broadcast(group, tensor.contiguous())
        print("sent", i, flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
