"""Validate a checkpoint against a running model without touching live weights.

Used before an in-place weight update: reads only ``config.json`` and the safetensors headers
(plus a file-size check of every shard), never tensor data, and never the model's parameters.
The expected tensors and shapes come from the model class built on the ``meta`` device (no
memory) with the running config (``models/weight_loading.py: checkpoint_shapes``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardline_runtime.configs.model_config import ModelConfig, ModelConfigError, first_mismatch
from shardline_runtime.layers.parameter import loadable_dtype_problem
from shardline_runtime.layers.quantization.online_fp8 import requested_by
from shardline_runtime.model_loader.checkpoint_files import (
    SAFETENSORS_DTYPES,
    TensorInfo,
    discover_checkpoint,
)
from shardline_runtime.model_loader.errors import CheckpointError
from shardline_runtime.model_loader.loader import build_model
from shardline_runtime.models.weight_loading import checkpoint_tensors


def scheme_name(config: ModelConfig) -> str:
    """The quantization scheme ``config`` serves (``unquantized`` without one)."""
    return "unquantized" if config.quantization is None else config.quantization.scheme


def _fmt(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else str(tuple(shape))


def validate_checkpoint(
    model_path: str | Path, model_config: ModelConfig, model=None
) -> dict[str, TensorInfo]:
    """Check that the checkpoint at ``model_path`` can replace the running model's weights.

    Checks, in order: ``config.json`` parses and names the same architecture; every tensor
    the running model needs is present with the same full shape (the first mismatch is
    reported with the running and the new shape); no unexpected tensor; floating dtypes;
    every shard present and complete; ``MUST_MATCH_FIELDS`` of the config are equal (the
    quantization scheme among them). Dtypes: a high-precision float parameter takes any float
    dtype; a quantized one (FP8, packed int32, int64 shapes) only its own.

    Args:
        model_path: checkpoint directory.
        model_config: the running model's config.
        model: unused beyond documentation of intent (live weights are never read).

    Returns:
        The tensor map (name -> file, dtype, shape) for the loader.

    Raises:
        CheckpointError: the first problem found, naming the parameter or config field.
    """
    try:
        new = ModelConfig.from_pretrained(
            model_path,
            dtype="float32",
            context_length=model_config.context_len,
            quantization=requested_by(model_config.quantization),
        )
    except ModelConfigError as e:
        raise CheckpointError(str(e)) from None
    if new.architecture != model_config.architecture:
        raise CheckpointError(
            f"config field architectures[0]: running {model_config.architecture!r}, new checkpoint {new.architecture!r}"
        )
    if new.quantization != model_config.quantization:
        raise CheckpointError(
            f"config field quantization_config: running {scheme_name(model_config)!r}, new "
            f"checkpoint {scheme_name(new)!r}; an update keeps the scheme (restart to change it)"
        )
    tensors = discover_checkpoint(model_path)
    expected = build_model(model_config, torch.device("meta"))
    want = checkpoint_tensors(expected)
    ignored = expected.ignored_checkpoint_names()
    for name, (shape, param) in want.items():
        info = tensors.get(name)
        if info is None or info.shape != shape:
            got = info.shape if info else None
            raise CheckpointError(
                f"parameter {name}: shape {_fmt(shape)} in the running model, {_fmt(got)} in {model_path}"
            )
        dtype = SAFETENSORS_DTYPES.get(info.dtype)
        problem = (
            f"dtype {info.dtype}; expected one of {tuple(SAFETENSORS_DTYPES)}"
            if dtype is None
            else loadable_dtype_problem(param, dtype)
        )
        if problem is not None:
            raise CheckpointError(f"parameter {name}: {problem} (in {info.file})")
    for name in tensors:
        if name not in want and not name.endswith(ignored):
            raise CheckpointError(
                f"unexpected parameter {name} in {tensors[name].file} (the running model has no such parameter)"
            )
    mismatch = first_mismatch(model_config, new)
    if mismatch is not None:
        field, old_value, new_value = mismatch
        raise CheckpointError(
            f"config field {field}: running {old_value!r}, new checkpoint {new_value!r}"
        )
    return tensors
