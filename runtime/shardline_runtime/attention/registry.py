"""Attention backends by name: ``--attention-backend {auto,torch_native,triton}``.

``auto`` is ``triton`` on CUDA and ``torch_native`` on CPU. The Triton backend is imported only
when chosen (its module imports ``triton``). On CPU it runs only under Triton's interpreter
(``TRITON_INTERPRET=1`` set before ``triton`` is imported), which is how CI checks it.
"""

from __future__ import annotations

import importlib
import os

import torch

from shardline_runtime.attention.base import AttentionBackend

# name -> "module:Class"; a backend module is imported only when it is chosen.
ATTENTION_BACKENDS = {
    "torch_native": "shardline_runtime.attention.torch_native_backend:TorchNativeAttnBackend",
    "triton": "shardline_runtime.attention.triton_backend:TritonAttnBackend",
}


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend ``name`` stands for on ``device`` (``auto``: triton on CUDA, torch_native on CPU).

    Raises:
        ValueError: unknown name (lists the allowed ones), or ``triton`` on CPU without
            ``TRITON_INTERPRET=1``.
    """
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch_native"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend must be one of auto, {', '.join(ATTENTION_BACKENDS)}; got {name!r}"
        )
    if (
        name == "triton"
        and torch.device(device).type == "cpu"
        and os.environ.get("TRITON_INTERPRET") != "1"
    ):
        raise ValueError(
            "--attention-backend triton on CPU needs TRITON_INTERPRET=1 (Triton's interpreter); "
            "use --attention-backend torch_native"
        )
    return name


def create_attention_backend(name: str, model_runner) -> AttentionBackend:
    """Instantiate backend ``name`` (already resolved) for ``model_runner``."""
    module_name, cls_name = ATTENTION_BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(model_runner)
