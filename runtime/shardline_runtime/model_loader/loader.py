"""Build a model for this TP rank and load its weights from a safetensors checkpoint."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.configs.pipeline_stage import PipelineStage
from shardline_runtime.model_loader.checkpoint_files import (
    TensorInfo,
    discover_checkpoint,
    iterate_weights,
)
from shardline_runtime.models.llama import LlamaForCausalLM
from shardline_runtime.models.registry import model_class_for

logger = logging.getLogger(__name__)
_NO_TENSOR: Any = (
    None  # stage_weights() only reads the names when asked which tensors a stage holds
)


def resolve_tying(model_config: ModelConfig, tensors: dict[str, TensorInfo]) -> ModelConfig:
    """Untie the LM head when the checkpoint stores an ``lm_head.weight`` that differs from the
    embedding, as transformers 5 does (it warns and keeps both); otherwise ``model_config``."""
    if not model_config.tie_word_embeddings or "lm_head.weight" not in tensors:
        return model_config
    pair = {
        name: tensor
        for name, tensor in iterate_weights(
            {n: tensors[n] for n in ("lm_head.weight", "model.embed_tokens.weight") if n in tensors}
        )
    }
    if len(pair) == 2 and torch.equal(pair["lm_head.weight"], pair["model.embed_tokens.weight"]):
        return model_config
    logger.warning(
        "tie_word_embeddings is true but lm_head.weight differs from the embedding: loading both (untied)"
    )
    return dataclasses.replace(model_config, tie_word_embeddings=False)


def build_model(
    model_config: ModelConfig, device: torch.device, stage: PipelineStage | None = None
) -> LlamaForCausalLM:
    """Instantiate the architecture's model (uninitialised weights) on ``device`` in its dtype;
    with a pipeline ``stage``, only the parts that stage owns (an embedding model: the
    architecture's decoder and a pooler, ``models/embedding_model.py``)."""
    cls = model_class_for(model_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            model = cls(model_config, stage=stage or PipelineStage())
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def load_model(
    model_config: ModelConfig,
    model_path: str,
    device: torch.device,
    prepare: Callable[[nn.Module], None] | None = None,
    stage: PipelineStage | None = None,
    before_tensor: Callable[[], None] | None = None,
) -> LlamaForCausalLM:
    """Check the files (fails fast on a missing/short shard), build the model, load weights
    (only the pipeline ``stage``'s, when given: its layers, embedding / norm / LM head).

    The model's ``config`` attribute is the config it was built with (see :func:`resolve_tying`).
    ``prepare(model)`` runs between building and loading (a weight update gives a candidate MoE
    model the live expert placement there, so it loads the experts the live slots hold).

    Raises:
        CheckpointError: file problems or a missing/unexpected/duplicate parameter.
    """
    model, tensors = build_for_load(model_config, model_path, device, prepare, stage)
    load_into(model, tensors, before_tensor)
    return model


def build_for_load(
    model_config: ModelConfig,
    model_path: str,
    device: torch.device,
    prepare: Callable[[nn.Module], None] | None = None,
    stage: PipelineStage | None = None,
) -> tuple[LlamaForCausalLM, dict[str, TensorInfo]]:
    """The first half of :func:`load_model`: the built (unloaded) model and the checkpoint
    tensors it will read. Building sets the process-wide default dtype for a moment, so a
    caller that loads on another thread builds on the thread that runs the model."""
    tensors = discover_checkpoint(model_path)
    model = build_model(resolve_tying(model_config, tensors), device, stage)
    if prepare is not None:
        prepare(model)
    if stage is not None and stage.pp_size > 1:  # read only the tensors this stage holds
        tensors = {
            n: info
            for n, info in tensors.items()
            if any(True for _ in model.stage_weights([(n, _NO_TENSOR)]))
        }
    return model, tensors


def load_into(
    model: LlamaForCausalLM,
    tensors: dict[str, TensorInfo],
    before_tensor: Callable[[], None] | None = None,
) -> None:
    """The second half of :func:`load_model`: read ``tensors`` into ``model`` (grad off; safe on
    a thread other than the one that built it). ``before_tensor()`` runs before each tensor.

    Raises:
        CheckpointError: a missing/unexpected/duplicate parameter; what ``before_tensor`` raises.
    """
    weights = iterate_weights(tensors)
    if before_tensor is not None:
        weights = _each_after(before_tensor, weights)
    with torch.no_grad():
        model.load_weights(weights)


def _each_after(
    check: Callable[[], None], weights: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    for named in weights:
        check()
        yield named
