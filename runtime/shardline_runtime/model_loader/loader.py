"""Build a model for this TP rank and load its weights from a safetensors checkpoint."""

from __future__ import annotations

import torch
from torch import nn

from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.model_loader.checkpoint_files import discover_checkpoint, iterate_weights
from shardline_runtime.models.registry import get_model_class


def build_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    """Instantiate the architecture's model (uninitialised weights) on ``device`` in its dtype."""
    cls = get_model_class(model_config.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            model = cls(model_config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def load_model(model_config: ModelConfig, model_path: str, device: torch.device) -> nn.Module:
    """Check the files (fails fast on a missing/short shard), build the model, load weights.

    Raises:
        CheckpointError: file problems or a missing/unexpected/duplicate parameter.
    """
    tensors = discover_checkpoint(model_path)
    model = build_model(model_config, device)
    with torch.no_grad():
        model.load_weights(iterate_weights(tensors))
    return model
