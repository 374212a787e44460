"""Validate a checkpoint against a running model without touching live weights.

Used before an in-place weight update: reads only ``config.json`` and the safetensors headers
(plus a file-size check of every shard), never tensor data, and never the model's parameters.
"""

from __future__ import annotations

from pathlib import Path

from shardline_runtime.configs.model_config import ModelConfig, ModelConfigError
from shardline_runtime.model_loader.checkpoint_files import FLOAT_DTYPES, TensorInfo, discover_checkpoint
from shardline_runtime.model_loader.errors import CheckpointError
from shardline_runtime.models.registry import get_model_class

# Config fields that change the meaning of weights with identical shapes.
_SEMANTIC_FIELDS = ("architecture", "rope_parameters", "rms_norm_eps", "tie_word_embeddings", "qk_norm",
                    "sliding_windows", "hidden_act", "num_experts_per_tok", "norm_topk_prob", "moe_layers")


def _fmt(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else str(tuple(shape))


def validate_checkpoint(model_path: str | Path, model_config: ModelConfig, model=None) -> dict[str, TensorInfo]:
    """Check that the checkpoint at ``model_path`` can replace the running model's weights.

    Checks, in order: ``config.json`` parses and names the same architecture; every tensor
    the running model needs is present with the same full shape (the first mismatch is
    reported with the running and the new shape); no unexpected tensor; floating dtypes;
    every shard present and complete; config fields that change the meaning of the weights
    (RoPE, norm epsilon, tying) are equal.

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
        new = ModelConfig.from_pretrained(model_path, dtype="float32", context_length=model_config.context_len)
    except ModelConfigError as e:
        raise CheckpointError(str(e)) from None
    if new.architecture != model_config.architecture:
        raise CheckpointError(
            f"config field architectures[0]: running {model_config.architecture!r}, new checkpoint {new.architecture!r}"
        )
    tensors = discover_checkpoint(model_path)
    want = get_model_class(model_config.architecture).checkpoint_shapes(model_config)
    ignored = ("rotary_emb.inv_freq", ".k_scale", ".v_scale") + (("lm_head.weight",) if model_config.tie_word_embeddings else ())
    for name, shape in want.items():
        info = tensors.get(name)
        got = info.shape if info else None
        if got != shape:
            raise CheckpointError(
                f"parameter {name}: shape {_fmt(shape)} in the running model, {_fmt(got)} in {model_path}"
            )
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"parameter {name}: dtype {info.dtype} in {info.file}; expected one of {FLOAT_DTYPES}")
    for name in tensors:
        if name not in want and not name.endswith(ignored):
            raise CheckpointError(f"unexpected parameter {name} in {tensors[name].file} (the running model has no such parameter)")
    for field in _SEMANTIC_FIELDS:
        old_value, new_value = getattr(model_config, field), getattr(new, field)
        if old_value != new_value:
            raise CheckpointError(f"config field {field}: running {old_value!r}, new checkpoint {new_value!r}")
    return tensors
