"""Shared fixtures: tiny checkpoints built with transformers (no hub downloads here)."""

from __future__ import annotations

import json
import os

import pytest

pytest_plugins = ["tests.kube_fixtures"]


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run bench/gpu_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory ``make(arch="llama", seed=0, **overrides) -> Path`` of cached tiny checkpoints.

    Same arguments give the same directory within a session; see
    ``shardline_runtime.tiny_checkpoint.make_tiny_checkpoint`` for the arguments.
    """
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    cache: dict[str, os.PathLike] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides):
        key = json.dumps([arch, seed, overrides], sort_keys=True, default=str)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt-{arch}-s{seed}")
            make_tiny_checkpoint(path, arch=arch, seed=seed, **overrides)
            cache[key] = path
        return cache[key]

    return make
