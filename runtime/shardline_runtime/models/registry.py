"""Model classes by ``config.json`` ``architectures[0]``: each class declares its
``architecture`` name and its rules for ``config.json`` (``sliding_windows``, ``moe_fields``), so
registering an architecture is its model file plus one line of :data:`MODELS`.

An embedding checkpoint (``ModelConfig.pooling`` set) is served by :class:`EmbeddingModel` over
the decoder of its architecture; it may also name the base model (``Qwen3Model``: what
``SentenceTransformer.save`` writes), which maps to the causal class of the same family."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardline_runtime.configs.model_config import ModelConfigError
from shardline_runtime.models.llama import LlamaForCausalLM
from shardline_runtime.models.llama_eagle import LlamaForCausalLMEagle
from shardline_runtime.models.llama_eagle3 import LlamaForCausalLMEagle3
from shardline_runtime.models.mistral import MistralForCausalLM
from shardline_runtime.models.mixtral import MixtralForCausalLM
from shardline_runtime.models.qwen2 import Qwen2ForCausalLM
from shardline_runtime.models.qwen2_moe import Qwen2MoeForCausalLM
from shardline_runtime.models.qwen3 import Qwen3ForCausalLM
from shardline_runtime.models.qwen3_moe import Qwen3MoeForCausalLM

if TYPE_CHECKING:
    from shardline_runtime.configs.model_config import ModelConfig

MODELS: tuple[type[LlamaForCausalLM], ...] = (
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    MistralForCausalLM,
    Qwen3MoeForCausalLM,
    Qwen2MoeForCausalLM,
    MixtralForCausalLM,
    LlamaForCausalLMEagle,
    LlamaForCausalLMEagle3,
)
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {m.architecture: m for m in MODELS}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The model class of ``architecture``.

    Raises:
        ModelConfigError: unknown architecture (lists the supported ones).
    """
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ModelConfigError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None


def causal_class_for(architecture: str, embedding: bool = False) -> type[LlamaForCausalLM] | None:
    """The registered class of ``architecture``; for an ``embedding`` checkpoint also of its
    base-model spelling (``Qwen3Model`` -> ``Qwen3ForCausalLM``). None when unknown."""
    if architecture in MODEL_REGISTRY:
        return MODEL_REGISTRY[architecture]
    if embedding and architecture.endswith("Model"):
        return MODEL_REGISTRY.get(architecture.removesuffix("Model") + "ForCausalLM")
    return None


def model_class_for(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class that serves ``config``: :class:`EmbeddingModel` for an embedding model, else
    the architecture's causal LM.

    Raises:
        ModelConfigError: unknown architecture (lists the supported ones).
    """
    if config.pooling is not None:
        from shardline_runtime.models.embedding_model import EmbeddingModel

        return EmbeddingModel
    return get_model_class(config.architecture)
